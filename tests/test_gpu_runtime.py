"""On a GPU: nothing compiles after start-up, whatever the steps look like, and the start-up's
compile pass leaves the kernels' launchers built; async scheduling gives the synchronous loop's
tokens in bf16 with CUDA graphs."""
import sys
from types import SimpleNamespace

import pytest
import torch

from asynct import LLM, SamplingParams
from asynct.entrypoints.bench import run_engine, workload
from asynct.ops._triton import jit, tl

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gqa_ckpt(tmp_path_factory):
    """Small, but with the bench model's head layout (8 q / 4 KV heads of 128, pool 3)."""
    from asynct.model.checkpoint import make_checkpoint
    return make_checkpoint("small", tmp_path_factory.mktemp("gqa"), seed=3, dtype="bfloat16",
                           hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                           vocab_size=2000)


def test_a_launcher_that_cannot_be_built_early_is_left_for_the_first_launch():
    """No CUDA driver here (or a Triton without launchers): the kernel comes back as it was."""
    from asynct.ops.compile_pass import with_launcher
    kernel = SimpleNamespace(src=None, metadata=None)
    assert with_launcher(kernel) is kernel


def forget_compiled_kernels():
    """Empties every asynct kernel's in-process cache (the disk cache stays, so they reload fast)
    and the eager ops' kept launches, which hold compiled kernels: variants other tests of this
    process compiled would hide one the engine's warm-up forgot."""
    import sys
    from triton.runtime.jit import JITFunction
    from asynct.ops import _triton
    _triton._cached_launches.clear()
    for name, module in list(sys.modules.items()):
        if name.startswith("asynct."):
            for obj in vars(module).values():
                if isinstance(obj, JITFunction):
                    obj.device_caches.clear()


@jit
def _plus_one(x_ptr, n, BLOCK: tl.constexpr):   # this test's own: nothing else compiled it
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


KERNEL_MODULE = """
import triton
import triton.language as tl


@triton.jit
def plus_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)
"""

DISK_CACHE_CHECK = """
import pathlib
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile, get_cache_key, make_backend
from triton._C.libtriton import get_cache_invalidating_env_vars
from asynct.ops.compile_pass import _cache_empty, _compile_to_disk, _on_disk, compile_processes
import kernel_module
def written():
    return {f: f.stat().st_mtime_ns for f in pathlib.Path(sys.argv[1]).rglob("*") if f.is_file()}
spec = ({"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 16}, {(0,): [["tt.divisibility", 16]]})
target, options = GPUTarget("cuda", 90, 32), {"num_warps": 1}
src, backend = ASTSource(kernel_module.plus_one, *spec), make_backend(target)
key = get_cache_key(src, backend, backend.parse_options(options), get_cache_invalidating_env_vars())
cold = _cache_empty(), _on_disk(key, "plus_one")   # the first: the second makes its folder
with compile_processes(2) as procs:
    procs.submit(_compile_to_disk, "kernel_module", "plus_one", *spec, target, options).result()
before = written()
name = compile(ASTSource(kernel_module.plus_one, *spec), target=target, options=options).name
print(name, any(f.suffix == ".cubin" for f in before), written() == before, *cold, _cache_empty(), _on_disk(key, "plus_one"))
"""


