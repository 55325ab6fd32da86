"""The engine against the reference model: greedy tokens, logprobs, preemption, chunking,
prefix caching, sampling, stops, and every KV block freed."""
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asynct import LLM, SamplingParams

# module-scoped engines live beside each test's own: on a GPU an engine takes its share of what
# is free, leaving the next none, so these get a fixed cache
SHARED = dict(num_kv_blocks=4096)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TINY_GSM = Path(__file__).resolve().parents[1] / "models" / "tiny-gsm"     # the shipped trained model
QUESTION = "Question: Tom has 3 apples and buys 4 more. How many apples does Tom have now?\nAnswer:"


def random_prompts(n, lo, hi, seed, prefix=()):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [list(prefix) + torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


def reference_greedy(model, prompts, max_new):
    """Left-padded batched generate (equal to one-by-one, see test_reference)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 257)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         pad_token_id=257, eos_token_id=None)
    return out[:, width:].tolist()


def assert_all_blocks_free(llm):
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.llm_engine.requests
    # every sequence's host block-table row was given back, zeroed
    assert len(bm.tables.free_rows) == bm.tables.array.shape[0] and not bm.tables.array.any()


SETTINGS = {
    "default": dict(),
    "preempting": dict(num_kv_blocks=24, max_num_seqs=16),
    "chunked": dict(max_num_batched_tokens=37),
    "triton-backend": dict(attention_backend="triton", max_num_batched_tokens=64),
    "block4": dict(block_size=4, num_kv_blocks=200),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_matches_reference(tiny_ckpt, reference, name):
    prompts = random_prompts(32, 1, 200, seed=len(name)) + random_prompts(8, 1, 40, 9, prefix=range(70))
    llm = LLM(tiny_ckpt, **SETTINGS[name])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    # a second wave re-uses the blocks the first left in the prefix cache
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts[-8:]], GREEDY, use_tqdm=False)
    prompts += prompts[-8:]
    expected = reference_greedy(reference, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == prompts
    assert sum(o.num_cached_tokens for o in outs[-8:]) >= 8 * 64
    engine = llm.llm_engine
    if name == "preempting":
        assert engine.scheduler.num_preemptions > 0
    if name == "chunked":
        assert engine.stats["steps"] > 40
    assert engine.block_manager.num_hits > 0       # the shared 70-token prefix
    assert_all_blocks_free(llm)


def test_logprobs_match_reference(tiny_ckpt, reference):
    llm = LLM(tiny_ckpt, max_num_batched_tokens=50)
    prompts = random_prompts(4, 5, 90, seed=3)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        full = p + o.outputs[0].token_ids
        with torch.no_grad():
            ref = reference(torch.tensor([full])).logits[0].log_softmax(-1)
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        for pos in range(1, len(full)):
            entry = o.prompt_logprobs[pos] if pos < len(p) else o.outputs[0].logprobs[pos - len(p)]
            tok = full[pos]
            assert abs(entry[tok].logprob - ref[pos - 1, tok].item()) < 1e-4
            assert entry[tok].rank == int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1
            top = ref[pos - 1].topk(3 if pos >= len(p) else 2)
            for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
                assert abs(entry[tid].logprob - lp) < 1e-4
        cum = sum(e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids))
        assert abs(o.outputs[0].cumulative_logprob - cum) < 1e-6
    assert_all_blocks_free(llm)


def test_prompt_logprobs_from_a_start_take_the_prefix_cache(tiny_ckpt, reference):
    """prompt_logprobs_start: entries before it are None, the prompt's full blocks before the
    first position whose logits it needs come from the prefix cache (a prompt_logprobs request
    takes no hit otherwise), and the entries from it on equal the reference's."""
    llm = LLM(tiny_ckpt)
    bs = llm.llm_engine.block_manager.block_size
    context = random_prompts(1, 70, 70, seed=8)[0]
    llm.generate([{"prompt_token_ids": context + [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
    prompt = context + [9, 8, 7]
    with torch.no_grad():
        ref = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for start in (0, 20, 2 * bs, 4 * bs, 70, 72, 200):    # position start - 1 is computed: 2 * bs caches 1 block
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, prompt_logprobs_start=start)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        first = min(max(start, 1), len(prompt))
        assert out.num_cached_tokens == (first - 1) // bs * bs, start
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[:first] == [None] * first
        for pos in range(first, len(prompt)):
            assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
    with pytest.raises(ValueError, match="prompt_logprobs_start must be >= 0"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
    assert_all_blocks_free(llm)


def test_seeded_sampling(tiny_ckpt):
    llm = LLM(tiny_ckpt)
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}

    def run(seed, others=0, **kw):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=20, ignore_eos=True, **kw)
        batch = [prompt] + random_prompts(others, 3, 30, seed=others)
        free = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
        return llm.generate(batch, [params] + [free] * others, use_tqdm=False)[0].outputs[0].token_ids

    a = run(1)
    assert a == run(1, others=5)             # same tokens in any batch
    assert a != run(2)
    assert run(1, top_k=3) == run(1, top_k=3, others=3)
    assert run(3, top_p=0.5, min_p=0.1) == run(3, top_p=0.5, min_p=0.1)
    assert_all_blocks_free(llm)


def test_sampling_filters_restrict_support(tiny_ckpt, reference):
    llm = LLM(tiny_ckpt)
    p = [5, 6, 7]
    with torch.no_grad():
        top2 = set(reference(torch.tensor([p])).logits[0, -1].topk(2).indices.tolist())
    outs = llm.generate([{"prompt_token_ids": p}] * 20, SamplingParams(temperature=5.0, top_k=2, max_tokens=1),
                        use_tqdm=False)
    assert {o.outputs[0].token_ids[0] for o in outs} <= top2


def test_stop_strings_and_tokens(tiny_ckpt):
    llm = LLM(tiny_ckpt)
    base = llm.generate("The answer is", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 6, text
    stop = text[3:5]
    cut = llm.generate("The answer is", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == text[:text.find(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    keep = llm.generate("The answer is", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                                        include_stop_str_in_output=True), use_tqdm=False)[0]
    assert keep.outputs[0].text == text[:text.find(stop) + len(stop)]
    tok = base.token_ids[4]
    by_tok = llm.generate("The answer is", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tok]),
                          use_tqdm=False)[0].outputs[0]
    assert by_tok.token_ids == base.token_ids[:base.token_ids.index(tok) + 1] and by_tok.stop_reason == tok
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def gsm():
    return LLM(TINY_GSM, **SHARED)


def test_stop_strings_wait_for_min_tokens(gsm):
    """As vLLM: the text of the first min_tokens tokens is not searched for stop strings (the
    model answers " 3 + 4 = 7\n#### 7": the first newline comes before 12 tokens), so it stays
    whole and the first stop string after it ends the output."""
    def gen(**kw):
        return gsm.generate(QUESTION, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]
    whole = gen(max_tokens=40, min_tokens=12)
    early = len(gsm.get_tokenizer().decode(whole.token_ids[:12]))
    assert "\n" in whole.text[:early]
    cut = gen(max_tokens=40, min_tokens=12, stop=["\n"])
    assert cut.text == whole.text[:whole.text.index("\n", early)]
    assert cut.token_ids == whole.token_ids[:len(cut.token_ids)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", "\n")
    # never past min_tokens: a stop string seen early neither cuts the text nor names the reason
    short = gen(max_tokens=5, min_tokens=5, stop=[" "])
    assert short.text == gsm.get_tokenizer().decode(short.token_ids) and short.text.count(" ") > 1
    assert (short.finish_reason, short.stop_reason) == ("length", None)


def test_detokenize_false_gives_token_ids_only(gsm):
    """vLLM's detokenize=False: the same tokens and logprobs, no text and no decoded tokens,
    streamed or not; stop strings (they match text) are refused by name. Both were a TypeError."""
    kw = dict(temperature=0, max_tokens=12, logprobs=1, prompt_logprobs=1)
    want = gsm.generate(QUESTION, SamplingParams(**kw), use_tqdm=False)[0]
    got = gsm.generate(QUESTION, SamplingParams(detokenize=False, spaces_between_special_tokens=False, **kw),
                       use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and want.outputs[0].text
    assert got.outputs[0].text == ""
    assert [{t: lp.logprob for t, lp in e.items()} for e in got.outputs[0].logprobs] == \
        [{t: lp.logprob for t, lp in e.items()} for e in want.outputs[0].logprobs]
    assert all(lp.decoded_token is None for e in got.outputs[0].logprobs for lp in e.values())
    assert all(lp.decoded_token is None for e in got.prompt_logprobs[1:] for lp in e.values())
    engine = gsm.llm_engine
    engine.add_request("s", QUESTION, SamplingParams(detokenize=False, temperature=0, max_tokens=6), stream=True)
    outs = [o for _ in range(20) for o in engine.step() if o.request_id == "s"]
    assert {o.outputs[0].text for o in outs} == {""} and outs[-1].finished
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop=["\n"])


def test_stop_token_text_is_left_out(gsm):
    """As vLLM: the stop token that ends an output (one of stop_token_ids, or EOS) stays in
    token_ids but its text is left out, unless include_stop_str_in_output; so a newline stop
    token gives the text that the newline as a stop string gives."""
    nl = gsm.get_tokenizer().encode("\n", add_special_tokens=False)[0]

    def gen(llm=gsm, **kw):
        return llm.generate(QUESTION, SamplingParams(temperature=0, max_tokens=40, **kw), use_tqdm=False)[0].outputs[0]
    want = gen(stop=["\n"]).text
    for kw in (dict(), dict(stop=["never"])):      # text decoded at the finish; incremental text
        by_token = gen(stop_token_ids=[nl], **kw)
        assert by_token.text == want and by_token.token_ids[-1] == nl and by_token.stop_reason == nl
        assert gen(stop_token_ids=[nl], include_stop_str_in_output=True, **kw).text == want + "\n"
    eos_is_nl = LLM(TINY_GSM)
    eos_is_nl.llm_engine.eos_token_ids = eos_is_nl.llm_engine.runner.eos_token_ids = [nl]
    for kw in (dict(), dict(stop=["never"])):
        by_eos = gen(eos_is_nl, **kw)
        assert by_eos.text == want and by_eos.token_ids[-1] == nl
        assert (by_eos.finish_reason, by_eos.stop_reason) == ("stop", None)
        assert gen(eos_is_nl, include_stop_str_in_output=True, **kw).text == want + "\n"


def test_a_failed_lazy_capture_leaves_decoding_eager(tiny_ckpt, monkeypatch, caplog):
    """lazy_decode_graphs mid-run: a capture that fails (out of memory, say) is tried once,
    logged, and every request still finishes, eagerly (a CPU stand-in for the CUDA capture)."""
    from asynct.engine import runner_startup
    calls = []

    def failing(*args):
        calls.append(1)
        raise RuntimeError("out of memory (a stand-in)")
    monkeypatch.setattr(runner_startup, "CudaGraphRunner", failing)
    llm = LLM(tiny_ckpt, num_kv_blocks=64, lazy_decode_graphs=True)
    runner = llm.llm_engine.runner
    runner.decode_graphs_pending = True      # what allocate_kv_cache leaves on CUDA
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([[1, 2, 3 + i] for i in range(4)], params, use_tqdm=False)
        assert all(o.error is None and len(o.outputs[0].token_ids) == 4 for o in outs)
    assert calls == [1] and runner.graphs is None and "decode steps run eagerly" in caplog.text


def test_an_engine_freezes_the_startup_heap_while_it_lives(tiny_ckpt):
    """An oldest-generation collection walked the whole start-up heap (torch, transformers, the
    model: some 400,000 objects, 160-210 ms, a step that long now and then); a built engine
    freezes it out of the collector's sight, and the last engine alive unfreezes it when freed."""
    import gc
    from asynct.engine import startup_heap
    live = len(startup_heap.owners())
    llm = LLM(tiny_ckpt)
    assert gc.get_freeze_count() > 10_000 and llm.llm_engine in startup_heap.owners()
    del llm
    assert len(startup_heap.owners()) == live and (live or gc.get_freeze_count() == 0)


def test_bad_requests_fail_alone(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": [1] * 100}, {"prompt_token_ids": [1, 2, 3]},
                         {"prompt_token_ids": [999]}, {"prompt_token_ids": []}],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert "max_model_len=64" in outs[0].error and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    assert "vocabulary" in outs[2].error and "empty" in outs[3].error
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_settings_that_ban_every_token_fail_their_request_alone(tiny_ckpt, temperature):
    """allowed_token_ids=[7] with 7 a stop token held back by min_tokens leaves no token to draw:
    the row drew token 0, silently. Now its request ends with an error naming the settings, at
    its first token or later (min_tokens counts the tokens already out); the others run on."""
    llm = LLM(tiny_ckpt)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    banned = SamplingParams(temperature=temperature, allowed_token_ids=[7], stop_token_ids=[7], min_tokens=3,
                            max_tokens=6, seed=1)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 5, 30, seed=4)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    outs = llm.generate(prompts + prompts[:1], [plain, banned, plain, banned], use_tqdm=False)
    for o in (outs[1], outs[3]):
        assert "no token can be sampled" in o.error and "min_tokens" in o.error
        assert o.outputs[0].finish_reason == "error" and 0 not in o.outputs[0].token_ids
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [want[0], want[2]]
    allowed_alone = SamplingParams(temperature=temperature, allowed_token_ids=[7], max_tokens=3, seed=1)
    assert llm.generate(prompts[:1], allowed_alone, use_tqdm=False)[0].outputs[0].token_ids == [7, 7, 7]
    assert_all_blocks_free(llm)


def test_any_of_a_config_s_eos_ids_ends_a_sequence(tiny_ckpt, tmp_path):
    """transformers configs may hold a list of EOS ids (Llama 3's holds three): the engine compared
    each token with the list itself (never equal: nothing stopped at EOS) and min_tokens requests
    failed with a TypeError. Any of the ids ends a sequence, and none comes before min_tokens."""
    import json
    import shutil
    prompt = {"prompt_token_ids": [72, 101, 108, 108, 111]}
    base = LLM(tiny_ckpt).generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    eos = base[3]
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "eos-list")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], eos]}))
    llm = LLM(ckpt)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    cut = base.index(eos) + 1
    assert (out.token_ids, out.finish_reason) == (base[:cut], "stop")
    late = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, min_tokens=cut + 1),
                        use_tqdm=False)[0].outputs[0]
    assert late.finish_reason in ("stop", "length") and eos not in late.token_ids[:cut]
    assert len(late.token_ids) > cut


