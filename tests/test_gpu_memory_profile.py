"""The start-up memory profile holds the sampler's peak: max_num_seqs rows of the whole
vocabulary sampled on the costliest path (asynct.engine.sampling_profile), beside the forward;
prompt logprobs, scored in slices of as many rows, fit under it."""
import pytest
import torch

from asynct import LLM, SamplingParams
from asynct.engine import runner_startup
from asynct.engine.runner_startup import RunnerStartup
from asynct.engine.sampling_profile import sample_dummy_rows

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def spy_on(monkeypatch, calls, module, name):
    """Records each call's arguments and result under `name`."""
    real = getattr(module, name)

    def spy(*args):
        calls[name] = args, real(*args)
        return calls[name][1]
    monkeypatch.setattr(module, name, spy)


def test_the_dummy_sampling_takes_every_costly_path_and_leaves_the_runner_as_it_was(tiny_ckpt, monkeypatch):
    """max_num_seqs rows sample from the forward's last rows (the rows before are NaN) through
    the penalties with prompt marks, a top-k / top-p / min-p filter that masks every row, and 20
    logprobs; the runner's penalty counts (a live sequence's rows) and last samples stay as
    they were."""
    import asynct.engine.penalties as penalties
    import asynct.engine.sampler as sampler
    import asynct.engine.step_output as step_output
    llm = LLM(tiny_ckpt, device="cpu", max_num_seqs=12, num_kv_blocks=64)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, repetition_penalty=1.2), use_tqdm=False)
    runner, vocab = llm.llm_engine.runner, llm.llm_engine.vocab_size
    counts, last = runner.penalty_counts, runner.last_sampled
    kept = counts.counts.clone(), counts.in_prompt.clone(), list(counts.counted), len(counts.owner)
    calls = {}
    for module, name in ((penalties, "apply_penalties"), (sampler, "_filter_threshold"),
                         (step_output, "token_logprobs")):
        spy_on(monkeypatch, calls, module, name)
    hidden = torch.randn(20, runner.config.hidden_size)
    hidden[:-12] = float("nan")
    sampled = sample_dummy_rows(runner, hidden, 12)
    assert sampled.shape == (12,) and 0 <= sampled.min() and sampled.max() < vocab
    (logits, _, _, in_prompt, *_), _ = calls["apply_penalties"]
    assert logits.shape == (12, vocab) and in_prompt is not None
    (logits, _, _), threshold = calls["_filter_threshold"]
    assert threshold.shape == (12,) and (logits < threshold[:, None]).any(-1).all()
    (logprobs, _, num_top), _ = calls["token_logprobs"]
    assert logprobs.shape == (12, vocab) and logprobs.isfinite().all() and num_top == 20
    assert runner.penalty_counts is counts and runner.last_sampled is last
    assert torch.equal(counts.counts, kept[0]) and torch.equal(counts.in_prompt, kept[1])
    assert (counts.counted, len(counts.owner)) == kept[2:]


def test_the_dummy_sampling_pads_a_short_forward_and_leaves_the_random_state_alone(tiny_ckpt):
    """A forward of max_model_len tokens can be shorter than a step's rows: zero rows make up the
    rest. LLM(seed=...) seeded the generator before the profile, whose noise must not move it."""
    llm = LLM(tiny_ckpt, device="cpu", max_num_seqs=12, num_kv_blocks=64)
    runner = llm.llm_engine.runner
    hidden = torch.randn(5, runner.config.hidden_size)
    state = torch.get_rng_state()
    sampled = sample_dummy_rows(runner, hidden, 12)
    assert sampled.shape == (12,)
    assert torch.equal(torch.get_rng_state(), state)


