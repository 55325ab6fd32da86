"""Defects found reviewing 49cd61f/ade8c99 (the filters' threshold kernel and the Philox draw)."""
import gc
import weakref

import torch

from asynct.engine.sampling_params import SamplingParams
from asynct.engine.sequence import Sequence

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_kept_launches_do_not_hold_the_logits_they_were_first_called_with():
    """cached_launch keeps a KernelLaunch per (kernel, grid, key) for the process's life, and a
    KernelLaunch kept its first JIT call's arguments (`first`): each new row count held that
    step's [rows, vocab] logits (and the filter's buffers) for good, unseen by the memory
    profile (152k vocab, fp32, every batch size up to 256: ~20 GB)."""
    from asynct.ops.sampling_draw import draw_triton
    from asynct.ops.sampling_filters import filter_threshold_triton
    x = torch.randn(3, 700, device=DEV)
    alive = weakref.ref(x)
    one = torch.ones(3, device=DEV)
    tau = filter_threshold_triton(x, one, torch.full((3,), 5, dtype=torch.int32, device=DEV), one * 0.9, one * 0)
    draw_triton(x, one, tau, torch.zeros(2, 3, dtype=torch.int64, device=DEV))
    draw_triton(x, one, tau, torch.zeros(2, 3, dtype=torch.int64, device=DEV))   # the kept runner's path too
    del x
    gc.collect()
    assert alive() is None


def test_a_top_p_below_float32s_range_keeps_the_top_token():
    """top_p=1e-50 is valid (0 < top_p <= 1) and is 0 in fp32: the bisection's target 0 is met
    by every key, so the threshold became _value(HI), a NaN (interpreter: nothing kept and
    the draw takes token 0; a GPU's fmax drops the NaN: no top-p at all). The reference keeps
    the top token."""
    from asynct.ops.sampling_filters import filter_threshold_ref, filter_threshold_triton
    assert SamplingParams(top_p=1e-50).top_p == 1e-50
    x = torch.tensor([[3.0, 1.0, 2.0, 0.5]], device=DEV)
    one = torch.ones(1, device=DEV)
    for dt in (torch.float32, torch.bfloat16):
        args = (x.to(dt), one, torch.tensor([4], dtype=torch.int32, device=DEV),
                torch.tensor([1e-50], device=DEV), torch.zeros(1, device=DEV))
        assert filter_threshold_ref(*args).item() == 3.0
        assert filter_threshold_triton(*args).item() == 3.0


def test_a_huge_temperature_does_not_make_a_row_greedy():
    """1 / temperature under fp32's range (T > ~7e44, valid: only >= 0 and finite are checked)
    is 0 in the inv_temps tensor, which the draw reads as greedy: the row always takes the
    argmax. Before, logits / T were all 0 (uniform draws), as vLLM's."""
    from asynct.engine.sampler import _draw
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0]]).expand(64, -1).contiguous()
    seqs = [Sequence(i, str(i), 0, [0], SamplingParams(temperature=1e300, seed=i), 16) for i in range(64)]
    assert len(set(_draw(logits, seqs).tolist())) > 1


def test_draw_kernel_and_reference_agree_on_a_sampled_row_with_a_nan():
    """The draw's reference (what CPUs sample with) keeps a NaN logit of a sampled row (x < tau is
    False for a NaN) and argmax picks it; the kernel drops it (x >= tau is False)."""
    from asynct.ops.sampling_draw import draw_ref, draw_triton
    x = torch.randn(2, 511, generator=torch.Generator().manual_seed(0), device="cpu").to(DEV)
    x[:, 100] = float("nan")
    inv = torch.ones(2, device=DEV)
    keys = torch.tensor([[1, 2], [0, 1 << 32]], device=DEV)
    for threshold in (None, torch.full((2,), -1.0, device=DEV)):
        assert draw_triton(x, inv, threshold, keys).tolist() == draw_ref(x, inv, threshold, keys).tolist()


def test_a_kept_launch_holds_no_argument_on_the_compiled_path():
    """The same on a GPU's path (a stand-in JIT that returns a compiled kernel): a cached_launch
    still goes straight to the compiled kernel on its second call, and holds no tensor."""
    from asynct.ops import _triton
    log = []

    class Compiled:
        packed_metadata = ()

        def __getitem__(self, grid):
            return lambda *values: log.append("compiled")

    class Jit:
        arg_names = ["x_ptr", "n", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *args, **kw: log.append("jit") or Compiled()

    fn = Jit()
    buf = torch.zeros(64)
    alive = weakref.ref(buf)
    _triton.cached_launch(fn, (4,))(buf, 7, BLOCK=16)
    _triton.cached_launch(fn, (4,))(torch.zeros(64), 7, BLOCK=16)
    del buf
    gc.collect()
    assert alive() is None
    _triton.cached_launch(fn, (4,))(torch.zeros(64)[1:], 7, BLOCK=16)     # unaligned: the JIT again
    _triton.cached_launch(fn, (4,))(torch.zeros(64)[1:], 7, BLOCK=16)
    _triton._cached_launches.pop((fn, (4,), ()))
    assert log == ["jit", "compiled", "jit", "compiled"]


def toks(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_seeded_tokens_do_not_depend_on_batch_n_preemption_or_async(tiny_ckpt):
    """(Passes: coverage of the counter-based noise.) A seeded request's tokens alone, beside
    unseeded ones, as sample 0 of n=3, with and without async scheduling and with a KV cache
    small enough to preempt and recompute."""
    from asynct import LLM
    from tests.test_engine import random_prompts
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    kw = dict(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, top_p=0.9, top_k=40)
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    others = [{"prompt_token_ids": p} for p in random_prompts(6, 3, 40, seed=2)]
    seen = set()
    for settings in (dict(async_scheduling=False), dict(async_scheduling=True),
                     dict(num_kv_blocks=12, block_size=4, async_scheduling=False),
                     dict(num_kv_blocks=12, block_size=4, async_scheduling=True)):
        llm = LLM(tiny_ckpt, **settings)
        alone = toks(llm.generate([prompt], SamplingParams(**kw), use_tqdm=False))[0][0]
        batched = toks(llm.generate([prompt] + others, [SamplingParams(**kw)] + [free] * len(others),
                                    use_tqdm=False))[0][0]
        n3 = toks(llm.generate([prompt], SamplingParams(n=3, **kw), use_tqdm=False))[0]
        assert alone == batched == n3[0] and len({tuple(s) for s in n3}) == 3, settings
        seen.add(tuple(alone))
    assert len(seen) == 1


def test_greedy_rows_beside_sampled_rows_equal_a_greedy_run(tiny_ckpt):
    """(Passes.) Greedy rows in a batch of filtered, sampled rows take the plain argmax."""
    from asynct import LLM
    from tests.test_engine import random_prompts
    llm = LLM(tiny_ckpt)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 3, 30, seed=9)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    hot = SamplingParams(temperature=1.5, top_k=5, top_p=0.8, min_p=0.05, max_tokens=16, ignore_eos=True)
    want = toks(llm.generate(prompts, greedy, use_tqdm=False))
    assert toks(llm.generate(prompts + prompts, [greedy] * 4 + [hot] * 4, use_tqdm=False))[:4] == want