def test_a_compile_process_leaves_the_kernel_in_the_disk_cache(tmp_path):
    """compile_only's worker processes compile into Triton's disk cache (here for sm_90: no GPU
    needed), where the pass's own compile of the kernel then loads it: nothing is written again;
    `_on_disk` (no workers on a warm cache) finds it there.
    In a fresh interpreter: the interpreted tests of this session patch Triton's language."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    (tmp_path / "kernel_module.py").write_text(KERNEL_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    out = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", DISK_CACHE_CHECK,
                          str(tmp_path / "cache")], env=env, capture_output=True, text=True, timeout=300)
    # the kernel compiled, the process left a cubin, the parent's compile wrote nothing, and
    # the lookups that decide whether workers fork (the cache empty, this kernel on disk) saw
    # an empty cache and missed it before, and see neither after
    assert out.stdout.split() == ["plus_one", "True", "True", "True", "False", "False", "True"], out.stderr[-2000:]


def _processes_in_a_daemon(conn):
    import os
    from asynct.ops.compile_pass import compile_processes
    with compile_processes(2) as procs:
        conn.send(sorted({procs.submit(os.getpid).result(timeout=60) for _ in range(8)} - {os.getpid()}))
        os._exit(0)     # as the engine process leaves when its front end goes: no pool shutdown


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie nobody reaped: a container's first process may not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="the workers' end with their parent is Linux's prctl")
def test_a_daemonic_process_compiles_in_processes_that_end_with_it():
    """The server's engine process is daemonic, and Python refuses such a process children:
    its compile pass forks them all the same, and they end with it even where it leaves by
    os._exit (its front end gone) without shutting its pool down."""
    import multiprocessing
    import time
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_processes_in_a_daemon, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(120)
    workers = parent.recv()
    proc.join(30)
    assert workers, "no compile worker ran"
    deadline = time.monotonic() + 10
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, workers)), f"compile workers {workers} outlived their process"


@gpu
def test_compile_only_builds_the_launchers(tmp_path, monkeypatch):
    """On an empty Triton cache, compile_only leaves the kernel's launcher built (a
    `__triton_launcher` module in the cache) before its first launch, which then runs."""
    from asynct.ops.compile_pass import compile_only
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    x = torch.zeros(8, device="cuda")
    with compile_only(2):
        _plus_one[(1,)](x, 8, BLOCK=16)
    assert x.eq(0).all() and list(tmp_path.rglob("__triton_launcher*")), "no launcher after compile_only"
    _plus_one[(1,)](x, 8, BLOCK=16)
    assert x.eq(1).all()


@gpu
def test_compile_only_hashes_a_specialisation_once(tmp_path, monkeypatch):
    """Inside compile_only a repeated launch finds its pending compile in the kernel cache
    (the warm-up launches each kernel from every layer and step): Triton's compile path, which
    hashes the kernel's source, runs once a specialisation, and the kernel runs after the pass."""
    from triton import knobs
    from asynct.ops.compile_pass import compile_only
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    _plus_one.device_caches.clear()
    keys = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **kw: keys.append(str(kw["key"])))
    x = torch.zeros(8, device="cuda")
    with compile_only(2):
        for _ in range(3):
            _plus_one[(1,)](x, 8, BLOCK=16)
        _plus_one[(1,)](x, 8, BLOCK=32)
    assert len(keys) == len(set(keys)) == 2 and x.eq(0).all()
    _plus_one[(1,)](x, 8, BLOCK=16)
    assert x.eq(1).all()


@gpu
def test_compile_only_forks_workers_for_an_empty_cache_only(tmp_path, monkeypatch):
    """The workers fork at the pass's first compile that Triton's disk cache lacks; a second
    start on the same cache (nothing compiled in its memory yet) forks none."""
    from asynct.ops import compile_pass
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    forks, real = [], compile_pass.compile_processes
    monkeypatch.setattr(compile_pass, "compile_processes", lambda workers: forks.append(workers) or real(workers))
    x = torch.zeros(8, device="cuda")
    for _ in range(2):
        _plus_one.device_caches.clear()
        with compile_pass.compile_only(2):
            _plus_one[(1,)](x, 8, BLOCK=64)
    assert forks == [2]
    _plus_one[(1,)](x, 8, BLOCK=64)
    assert x.eq(1).all()


@gpu
@pytest.mark.parametrize("eager", [False, True])
def test_nothing_compiles_after_start_up(gqa_ckpt, eager, monkeypatch):
    """Eager too: graph capture compiles what it meets before the counter starts, so only an
    engine without graphs shows a variant the warm-up forgot (17-32-token steps: 32-row tiles).
    Decodes take their rows longest first from 16 sequences here (DECODE_ORDER_MIN_ROWS), so
    that this engine's steps reach those variants too."""
    from asynct.attention import triton_backend
    from asynct.ops.compile_pass import CompileCounter
    monkeypatch.setattr(triton_backend, "DECODE_ORDER_MIN_ROWS", 16)
    forget_compiled_kernels()
    llm = LLM(gqa_ckpt, max_num_seqs=64, max_num_batched_tokens=2048, gpu_memory_utilization=0.3,
              enforce_eager=eager)
    vocab = llm.llm_engine.config.vocab_size
    with CompileCounter() as counter:
        for name in ("throughput", "gsm8k", "latency"):
            run_engine(llm, workload(name, vocab, scale=0.1))
        sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=1, max_tokens=5,
                                 logprobs=3, prompt_logprobs=2, min_tokens=2, stop_token_ids=[7],
                                 repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.25)
        llm.generate([{"prompt_token_ids": list(range(1, n))} for n in (2, 17, 26, 300, 1500)], sampled,
                     use_tqdm=False)
        # no adjustment, rows enough for the sampling filters' kernel: on the model dtype's logits
        llm.generate([[1, 2, 3]] * 40, SamplingParams(temperature=0.7, top_p=0.8, max_tokens=3), use_tqdm=False)
    del llm     # before the assert: a failure's traceback would keep the engine's memory
    assert counter.compiles == [], counter.compiles


