"""The prefix cache's keys: a block is served only after exactly the same tokens before it."""
import random

import pytest
import torch

from asynct.engine.block_manager import BlockManager, chain_hash
from asynct.engine.sampling_params import SamplingParams
from asynct.engine.sequence import Sequence

BS = 4


def run_prompt(bm: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    """Schedules a prompt as the engine does (prefix hits, then fresh blocks), computes it and
    publishes its full blocks; returns it still holding them."""
    seq = Sequence(seq_id, str(seq_id), 0, tokens, SamplingParams(max_tokens=1), BS)
    hits = bm.match_prefix(seq)
    bm.allocate(seq, len(tokens) - len(hits) * BS, hits)
    seq.num_computed_tokens = len(tokens)
    bm.commit_full_blocks(seq)
    return seq


def test_blocks_after_different_tokens_are_not_shared():
    # Two first blocks whose Python hashes are equal (ints are hashed mod 2**61 - 1): with the
    # 64-bit tuple hash as the chain key, B's second block matched A's, computed after other
    # tokens. Such pairs can be searched for within a vocabulary too; a SHA-256 chain cannot.
    a_first, b_first = [1, 2, 3, 4], [1, 2, 3, 4 + 2**61 - 1]
    assert hash(tuple(a_first)) == hash(tuple(b_first))
    shared_block, last = [9, 9, 9, 9], [5]
    bm = BlockManager(num_blocks=16, block_size=BS)
    run_prompt(bm, 0, b_first + last)                      # B's first block cached first
    a = run_prompt(bm, 1, a_first + shared_block + last)
    b = Sequence(2, "2", 0, b_first + shared_block + last, SamplingParams(max_tokens=1), BS)
    hits = bm.match_prefix(b)
    assert len(hits) == 1 and a.block_table[1] not in [h.block_id for h in hits]


def test_identical_prefixes_share_blocks_and_keys_chain():
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(range(3 * BS)) + [7]
    first = run_prompt(bm, 0, tokens)
    again = Sequence(1, "1", 0, tokens, SamplingParams(max_tokens=1), BS)
    assert [h.block_id for h in bm.match_prefix(again)] == first.block_table[:3]
    k0 = chain_hash(b"", tokens[:BS])
    assert first.block_hashes[:2] == [k0, chain_hash(k0, tokens[BS:2 * BS])]
    assert chain_hash(b"", [0] * BS) != chain_hash(chain_hash(b"", [0] * BS), [0] * BS)


def test_blocks_are_made_as_first_taken_and_taken_in_the_old_order():
    """A tiny model's cache on a big GPU is millions of blocks: none is made before it is first
    taken (15M took 12 s and 4 GB at start-up). Blocks go out as before: never-taken ones in id
    order, then the freed ones, oldest first, a freed prefix re-taken by its hit in between."""
    huge = BlockManager(num_blocks=5_000_000, block_size=BS)
    assert not huge.blocks and huge.num_free_blocks == huge.num_blocks == 5_000_000
    run_prompt(huge, 0, [1] * (BS + 1))
    assert len(huge.blocks) == 2 and huge.num_free_blocks == 5_000_000 - 2
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = run_prompt(bm, 0, list(range(2 * BS)) + [1])           # blocks 0-2
    b = run_prompt(bm, 1, [7] * (BS + 1))                      # 3-4
    assert (a.block_table, b.block_table, bm.num_free_blocks) == ([0, 1, 2], [3, 4], 1)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 6 and all(blk.ref_count == 0 for blk in bm.blocks)
    again = run_prompt(bm, 2, list(range(2 * BS)) + [9])       # a's two full blocks, cached, then 5
    assert again.block_table == [0, 1, 5]
    assert run_prompt(bm, 3, [8] * (2 * BS + 1)).block_table == [2, 4, 3]   # freed: a's last, then b's


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_block_a_finishing_step_fills_is_published(tiny_ckpt, async_scheduling):
    """A block of generated tokens that the sequence's last step completes is cached for a later
    prompt that repeats it, with the synchronous loop too (a skipped commit once lost it)."""
    from asynct import LLM
    llm = LLM(tiny_ckpt, num_kv_blocks=200, block_size=4, async_scheduling=async_scheduling, device="cpu")
    bm = llm.llm_engine.block_manager
    prompt = list(range(10, 18))                     # two full blocks
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    before = bm.num_hits
    follow = prompt + out[:4] + [99]                  # out[:4] fill the third block
    llm.generate([{"prompt_token_ids": follow}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert bm.num_hits - before == 3


def test_a_recomputed_sequence_reports_the_hits_of_its_first_scheduling(tiny_ckpt):
    """num_cached_tokens is what the prefix cache served a request when it first ran, as vLLM's:
    a sequence preempted and recomputed re-took its own prompt's blocks, and a prompt that shared
    nothing with any other reported them as cached (16 of 23 tokens), more the more pressure."""
    import random

    from asynct import LLM
    llm = LLM(tiny_ckpt, num_kv_blocks=12, block_size=8, device="cpu")
    r = random.Random(11)
    prompts = [{"prompt_token_ids": [r.randrange(256) for _ in range(r.randint(20, 30))]} for _ in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.num_cached_tokens for o in outs] == [0] * 6
    assert llm.llm_engine.block_manager.prefix_cache_hit_rate == 0     # /metrics' too


PROMPT = [(5 * i + 3) % 256 for i in range(37)]     # 9 full blocks of 4 and one token


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_request_s_samples_share_its_prompt_in_their_first_step(tiny_ckpt, backend):
    """A request's n samples (and prompts that repeat one) are admitted in one step: the first
    computes the prompt, the others take its full blocks as hits in that same step (a step
    writes its K/V before any attention reads them) and compute only the rest, as in vLLM.
    They computed every prompt whole (316 positions, not 52). Outputs equal an engine's
    without the prefix cache."""
    from asynct import LLM
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT + [1, 2, 3, 4, 5]}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=4, logprobs=2)
    runs = {}
    for caching in (True, False):
        llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=200, max_num_batched_tokens=64, device="cpu",
                  attention_backend=backend, enable_prefix_caching=caching)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[caching] = [[(c.token_ids, [lp.logprob for d in c.logprobs for lp in sorted(d.values(), key=lambda x: x.rank)]) for c in o.outputs] for o in outs]
        if caching:
            # A: 37, its 3 siblings 1 each; B: 42 less A's 9 blocks, its siblings past its 10: 2 each
            assert llm.llm_engine.stats["prompt_tokens"] == 37 + 3 + 6 + 3 * 2
            assert [o.num_cached_tokens for o in outs] == [0, 36]     # sample 0's
    for got, want in zip(runs[True], runs[False]):
        for (ids, lps), (want_ids, want_lps) in zip(got, want):
            assert ids == want_ids
            assert lps == pytest.approx(want_lps, abs=1e-5)


