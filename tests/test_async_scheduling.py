"""Async scheduling (step N+1 launched before step N is finished) changes nothing a user sees:
outputs equal the synchronous engine's token for token, whatever ends a sequence."""
import pytest
import torch

from asynct import LLM, SamplingParams

from test_engine import assert_all_blocks_free, random_prompts


def engines(ckpt, **kw):
    kw.setdefault("num_kv_blocks", 400)   # two engines share one GPU: size the caches by hand
    return {mode: LLM(ckpt, async_scheduling=mode == "async", **kw) for mode in ("sync", "async")}


def mixed_params(own: list[int], eos: int, i: int) -> SamplingParams:
    """Every way a sequence can end or be constrained; `own` is the prompt's greedy output, so
    its stop tokens and strings are ones it really meets."""
    if eos in own[1:]:                                           # EOS ends it, or is held back
        return SamplingParams(temperature=0, max_tokens=12, min_tokens=(i % 2) * (own.index(eos, 1) + 1))
    return [
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[own[3]]),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=5, stop_token_ids=[own[2]]),
        SamplingParams(temperature=0.9, max_tokens=10, n=3, seed=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[chr(own[5])]),
    ][i % 7]


def summary(outs):
    return [(o.prompt_token_ids, [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                   [sorted(e) for e in c.logprobs or []]) for c in o.outputs],
             [sorted(e) if e else e for e in o.prompt_logprobs or []]) for o in outs]


@pytest.mark.parametrize("setting", [dict(), dict(num_kv_blocks=30, max_num_seqs=12),
                                     dict(max_num_batched_tokens=33)])
def test_async_equals_sync(tiny_ckpt, setting):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(27, 1, 120, seed=5, prefix=range(40))]
    llms = engines(tiny_ckpt, **setting)
    greedy = llms["sync"].generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                   use_tqdm=False)
    own = [o.outputs[0].token_ids for o in greedy]
    eos = torch.bincount(torch.tensor([t for o in own for t in o[1:]])).argmax().item()
    params = [mixed_params(o, eos, i) for i, o in enumerate(own)]
    got = {}
    for mode, llm in llms.items():
        llm.llm_engine.eos_token_ids = llm.llm_engine.runner.eos_token_ids = [eos]
        got[mode] = llm.generate(prompts, params, use_tqdm=False)
        assert_all_blocks_free(llm)
    assert summary(got["async"]) == summary(got["sync"])
    for o, p in zip(got["async"], params):
        assert all(len(c.token_ids) <= p.max_tokens for c in o.outputs)
    reasons = [c.finish_reason for o in got["async"] for c in o.outputs]
    assert reasons.count("stop") >= 4 and "length" in reasons
    if "num_kv_blocks" in setting:
        assert llms["async"].llm_engine.scheduler.num_preemptions > 0