def test_an_eos_id_of_minus_one_is_none(tiny_ckpt, tmp_path):
    """Converters write eos_token_id -1 for "none": such a checkpoint runs, with no EOS id."""
    import json
    import shutil
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "eos-none")
    for name in ("config.json", "generation_config.json"):    # a converter writes it in both
        config = json.loads((ckpt / name).read_text())
        (ckpt / name).write_text(json.dumps({**config, "eos_token_id": -1}))
    llm = LLM(ckpt)
    assert llm.llm_engine.eos_token_ids == [] and llm.llm_engine.runner.eos_token_ids == []
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4, min_tokens=2),
                       use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("settings", [dict(), dict(max_num_batched_tokens=7, num_kv_blocks=6)],
                         ids=["plain", "chunked-preempting"])
def test_prompt_tokens_count_every_prompt_position(tiny_ckpt, settings):
    """The computed-prompt-token count (progress bar, /metrics, the server's throughput line) took
    every one-token query for a decode: one-token prompts, and the last token after a prefix-cache
    hit, were never counted (64 one-token prompts read 0 toks/s)."""
    llm = LLM(tiny_ckpt, **settings)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [i]} for i in range(1, 9)] + [{"prompt_token_ids": list(range(1, 34))}]
    llm.generate(prompts, params, use_tqdm=False)
    preempted = engine.scheduler.num_preemptions
    assert engine.stats["prompt_tokens"] >= 8 + 33 and (preempted or engine.stats["prompt_tokens"] == 8 + 33)
    before = engine.stats["prompt_tokens"]
    out, = llm.generate(prompts[-1:], params, use_tqdm=False)     # all but its last token cached
    assert engine.stats["prompt_tokens"] - before == 33 - out.num_cached_tokens >= 1