FAILING = -17   # the seed that marks a request whose every launch raises (fail_launches)


def fail_launches(monkeypatch, llm):
    """Every launch of a batch holding a FAILING-seeded sequence raises, as a bad value that
    escaped validation would: the engine then runs the batch's sequences one by one."""
    runner = llm.llm_engine.runner
    launch = runner.launch

    def failing(batch):
        if any(s.params.seed == FAILING for s in batch.seqs):
            raise RuntimeError("injected launch failure")
        return launch(batch)
    monkeypatch.setattr(runner, "launch", failing)


def test_a_step_that_fails_to_launch_takes_back_the_blocks_it_was_to_fill(tiny_ckpt, monkeypatch):
    """A request that makes its step's launch raise shares that step with one repeating its
    prompt, which took the blocks the failing one published while scheduled. Those hold no
    K/V: the sharer waits for the next step and computes its own, and the hashes are taken
    back, so a later prompt never reads them either. Both equal the prompt run alone."""
    from asynct import LLM
    llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=200, device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPT}
    want = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=200, device="cpu")
    fail_launches(monkeypatch, llm)
    bad = SamplingParams(temperature=0, max_tokens=6, seed=FAILING)
    outs = llm.generate([prompt, prompt], [bad, greedy], use_tqdm=False)
    assert "injected launch failure" in outs[0].error
    assert outs[1].error is None and outs[1].outputs[0].token_ids == want
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_samples_sharing_their_prompt_in_one_step_on_gpu(tiny_ckpt, enforce_eager):
    """The Triton kernels on a GPU: 6 requests of 8 greedy samples, over prompts of 250-700
    tokens (two repeated), each prompt computed about once; fp32 tokens equal an engine's
    without the prefix cache, whose every sample computes its prompt."""
    from asynct import LLM
    rng = random.Random(4)
    base = [[rng.randrange(256) for _ in range(rng.randint(250, 700))] for _ in range(4)]
    prompts = [{"prompt_token_ids": p} for p in base + base[:2]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=8)
    runs, computed = {}, {}
    for caching in (True, False):
        llm = LLM(tiny_ckpt, dtype="float32", device="cuda", gpu_memory_utilization=0.3,
                  enforce_eager=enforce_eager, enable_prefix_caching=caching)
        runs[caching] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        computed[caching] = llm.llm_engine.stats["prompt_tokens"]
        del llm
    assert runs[True] == runs[False]
    assert computed[False] == 8 * sum(len(p) for p in base + base[:2])
    assert computed[True] < sum(map(len, base)) + 48 * 16


def test_a_step_that_failed_to_launch_leaves_no_garbage_for_padded_keys(tiny_ckpt, monkeypatch):
    """The torch backend pads a bucket's shorter rows with cache slot 0 (block 0's first), and
    weighed them by zero: zero times NaN is NaN. The KV cache is torch.empty, and a first step
    that fails to launch leaves block 0 unwritten, then unused while blocks never taken come
    first: every later padded step read its garbage, and rows came out as token 0 (a NaN-filled
    cache makes the garbage sure). The other requests equal an engine's that never failed."""
    from asynct import LLM
    prompts = [{"prompt_token_ids": PROMPT[:5]}, {"prompt_token_ids": PROMPT[:13]}]   # padded bucket
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    kw = dict(block_size=4, num_kv_blocks=200, device="cpu", attention_backend="torch")
    want = LLM(tiny_ckpt, **kw).generate(prompts, greedy, use_tqdm=False)
    llm = LLM(tiny_ckpt, **kw)
    llm.llm_engine.runner.kv_cache.fill_(float("nan"))
    fail_launches(monkeypatch, llm)
    bad = SamplingParams(temperature=0, max_tokens=2, seed=FAILING)
    assert "injected" in llm.generate([{"prompt_token_ids": PROMPT}], bad, use_tqdm=False)[0].error
    got = llm.generate(prompts, greedy, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lps = [d[t].logprob for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        assert lps == pytest.approx([d[t].logprob for d, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)],
                                    abs=1e-5)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
