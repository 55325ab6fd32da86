"""Piecewise CUDA graphs for steps with prefill tokens: the same outputs as the eager forward.

On the CPU the pieces run eagerly through the runner's static buffers (the plumbing: padding to
a bucket, attention between pieces, the residual stream across pieces); on a GPU they are
replayed graphs, and no step of a bench workload runs eagerly."""
import pytest
import torch

from asynct import LLM, SamplingParams
from asynct.engine.engine_args import EngineArgs
from asynct.engine.piecewise_graph import PiecewiseGraphRunner, token_ladder

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_token_ladder():
    assert token_ladder(8192)[:7] == [16, 32, 64, 128, 256, 512, 1024]
    assert token_ladder(8192)[-2:] == [7680, 8192]
    assert token_ladder(700) == [16, 32, 64, 128, 256, 512, 700]
    assert token_ladder(10) == [10]


def test_cudagraph_mode_is_checked():
    with pytest.raises(ValueError, match="cudagraph_mode"):
        EngineArgs(model="m", cudagraph_mode="piecewise-ish")
    assert EngineArgs(model="m", cudagraph_mode="NONE").cudagraph_mode == "none"
    assert EngineArgs(model="m", enforce_eager=True).cudagraph_mode == "none"


def _requests(vocab):
    """Chunked prompts (a budget of 64 tokens a step), a shared prefix (cache hits left of a
    chunk), a 1-token prompt, decodes mixed in: every step kind with prefill tokens."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    prefix = rand(40)
    prompts = [rand(n) for n in (70, 5, 130, 1, 17)] + [prefix + rand(n) for n in (3, 9, 30)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    return [{"prompt_token_ids": p} for p in prompts], params


def _run(llm, prompts, params):
    eng = llm.llm_engine
    eng.step_log = []
    outs = llm.generate(prompts, params, use_tqdm=False)
    kinds = {r.kind for r in eng.step_log}
    eng.step_log = None
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    plps = [[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs]
    return tokens, lps, plps, kinds


def _assert_same(a, b, tol):
    assert a[0] == b[0]
    for x, y in ((a[1], b[1]), (a[2], b[2])):
        flat_x, flat_y = sum(x, []), sum(y, [])
        assert len(flat_x) == len(flat_y)
        assert max(abs(p - q) for p, q in zip(flat_x, flat_y)) < tol


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_pieces_equal_plain_forward_cpu(tiny_ckpt, async_scheduling):
    """With async scheduling, a step's inputs include tokens still on the device: they must
    reach the pieces' static input buffer too."""
    runs = []
    for piecewise in (False, True):
        llm = LLM(tiny_ckpt, device="cpu", max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=256,
                  async_scheduling=async_scheduling)
        if piecewise:
            runner = llm.llm_engine.runner
            runner.piecewise = PiecewiseGraphRunner(runner, 64)
        runs.append(_run(llm, *_requests(llm.llm_engine.config.vocab_size)))
    want, got = runs
    assert {"piecewise mixed", "piecewise prefill"} <= got[3]
    assert not {"mixed", "prefill"} & got[3]
    _assert_same(got, want, 1e-4)


def test_pieces_write_their_static_buffers_in_place(tiny_ckpt, monkeypatch):
    """Each piece's ops write q and the residual stream straight into the static buffers the
    next attention and piece read, and k and v into the cache: the only copy a step is the
    embedding's residual (the final hidden state aside). They were four copies a layer (7 % of
    a prefill workload's GPU time, H200)."""
    from asynct.engine import piecewise_graph
    placed, real = [], piecewise_graph._place

    def place(buf, x):
        placed.append(x.data_ptr() == buf.data_ptr() and x.stride() == buf.stride())
        real(buf, x)
    monkeypatch.setattr(piecewise_graph, "_place", place)
    llm = LLM(tiny_ckpt, device="cpu", max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=256)
    runner = llm.llm_engine.runner
    runner.piecewise = PiecewiseGraphRunner(runner, 64)
    placed.clear()
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=1), use_tqdm=False)
    layers = len(runner.model.layers)
    assert len(placed) == 2 * layers                   # one prefill step: q and the residual a piece
    assert placed[1] is False and placed[0] and all(placed[2:])


@gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", None)])
def test_piecewise_graphs_equal_decode_only_graphs(tiny_ckpt, dtype, tol):
    outs = {}
    for mode in ("full_and_piecewise", "full_decode_only"):
        llm = LLM(tiny_ckpt, dtype=dtype, cudagraph_mode=mode, max_num_batched_tokens=64, max_num_seqs=8,
                  gpu_memory_utilization=0.3)
        prompts, params = _requests(llm.llm_engine.config.vocab_size)
        outs[mode] = _run(llm, prompts, params)
        del llm
    assert {"piecewise mixed", "piecewise prefill"} <= outs["full_and_piecewise"][3]
    assert not {"mixed", "prefill", "decode"} & outs["full_and_piecewise"][3]
    if tol:   # bf16: padded GEMMs may pick other kernels, so only fp32 is compared
        _assert_same(outs["full_and_piecewise"], outs["full_decode_only"], tol)