def test_generation_stops_at_max_model_len(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_model_len=20)
    out = llm.generate({"prompt_token_ids": [1] * 15}, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


@pytest.mark.parametrize("settings", [dict(), dict(async_scheduling=False), dict(max_num_batched_tokens=7)],
                         ids=["async", "sync", "chunked"])
def test_a_prompt_of_the_whole_context_is_scored(tiny_ckpt, settings):
    """As vLLM's LLM, a prompt of max_model_len tokens runs: its prompt logprobs (what lm-eval scores
    a whole-context window by) are those of a longer context, then one token ends it at "length".
    It was refused, and lm-eval's windows stopped 2 tokens short of the context."""
    prompt = {"prompt_token_ids": random_prompts(1, 20, 20, seed=4)[0]}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    full, = LLM(tiny_ckpt, max_model_len=20, **settings).generate(prompt, params, use_tqdm=False)
    roomy, = LLM(tiny_ckpt, **settings).generate(prompt, params, use_tqdm=False)
    assert full.error is None and full.outputs[0].finish_reason == "length"
    assert full.outputs[0].token_ids == roomy.outputs[0].token_ids[:1]
    got, want = ([e[t].logprob for e, t in zip(o.prompt_logprobs[1:], prompt["prompt_token_ids"][1:])]
                 for o in (full, roomy))
    assert got == pytest.approx(want, abs=1e-5)


def test_max_model_len_beyond_the_rope_tables_is_a_clear_error(tiny_ckpt):
    """The tiny model's RoPE tables hold 2048 positions: a longer max_model_len let a long prompt
    index past them; now the engine refuses to start, naming both numbers (as vLLM does)."""
    with pytest.raises(ValueError, match="max_model_len=2049 exceeds the model's max_position_embeddings=2048"):
        LLM(tiny_ckpt, max_model_len=2049)
    assert LLM(tiny_ckpt, max_model_len=2048).llm_engine.max_model_len == 2048


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0),
                                 dict(min_p=2), dict(n=0), dict(logprobs=-2), dict(stop=[""]),
                                 dict(min_tokens=5, max_tokens=2), dict(seed="x"),
                                 # wrong types and values outside what the dtypes hold (issue 17)
                                 dict(stop=5), dict(stop_token_ids=5), dict(stop_token_ids=[True]),
                                 dict(seed=2**64), dict(seed=-2**63 - 1), dict(top_k=2**63),
                                 dict(temperature=float("inf")), dict(temperature=float("nan")),
                                 dict(temperature=10**400), dict(n=True), dict(ignore_eos="no"),
                                 dict(max_tokens="3"), dict(seed=4.0), dict(logprobs=True)])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValueError, match="invalid SamplingParams") as e:
        SamplingParams(**bad)
    # the field comes with it, also across processes (a pool's worker raising it)
    again = pickle.loads(pickle.dumps(e.value))
    assert again.param == e.value.param in bad and str(again) == str(e.value)