def profile_on_cpu(monkeypatch, llm, peaks):
    """profile_activation_memory on the CPU: the CUDA memory calls stubbed, max_memory_allocated
    answering `peaks` in turn (the forward's, then the sampling's); returns (its result, the rows
    it sampled)."""
    for name in ("empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    answers = iter(peaks)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: next(answers))
    rows = []
    real = runner_startup.sample_dummy_rows
    monkeypatch.setattr(runner_startup, "sample_dummy_rows", lambda r, h, n: rows.append(n) or real(r, h, n))
    return llm.llm_engine.runner.profile_activation_memory(), rows


def test_the_profile_samples_a_full_batch_and_counts_the_penalty_rows_beside_the_forward(tiny_ckpt, monkeypatch):
    """A step forwards max_num_batched_tokens tokens over several prompts and samples up to
    min(max_num_seqs, max_num_batched_tokens) rows, more than one max_model_len prompt holds
    (then the 31 whose penalised fp32 logits sort, on a GPU, below the filter kernel's 32 rows:
    their buffers can outweigh a few more rows' through the kernel); and the penalty counts, once
    grown, stay beside every
    later forward: the peak is the larger of forward + counts and the sampling's, plus the
    decode graphs' static logits where graphs are captured."""
    llm = LLM(tiny_ckpt, device="cpu", max_num_seqs=48, max_num_batched_tokens=64, max_model_len=16,
              num_kv_blocks=64)
    runner = llm.llm_engine.runner
    counts = runner.penalty_counts.full_bytes(llm.llm_engine.vocab_size)
    assert counts == 49 * llm.llm_engine.vocab_size * 5
    tokens, forward = [], runner._forward
    monkeypatch.setattr(runner, "_forward", lambda ids, pos, meta: tokens.append(len(ids)) or forward(ids, pos, meta))
    peak, rows = profile_on_cpu(monkeypatch, llm, [10**6, 2 * 10**6])
    assert tokens == [64] and rows == [48, 31] and peak == max(10**6 + counts, 2 * 10**6)
    peak, _ = profile_on_cpu(monkeypatch, llm, [10**6, 10**4])
    assert peak == 10**6 + counts
    runner.cudagraph_mode = "full_decode_only"     # + the sampling graphs' logits (32 fp32 rows), argmax
    peak, _ = profile_on_cpu(monkeypatch, llm, [10**6, 10**4])
    assert peak == 10**6 + counts + 32 * (llm.llm_engine.vocab_size * 4 + 8)


def test_the_profiled_step_packs_the_budget_into_prompts_of_max_model_len(tiny_ckpt):
    """A step of max_num_batched_tokens tokens runs when prompts are shorter than it: the profile
    forwards that many (at most max_num_seqs prompts of max_model_len), not one prompt's worth,
    each prompt on its own blocks; a one-token rest goes first, as the scheduler's decodes do."""
    def step(**kw):
        runner = LLM(tiny_ckpt, device="cpu", num_kv_blocks=64, **kw).llm_engine.runner
        s = runner.profile_step()
        blocks = [b for t in s.block_tables for b in t]
        assert blocks == list(range(len(blocks))) and s.query_lens == s.seq_lens
        assert s.slot_mapping == [t[i // 4] * 4 + i % 4 for t, n in zip(s.block_tables, s.query_lens)
                                  for i in range(n)]
        return s.query_lens, s.num_decodes
    assert step(max_num_seqs=48, max_num_batched_tokens=64, max_model_len=16, block_size=4) == ([16] * 4, 0)
    assert step(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=16, block_size=4) == ([16] * 2, 0)
    assert step(max_num_seqs=8, max_num_batched_tokens=33, max_model_len=16, block_size=4) == ([1, 16, 16], 1)
    assert step(max_num_seqs=8, max_num_batched_tokens=30, max_model_len=64, block_size=4) == ([30], 0)


def profiled_engine(tmp_path, monkeypatch, **kw):
    """A 2-layer model of a 64k vocabulary; the engine and the peak it profiled at start-up."""
    from asynct.model.checkpoint import make_checkpoint
    ckpt = make_checkpoint("small", tmp_path, seed=0, dtype="bfloat16", num_hidden_layers=2, hidden_size=512,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=65536)
    profiled, profile = [], RunnerStartup.profile_activation_memory
    monkeypatch.setattr(RunnerStartup, "profile_activation_memory",
                        lambda self: profiled.append(profile(self)) or profiled[-1])
    llm = LLM(ckpt, gpu_memory_utilization=0.3, enforce_eager=True, **kw)
    return llm, profiled[0]


def peak_of(generate):
    """(the outputs of `generate()`, its peak bytes over the memory allocated before)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = generate()
    return outs, torch.cuda.max_memory_allocated() - base


@gpu
def test_the_profiled_peak_holds_a_step_sampling_max_num_seqs_rows(tmp_path, monkeypatch):
    """A small model's forward needs a few MB; 128 rows of a 64k vocabulary sampled with every
    costly option need hundreds (fp32 copies, penalty counts, the sort, noise, logprobs). The
    peak the engine profiled at start-up holds the peak of generating them."""
    llm, profiled = profiled_engine(tmp_path, monkeypatch, max_num_seqs=128, max_num_batched_tokens=1024,
                                    admission_batch=128)
    costly = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                            frequency_penalty=0.5, presence_penalty=0.25, logprobs=20, max_tokens=4, ignore_eos=True)
    outs, used = peak_of(lambda: llm.generate([{"prompt_token_ids": [1 + i, 2, 3]} for i in range(128)], costly,
                                              use_tqdm=False))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] * 128
    assert used > 100 * 2**20 and profiled >= used, (profiled, used)


@gpu
def test_the_profiled_peak_holds_a_step_scoring_every_prompt_position(tmp_path, monkeypatch):
    """loglikelihood_rolling's steps: 4,000 prompt positions scored with 20 top entries each, in
    slices of max_num_seqs rows (64 here: 8 MB of bf16 logits, more in fp32) beside the step's
    hidden states. The profiled peak, which sampled as many rows, holds them."""
    llm, profiled = profiled_engine(tmp_path, monkeypatch, max_num_seqs=64, max_num_batched_tokens=4096)
    prompt = torch.randint(0, 65536, (4000,), generator=torch.Generator().manual_seed(0)).tolist()
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20)
    outs, used = peak_of(lambda: llm.generate([{"prompt_token_ids": prompt}], scored, use_tqdm=False))
    assert len(outs[0].prompt_logprobs) == 4000
    assert used > 20 * 2**20 and profiled >= used, (profiled, used)