@gpu
def test_async_equals_sync_bf16_graphs(gqa_ckpt):
    prompts = [{"prompt_token_ids": list(range(1 + i, 40 + 13 * i))} for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = {}
    for mode in (True, False):
        llm = LLM(gqa_ckpt, async_scheduling=mode, max_num_seqs=32, gpu_memory_utilization=0.3)
        outs[mode] = [(o.outputs[0].token_ids, [sorted(e) for e in o.outputs[0].logprobs])
                      for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outs[True] == outs[False]


@gpu
def test_lazy_decode_graphs_wait_for_a_decode_and_change_no_token(gqa_ckpt):
    """Scoring prompts (lm-eval's loglikelihood) captures no decode graph; the first decode-only
    step captures them with live sequences in the cache, compiling nothing, and the tokens equal
    those of an engine that captured at start-up."""
    from asynct.ops.compile_pass import CompileCounter
    prompts = [{"prompt_token_ids": list(range(1 + i, 40 + 13 * i))} for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = {}
    for lazy in (True, False):
        forget_compiled_kernels()
        llm = LLM(gqa_ckpt, max_num_seqs=16, gpu_memory_utilization=0.3, lazy_decode_graphs=lazy)
        runner = llm.llm_engine.runner
        with CompileCounter() as counter:
            llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
            assert (runner.graphs is None) == lazy
            outs[lazy] = [(o.outputs[0].token_ids, [sorted(e) for e in o.outputs[0].logprobs])
                          for o in llm.generate(prompts, params, use_tqdm=False)]
        assert runner.graphs is not None and counter.compiles == []
        assert runner.capture_seconds["decode_graphs"] > 0
        assert llm.llm_engine.startup_seconds["compile"] > 0     # the compile-ahead: its own part of start-up
        del llm, runner
    assert outs[True] == outs[False]


def spy_logit_rows(monkeypatch) -> list:
    """Records the row count of every eager LM-head call (a replayed graph makes none)."""
    from asynct.model.engine_model import AsyncTEngineModel
    rows, real = [], AsyncTEngineModel.compute_logits

    def spy(self, hidden, out=None):
        rows.append(hidden.shape[0])
        return real(self, hidden, out)
    monkeypatch.setattr(AsyncTEngineModel, "compute_logits", spy)
    return rows


def test_the_lm_head_warm_up_takes_every_row_count_a_step_can_give_it(tiny_ckpt, monkeypatch):
    """Every count from a step's most rows (max_num_seqs, or the token budget where smaller) down
    to one: largest first, so that each count's logits fit the first one's freed block."""
    runner = LLM(tiny_ckpt, device="cpu", max_num_seqs=7, num_kv_blocks=64).llm_engine.runner
    rows = spy_logit_rows(monkeypatch)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runner.warmup_logits()
    assert rows == list(range(7, 0, -1))
    rows.clear()
    runner.max_num_batched_tokens = 5
    runner.warmup_logits()
    assert rows == list(range(5, 0, -1))


@gpu
def test_every_eager_lm_head_row_count_of_a_run_was_launched_at_start_up(gqa_ckpt, monkeypatch):
    """cuBLAS picks the LM head's kernel by its row count and CUDA loads a kernel at its first
    launch, waiting for the device: the first mixed steps of a run launched in their GPU time.
    The start-up launches every count a step's eager sampling or prompt logprobs hand it."""
    rows = spy_logit_rows(monkeypatch)
    llm = LLM(gqa_ckpt, max_num_seqs=48, max_num_batched_tokens=512, gpu_memory_utilization=0.3)
    warm, used = set(rows), rows.clear() or rows
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 2000, (int(n),), generator=gen).tolist()}
               for n in torch.randint(20, 300, (60,), generator=gen)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[:3], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    assert used and set(used) <= warm, sorted(set(used) - warm)