def test_a_tiny_temperature_is_raised_to_the_floor(caplog):
    """As vLLM: a positive temperature below 0.01 is raised to 0.01 with a warning (it samples);
    only 0 is greedy. It was taken as greedy below 1e-5 and as given in between, where
    logits / temperature can overflow."""
    for t in (1e-50, 1e-5, 0.005):
        p = SamplingParams(temperature=t)
        assert p.temperature == 0.01 and not p.greedy
    assert "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.02).temperature == 0.02


# each fits SamplingParams but not the tiny model (vocabulary 259), or broke the step before issue 17
BREAKERS = [dict(min_tokens=2, stop_token_ids=[99999]), dict(logprobs=300), dict(prompt_logprobs=300),
            dict(top_k=2**40, top_p=0.9), dict(seed=2**64 - 1), dict(seed=-2**63)]


@pytest.mark.parametrize("bad", BREAKERS, ids=[str(b) for b in BREAKERS])
def test_offline_llm_keeps_working_after_a_bad_request(tiny_ckpt, llm_shared, bad):
    """The bad request fails alone; its neighbour and every later call are served."""
    outs = llm_shared.generate(["hi", {"prompt": "hi"}], [GREEDY, SamplingParams(max_tokens=6, **bad)],
                               use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 8
    if bad.get("seed") is None:
        assert "vocabulary" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert llm_shared.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_all_blocks_free(llm_shared)


@pytest.mark.parametrize("prompt", [{"prompt_token_ids": 5}, {"prompt_token_ids": None}, {"prompt": 5}, 3.5,
                                    {"prompt_token_ids": [1, "2"]}, {}, {"prompt_token_ids": "hi"},
                                    {"prompt": [1, 2]},
                                    # a lone surrogate: the tokenizer's TypeError failed the whole call
                                    "a\ud800b", {"prompt": "\udfff"}])
def test_malformed_prompt_fails_alone(llm_shared, prompt):
    outs = llm_shared.generate([prompt, "hi"], GREEDY, use_tqdm=False)
    assert outs[0].error and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 8
    assert_all_blocks_free(llm_shared)


@pytest.mark.parametrize("field,value", [("n", 0), ("temperature", float("nan")), ("top_k", -5), ("max_tokens", -1)])
def test_a_bad_field_set_after_the_params_were_made_fails_alone(llm_shared, field, value):
    """vLLM's examples set fields of get_default_sampling_params(); such a field went unchecked:
    n=0 failed the whole call with a KeyError, a NaN temperature drew token 0."""
    params = llm_shared.get_default_sampling_params()
    setattr(params, field, value)
    outs = llm_shared.generate(["hi", "hi"], [GREEDY, params], use_tqdm=False)
    assert outs[0].error is None and f"{field} must be" in outs[1].error
    assert_all_blocks_free(llm_shared)


def test_a_stop_set_after_the_params_were_made_stops(llm_shared):
    """stop_list is made from stop when the params are made: a stop set later was ignored."""
    text = llm_shared.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].text
    params = llm_shared.get_default_sampling_params()
    params.temperature, params.max_tokens, params.ignore_eos, params.stop = 0, 8, True, [text[4]]
    want = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[text[4]])
    got = [llm_shared.generate("hi", p, use_tqdm=False)[0].outputs[0] for p in (params, want)]
    assert got[0].text == got[1].text != text and got[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def llm_shared(tiny_ckpt):
    return LLM(tiny_ckpt, **SHARED)


def test_start_up_seconds_name_their_parts(llm_shared):
    """Start-up lines split an engine's start by part; the kernels compiled ahead (most of a
    fresh GPU machine's start) are their own part, not counted as loading weights (none on a CPU)."""
    seconds = llm_shared.llm_engine.startup_seconds
    assert list(seconds) == ["weights", "compile", "profile", "kv_cache", "decode_graphs", "piecewise_graphs"]
    assert all(v >= 0 for v in seconds.values())
    if llm_shared.llm_engine.device.type == "cpu":
        assert seconds["compile"] == 0


def test_abort_frees_blocks_and_n_samples(tiny_ckpt):
    llm = LLM(tiny_ckpt)
    engine = llm.llm_engine
    engine.add_request("a", [1, 2, 3] * 20, SamplingParams(max_tokens=50, ignore_eos=True, n=3, seed=0))
    engine.add_request("b", [4, 5] * 20, SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].request_id == "b" and outs[-1].finished
    assert_all_blocks_free(llm)
    many = llm.generate({"prompt_token_ids": [7, 8, 9]}, SamplingParams(n=3, max_tokens=6, seed=4, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [o.index for o in many.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1


def test_aborted_queued_requests_leave_the_queue_in_order(tiny_ckpt):
    """Requests still waiting, aborted from the middle and the end of the queue: the rest stay in
    the order they came, are admitted so and finish; every block is free after."""
    llm = LLM(tiny_ckpt, max_num_seqs=2)
    engine = llm.llm_engine
    for i in range(6):
        engine.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.abort_request("r5")
    engine.abort_request("r2")
    assert [s.request_id for s in engine.scheduler.waiting] == ["r0", "r1", "r3", "r4"]
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert sorted(done[:2]) == ["r0", "r1"] and sorted(done[2:]) == ["r3", "r4"]
    assert_all_blocks_free(llm)


def test_text_prompt_needs_tokenizer(tmp_path):
    from asynct.model.checkpoint import make_checkpoint
    path = make_checkpoint("tiny", tmp_path, tokenizer=False)
    llm = LLM(path)
    out = llm.generate(["hello", {"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert "no tokenizer" in out[0].error
    assert len(out[1].outputs[0].token_ids) == 3 and out[1].outputs[0].text == ""


def test_stop_strings_without_a_tokenizer_are_a_clear_error(tmp_path):
    """No tokenizer, no text to search: stop strings were ignored and generation ran to max_tokens."""
    from asynct.model.checkpoint import make_checkpoint
    llm = LLM(make_checkpoint("tiny", tmp_path, tokenizer=False))
    prompt = {"prompt_token_ids": [1, 2]}
    out = llm.generate(prompt, SamplingParams(max_tokens=3, stop=["a"]), use_tqdm=False)[0]
    assert "stop strings need a tokenizer" in out.error
    by_token = llm.generate(prompt, SamplingParams(max_tokens=3, stop_token_ids=[0]), use_tqdm=False)[0]
    assert by_token.error is None and by_token.outputs[0].finish_reason is not None


def test_bf16_engine_keeps_fp32_rope_and_norms(tiny_ckpt, reference):
    llm = LLM(tiny_ckpt, dtype="bfloat16")
    model = llm.llm_engine.runner.model
    assert model.cos_sin_cache.dtype == torch.float32 and model.layers[0].attn.sigma.dtype == torch.float32
    assert model.layers[0].qkv_proj.weight.dtype == torch.bfloat16
    prompts = random_prompts(6, 5, 60, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for p, o in zip(prompts, outs):   # bf16 agrees with fp32 to bf16 rounding
        with torch.no_grad():
            ref = reference(torch.tensor([p])).logits[0].log_softmax(-1)
        got = torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
        want = torch.tensor([ref[i - 1, p[i]].item() for i in range(1, len(p))])
        assert ((got - want).norm() / want.norm()).item() < 2e-2


def streamed_texts(llm, prompt, params) -> list[str]:
    """A streamed request's cumulative text at each step, driven through the LLMEngine step API."""
    engine = llm.llm_engine
    engine.add_request("streamed", prompt, params, stream=True)
    texts = []
    while engine.has_unfinished_requests():
        texts += [out.outputs[0].text for out in engine.step()]
    return texts


def test_streamed_text_is_never_taken_back(gsm):
    """As vLLM (stop_buffer_length): while a stream runs, its last len(longest stop) - 1
    characters wait, since they may begin a stop string that would cut them; each output's text
    was shown " 3 + 4 = 7\n###" and then cut to " 3 + 4 = 7". With include_stop_str_in_output a
    cut never reaches shown text, so nothing waits."""
    for stop in (["\n####"], ["= 7\n", "4 ="], ["#", " 7\n#### 7"]):
        params = SamplingParams(temperature=0, max_tokens=40, stop=stop)
        texts = streamed_texts(gsm, QUESTION, params)
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), (stop, texts)
        assert texts[-1] == gsm.generate(QUESTION, params, use_tqdm=False)[0].outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=40, stop=["\n####"], include_stop_str_in_output=True)
    texts = streamed_texts(gsm, QUESTION, params)
    decode = gsm.get_tokenizer().decode
    tokens = gsm.generate(QUESTION, params, use_tqdm=False)[0].outputs[0].token_ids
    assert texts == [decode(tokens[:k]) for k in range(1, len(tokens) + 1)]


def test_incremental_text_equals_full_decode_at_finish(tiny_ckpt):
    """A random byte model emits partial UTF-8; text kept for stop strings must still end whole."""
    llm = LLM(tiny_ckpt)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 3, 30, seed=5)]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    held = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["\x00never"]),
                        use_tqdm=False)
    assert [o.outputs[0].text for o in held] == [o.outputs[0].text for o in plain]
    assert any(o.outputs[0].text for o in plain)


def test_shared_prefix_len_counts_only_common_blocks():
    """Cascade attention's trigger: whole blocks every decode row shares, before each one's last
    key; padding zeros of short rows never count."""
    from asynct.attention.triton_backend import CASCADE_MIN_DECODES, shared_prefix_len
    from asynct.attention.base import block_table_array
    n, bs = CASCADE_MIN_DECODES, 32
    tables = [[7, 8, 9, 10, 11, 12, 13, 14, 100 + i, 200 + i] for i in range(n)]
    lens = [300 + i for i in range(n)]
    assert shared_prefix_len(block_table_array(tables), lens, n, bs) == 8 * bs
    tables[3][5] = 99                                    # one row leaves the prefix at block 5
    assert shared_prefix_len(block_table_array(tables), lens, n, bs) == 5 * bs
    lens[0] = 5 * bs + 1                                 # its last key in block 5: 5 full blocks
    assert shared_prefix_len(block_table_array(tables), lens, n, bs) == 5 * bs
    lens[0] = 5 * bs                                     # last key in block 4
    assert shared_prefix_len(block_table_array(tables), lens, n, bs) == 4 * bs
    short = [t[:2] for t in tables]                      # zero padding is no shared block
    assert shared_prefix_len(block_table_array(short + tables), [20] * n + lens, 2 * n, bs) == 0
    assert shared_prefix_len(block_table_array(tables), lens, n - 1, bs) == 0   # too few rows


def test_large_decode_steps_take_their_rows_longest_first(monkeypatch):
    """Decode steps of DECODE_ORDER_MIN_ROWS sequences or more hand the decode kernel their rows
    longest first (ties in row order), eagerly and in graphs; smaller ones, and prefills, none."""
    from asynct.attention import StepInputs
    from asynct.attention import triton_backend as tb
    monkeypatch.setattr(tb, "DECODE_ORDER_MIN_ROWS", 4)
    builder = tb.TritonMetadataBuilder(4, torch.device("cpu"))
    lens = [5, 9, 2, 9, 30]
    step = StepInputs([1] * 5 + [3], lens + [3], [[i] for i in range(6)], list(range(8)), 5)
    assert builder.build(step).decode_order.tolist() == [4, 1, 3, 0, 2]
    few = StepInputs([1] * 3, lens[:3], [[i] for i in range(3)], list(range(3)), 3)
    assert builder.build(few).decode_order is None
    backend = tb.TritonBackend()
    backend.init_capture(8, 2, 64, 4, "cpu")
    decodes = StepInputs([1] * 5, lens, [[i] for i in range(5)], list(range(5)), 5)
    assert backend.prepare_for_replay(decodes, 6).decode_order.tolist() == [4, 1, 3, 0, 2, 5]
    assert backend.prepare_for_replay(few, 3).decode_order is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_rows_longest_first_on_gpu_match_torch_backend(tiny_ckpt, monkeypatch):
    """24 sequences of uneven lengths decode with their rows taken longest first (from 4, not
    DECODE_ORDER_MIN_ROWS, so that this small model's steps do), in CUDA graphs and eagerly:
    fp32 greedy tokens equal the torch backend's."""
    from asynct.attention import triton_backend as tb
    monkeypatch.setattr(tb, "DECODE_ORDER_MIN_ROWS", 4)
    prompts = random_prompts(24, 5, 400, seed=12)
    runs = gpu_backend_runs(tiny_ckpt, lambda llm: greedy_tokens(llm, prompts))
    assert runs["triton-graphs"] == runs["torch"] and runs["triton-eager"] == runs["torch"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cascade_decode_on_gpu_matches_torch_backend(tiny_ckpt):
    """40 requests sharing a 300-token prefix decode through the cascade path (CUDA graphs and
    eager), then 40 sharing nothing through the same graph (whose prefix pass must then be
    empty, not read the last step's prefix); fp32 greedy tokens equal the torch backend's,
    which has no cascade."""
    shared = random_prompts(40, 1, 60, seed=5, prefix=[(7 * i) % 256 for i in range(300)])
    apart = random_prompts(40, 20, 60, seed=6)

    def run(llm):
        llm.generate([{"prompt_token_ids": shared[0]}], GPU_GREEDY, use_tqdm=False)   # fills the prefix cache
        return [greedy_tokens(llm, batch) for batch in (shared, apart)]
    runs = gpu_backend_runs(tiny_ckpt, run)
    assert runs["triton-graphs"] == runs["torch"] and runs["triton-eager"] == runs["torch"]


GPU_GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy_tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GPU_GREEDY,
                                                        use_tqdm=False)]


def gpu_backend_runs(tiny_ckpt, run, dtype="float32"):
    """{backend: run(llm)} on the GPU: the torch backend, the triton one in CUDA graphs and eagerly."""
    runs = {}
    for name, kw in (("torch", dict(attention_backend="torch", enforce_eager=True)),
                     ("triton-graphs", dict(attention_backend="triton")),
                     ("triton-eager", dict(attention_backend="triton", enforce_eager=True))):
        llm = LLM(tiny_ckpt, dtype=dtype, device="cuda", gpu_memory_utilization=0.3, **kw)
        runs[name] = run(llm)
        del llm
    return runs


def test_small_decode_steps_adding_into_fp32_sums_match_the_reference(tiny_ckpt, reference, monkeypatch):
    """The triton backend's decode steps of up to DECODE_SUMS_MAX_ROWS sequences add attention
    into fp32 sums that the QKV projection zeroes and o_proj reads (on a GPU; forced here at one
    and two sequences, so the torch paths carry it, the sums handed out NaN-filled): greedy
    tokens equal the reference's."""
    from dataclasses import replace

    from asynct.attention import triton_backend as tb
    from asynct.model.engine_model import Attention
    build, attn_sums, forced = tb.TritonMetadataBuilder.build, Attention.attn_sums, []

    def build_forced(self, step):
        md = build(self, step)
        forced.append(md.num_prefills == 0 and md.num_decodes <= 2)
        return replace(md, decode_accumulates=forced[-1])

    def nan_sums(self, rows):
        sums = attn_sums(self, rows)
        return None if sums is None else sums.fill_(float("nan"))
    monkeypatch.setattr(tb.TritonMetadataBuilder, "build", build_forced)
    monkeypatch.setattr(Attention, "attn_sums", nan_sums)
    # eager: a GPU's decode graphs replay their metadata instead of building it
    llm = LLM(tiny_ckpt, attention_backend="triton", max_num_seqs=2, enforce_eager=True)
    prompts = random_prompts(5, 1, 60, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert sum(forced) >= 8
    assert [o.outputs[0].token_ids for o in outs] == reference_greedy(reference, prompts, 8)


def assert_greedy_close(got, want, name):
    """vLLM's check for engines that round differently (check_logprobs_close): each sequence's
    greedy tokens are equal until one engine's pick is a token the other ranks in its top
    logprobs too (a near-tie); past it the continuations differ and are not compared."""
    for g, w in zip(got, want):
        for i, (tg, tw) in enumerate(zip(g.token_ids, w.token_ids)):
            if tg != tw:
                assert tg in w.logprobs[i] and tw in g.logprobs[i], (name, i, tg, tw)
                break


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_decode_batches_on_gpu_match_torch_backend(tiny_ckpt, dtype):
    """One to four sequences decode, the smallest steps through the fp32 sums (QKV zeroes them,
    the decode adds its splits by atomics, o_proj reads them), in CUDA graphs and eagerly: greedy
    tokens equal the torch backend's in fp32; in bf16, where the torch backend rounds every gate
    and score to bf16 and the Triton kernels round only their outputs, they are equal up to
    near-ties (assert_greedy_close; token agreement alone varied with that rounding: 84 % after
    the decode's gate became exact, H100)."""
    prompts = random_prompts(4, 100, 300, seed=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)

    def run(llm):
        return [o.outputs[0] for n in range(1, 5) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:n]], params, use_tqdm=False)]
    runs = gpu_backend_runs(tiny_ckpt, run, dtype)
    for name in ("triton-graphs", "triton-eager"):
        if dtype == "float32":
            assert [o.token_ids for o in runs[name]] == [o.token_ids for o in runs["torch"]], name
        else:
            assert_greedy_close(runs[name], runs["torch"], name)