def drive(engine, prompts, params, abort_at):
    """Steps the engine by hand, streaming, aborting request 'r1' after `abort_at` steps."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, stream=True)
    streamed, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(list(out.outputs[0].token_ids))
        steps += 1
        if steps == abort_at:
            engine.abort_request("r1")
    return streamed


def test_async_streaming_and_abort(tiny_ckpt):
    prompts = random_prompts(6, 3, 60, seed=11)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    runs = {mode: drive(llm.llm_engine, prompts, params, abort_at=6)
            for mode, llm in engines(tiny_ckpt).items()}
    for rid in runs["sync"]:
        sync, asyn = runs["sync"][rid], runs["async"][rid]
        for chunks in (sync, asyn):       # cumulative outputs only ever grow
            assert all(a == b[:len(a)] for a, b in zip(chunks, chunks[1:]))
        if rid == "r1":                   # aborted: a prefix of the same tokens
            assert sync[-1][:len(asyn[-1])] == asyn[-1] or asyn[-1][:len(sync[-1])] == sync[-1]
        else:
            assert asyn[-1] == sync[-1] and len(asyn[-1]) == 20
    for llm in engines(tiny_ckpt).values():
        assert_all_blocks_free(llm)


def test_async_engine_recovers_between_calls(tiny_ckpt):
    """A step left in flight at the end of one call is finished by the next."""
    llm = LLM(tiny_ckpt)
    p = {"prompt_token_ids": [5, 6, 7]}
    a = llm.generate([p], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    b = llm.generate([p], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert llm.llm_engine.in_flight is None
    assert_all_blocks_free(llm)


def test_a_decode_step_sends_its_inputs_in_two_copies(tiny_ckpt, monkeypatch):
    """Every host-to-device copy is a memcpy on the stream between the step before and this one
    (H200, a batch-1 decode step: 8 copies took 23 of its 858 us). Input ids, positions and the
    rows of tokens still on the device go in one copy, the attention metadata in another; the
    step's tokens are the same (test_async_equals_sync)."""
    import sys

    import asynct.attention.base as base
    eng = LLM(tiny_ckpt, device="cpu").llm_engine
    for i in range(3):
        eng.add_request(str(i), [1 + i, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()
    eng.step()      # decodes now, each with its newest token still pending on the device
    assert all(s.num_pending_tokens for s in eng.scheduler.running)
    calls, real = [], base.host_to_device
    for mod in [m for name, m in sys.modules.items() if name.startswith("asynct")]:
        if getattr(mod, "host_to_device", None) is real:
            monkeypatch.setattr(mod, "host_to_device", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    eng.step()
    assert len(calls) == 2


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_one_copy_keeps_every_part_16_byte_aligned(device):
    """Triton specialises a pointer on 16-byte alignment: parts at 8-byte offsets compiled new
    variants of the decode and KV-write kernels mid-run on the GPU (H200). Values, dtypes and
    shapes are the parts'."""
    import numpy as np

    from asynct.attention.base import host_to_device_many
    parts = [([1, 2, 3], torch.int32), ([], torch.int64), (np.arange(6, dtype=np.int32).reshape(2, 3), torch.int32),
             ([2**40, -1], torch.int64), ([0.5, -1.25, 3.0], torch.float32), ([True, False, True], torch.bool),
             ([7], torch.int32), (np.arange(12, dtype=np.int64).reshape(3, 4)[:, 1:], torch.int64)]
    out = host_to_device_many(parts, torch.device(device))
    for (data, dtype), t in zip(parts, out):
        assert t.dtype == dtype and t.shape == np.asarray(data).shape and t.tolist() == np.asarray(data).tolist()
        assert t.storage_offset() * t.element_size() % 16 == 0


@pytest.mark.parametrize("device", DEVICES)
def test_host_copies_keep_values_past_the_intra_op_threshold(device):
    """The pinned staging copies by numpy (base.pinned): lists of every dtype the engine sends,
    and arrays past torch's 32K-element parallel-copy threshold, arrive whole."""
    import numpy as np

    from asynct.attention.base import copy_from_host, host_to_device
    dev = torch.device(device)
    for data, dtype in [([3, -1, 2**40], torch.long), ([0.5, 2.0], torch.float32), ([True, False], torch.bool),
                        ([7, 8], torch.int32), ([], torch.long)]:
        t = host_to_device(data, dtype, dev)
        assert t.device.type == device and t.dtype == dtype and t.tolist() == data
    big = np.random.default_rng(0).integers(0, 2**31 - 1, size=(300, 257), dtype=np.int32)
    assert torch.equal(host_to_device(big, torch.int32, dev).cpu(), torch.from_numpy(big))
    dst = torch.zeros(big.size + 5, dtype=torch.int32, device=dev)
    copy_from_host(dst[5:], big.reshape(-1))
    assert torch.equal(dst.cpu()[5:], torch.from_numpy(big.reshape(-1))) and not dst[:5].any()


def test_a_reused_request_id_gets_no_output_of_the_step_left_in_flight(tiny_ckpt):
    """A sequence that stops (here at a stop token) leaves one step in flight; a request added
    under the same id before it was finished was handed that step's token: a streamed output
    holding no token yet, as if it had progressed."""
    engine = LLM(tiny_ckpt, num_kv_blocks=50).llm_engine
    first, second = [1, 2, 3, 4], [9, 8, 7, 6, 5]
    own = LLM(tiny_ckpt, num_kv_blocks=50).generate(
        {"prompt_token_ids": first}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("r", first, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  stop_token_ids=[own[1]]), stream=True)
    while not any(o.finished for o in engine.step()):
        pass
    assert engine.in_flight is not None
    engine.add_request("r", second, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), stream=True)
    streamed = []
    while engine.has_unfinished_requests():
        streamed += [list(o.outputs[0].token_ids) for o in engine.step()]
    assert [len(s) for s in streamed] == [1, 2, 3]


def test_a_steady_decode_step_takes_its_samples_as_input_ids(tiny_ckpt, monkeypatch):
    """While every row continues in its row of the step before, the step's input ids are that
    step's samples themselves (no upload, no gather); once a sequence ends the rows shift and
    are gathered. Tokens as the synchronous engine's either way. (Eager steps: decode graphs
    have their own, test_sampling_graphs.py.)"""
    prompts = [{"prompt_token_ids": [1 + i, 2, 3, 4, 5]} for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (8, 3, 8)]
    llms = engines(tiny_ckpt, enforce_eager=True)
    runner = llms["async"].llm_engine.runner
    taken, run_model = [], runner._run_model

    def spy(inputs, metadata, batch):
        last = runner.last_sampled
        taken.append(last is not None and inputs[0].data_ptr() == last.data_ptr())
        return run_model(inputs, metadata, batch)
    monkeypatch.setattr(runner, "_run_model", spy)
    got = {mode: llm.generate(prompts, params, use_tqdm=False) for mode, llm in llms.items()}
    assert summary(got["async"]) == summary(got["sync"])
    assert True in taken and taken.count(False) >= 2    # the prefill, and the step after r1 ended