POISON = -17     # a seed that marks the sequence whose sampling is made to raise


def poisoned_sample(logits, seqs, *args):
    from asynct.engine.sampler import sample
    if any(s.params.seed == POISON for s in seqs):
        raise RuntimeError("injected sampling failure")
    return sample(logits, seqs, *args)


def test_sampling_failure_fails_its_request_alone(llm_shared, monkeypatch):
    """Defence behind validation: a sequence whose sampling raises fails its own request (error
    output, blocks freed); the rest of the step finishes unharmed, and the LLM serves on."""
    prompts = ["one", "two", "three"]
    want = [o.outputs[0].token_ids for o in llm_shared.generate(prompts, GREEDY, use_tqdm=False)]
    monkeypatch.setattr("asynct.engine.model_runner.sample", poisoned_sample)
    poisoned = SamplingParams(temperature=0, max_tokens=8, seed=POISON, n=2)
    outs = llm_shared.generate([prompts[0], "bad", prompts[1], prompts[2]], [GREEDY, poisoned, GREEDY, GREEDY],
                               use_tqdm=False)
    assert "injected sampling failure" in outs[1].error
    assert [o.finish_reason for o in outs[1].outputs] == ["error", "error"]
    assert [o.outputs[0].token_ids for o in outs[:1] + outs[2:]] == want
    assert_all_blocks_free(llm_shared)
    assert llm_shared.generate(prompts, GREEDY, use_tqdm=False)[2].outputs[0].token_ids == want[2]


def test_prompt_keys_take_their_own_types(llm_shared):
    """vLLM's prompt dicts: ids only under prompt_token_ids, text only under prompt; a mix-up is named."""
    text, ids = llm_shared.generate([{"prompt_token_ids": "hi"}, {"prompt": [1, 2]}], GREEDY, use_tqdm=False)
    assert "prompt_token_ids is a list" in text.error and "'prompt' is a string" in ids.error
    same = llm_shared.generate([{"prompt_token_ids": (1, 2)}, {"prompt_token_ids": [1, 2]}], GREEDY, use_tqdm=False)
    assert same[0].outputs[0].token_ids == same[1].outputs[0].token_ids and same[0].error is None


def test_the_compile_pass_runs_one_layer_of_each_signature():
    """The compile pass launches one layer of each signature (runner_startup._compile_ahead):
    a layer whose norm or whose next norm has another alpha shape compiles other kernels."""
    from asynct.attention import get_backend_cls
    from asynct.config import preset_config
    from asynct.model.engine_model import AsyncTEngineModel
    config = preset_config("tiny", num_hidden_layers=5)
    c = config.hidden_size
    config.dyht_shapes = {"model.layers.2.input_layernorm.alpha": c,       # layer 1's next norm
                          "model.layers.3.post_attention_layernorm.alpha": c}
    model = AsyncTEngineModel(config, get_backend_cls("torch").get_impl_cls())
    assert model.distinct_layers() == [0, 1, 3]
    layers, nexts, first = list(model.layers), model.next_norms, model.input_norms[0]
    with pytest.raises(RuntimeError), model.only_layers([0, 1, 3]):
        assert list(model.layers) == [layers[0], layers[1], layers[3]]
        assert model.next_norms == [nexts[0], nexts[1], nexts[3]]
        assert model.input_norms[0] is first       # the embedding's norm
        raise RuntimeError
    assert list(model.layers) == layers and model.next_norms == nexts
    config.dyht_shapes = {}
    assert AsyncTEngineModel(config, get_backend_cls("torch").get_impl_cls()).distinct_layers() == [0]


@pytest.mark.parametrize("cores, workers", [(1, 1), (12, 12), (200, 32)])
def test_the_compile_pass_takes_the_cores_it_may_run_on(monkeypatch, cores, workers):
    import os
    from asynct.engine import runner_startup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 999)
    assert runner_startup.compile_workers() == workers


def test_host_block_tables_equal_the_lists_as_rows_grow_and_return():
    """Rows taken, widened, doubled and given back (zeroed) gather what block_table_array
    makes of the sequences' own lists."""
    from asynct.attention.base import block_table_array
    from asynct.engine.block_table import HostBlockTables
    from asynct.engine.sequence import Sequence
    rng = random.Random(0)
    tables = HostBlockTables(rows=2, width=3)
    seqs = [Sequence(i, f"r{i}", 0, [1], SamplingParams(), 16) for i in range(7)]
    for step in range(60):
        seq = rng.choice(seqs)
        if seq.block_table and rng.random() < 0.25:
            tables.release(seq)
            seq.block_table = []
        else:
            start = len(seq.block_table)
            seq.block_table += [rng.randrange(1, 10**6) for _ in range(rng.randint(1, 5))]
            tables.extend(seq, start)
        held = [s for s in seqs if s.block_table]
        rng.shuffle(held)
        assert np.array_equal(tables.gather(held), block_table_array([s.block_table for s in held]))
    assert tables.array.shape[0] >= 7 and tables.array.shape[1] > 3
    for s in seqs:
        tables.release(s)
    assert not tables.array.any() and len(tables.free_rows) == tables.array.shape[0]
