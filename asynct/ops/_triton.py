"""Triton, where it is installed. CPU-only installs get stand-ins so that the kernel definitions
still evaluate, and every op falls back to its torch reference."""
import contextlib
import functools
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

    class tl:  # noqa: N801  (lets `x: tl.constexpr` annotations evaluate)
        constexpr = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:     # a Triton before 3.4: the kernels launch plainly
    gdc_launch_dependents = gdc_wait = None

# Programmatic dependent launch: off only for the same-run peer of benchmarks/small_batch.py
PDL = True


def jit(fn=None, **options):
    """`triton.jit`, also as `jit(do_not_specialize=[...])`. Arguments that change from step to
    step (token counts, batch sizes, a block table's width, offsets into a batch) must be listed
    there: Triton specialises integers on `== 1` and `% 16` and pointers on 16-byte alignment,
    and every new combination is a compile in the middle of serving."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if triton is not None else fn


def pow2(n: int) -> bool:
    """Whether n is a power of two: the head sizes the Triton kernels' tl.arange takes."""
    return n & (n - 1) == 0


@functools.lru_cache(maxsize=None)
def _pdl_device(device_index) -> bool:
    import torch
    return (gdc_wait is not None and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device_index) >= (9, 0))


def pdl(t) -> bool:
    """Whether kernels on `t`'s device launch with programmatic dependent launch (Hopper on): a
    kernel's programs start while the kernel before finishes (a decode-sized layer is a chain of
    kernels of a few microseconds, each otherwise paying launch and ramp-up after the last one
    drains). Every such kernel calls `wait_for_prior` before it reads what an earlier kernel
    wrote and before it writes anything."""
    return PDL and t.is_cuda and _pdl_device(t.device.index or 0)


def pdl_args(t, wanted=True) -> dict:
    """The launch options and the kernel's PDL flag for a launch on `t`'s device."""
    on = wanted and pdl(t)
    return dict(PDL=on, launch_pdl=on)


@jit
def wait_for_prior(PDL: tl.constexpr):
    """Waits until the kernel before has finished and its writes are visible, then lets the
    next kernel's programs start. Signalled only here, after the wait, so that at most one
    kernel runs ahead: signalled at a kernel's start, every later kernel of the step would
    launch at once and park its programs on the SMs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@jit
def prefetch_l2(ptrs):
    """Asks L2 for the cache lines holding `ptrs`: a hint that keeps no data in registers and
    waits for nothing. A program launched early (PDL) prefetches its weights this way while the kernel
    before still runs, then reads them from L2 after its wait."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


def with_launcher(kernel):
    """Builds a compiled kernel's launcher, the small C module Triton otherwise builds with the
    host compiler at the kernel's first launch, and caches on disk by its source: on an empty
    cache those builds ran one after another in the engine's first forwards (a fresh start's
    profile and warm-up: 1.5-2.3 s each, against 0.0-0.1 s with a warm cache; H200). The kernel
    itself still loads at its first launch, on the device of that launch. Only a head start:
    a build that fails here fails again there, where Triton reports it."""
    try:
        from triton.runtime.driver import driver
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:   # noqa: BLE001
        pass
    return kernel


def _compile_to_disk(module, name, signature, constexprs, attrs, target, options):
    """One compile in a worker process: it lands in Triton's on-disk cache, where the compile
    pass's own compile of the same kernel then finds it. (Its launcher built here too, the
    pass ran 1.08x slower: the workers are its longest path; benchmarks/RESULTS.md.)"""
    import importlib
    from triton.compiler import ASTSource, compile
    kernel = getattr(importlib.import_module(module), name)
    compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)


# seconds a compile thread waits for its process (a compile takes 0.3-2 s) before compiling
# itself: a child that hangs delays the start, never stops it
PROCESS_COMPILE_TIMEOUT = 60


def _die_with(parent: int):
    """A compile worker's first act: it ends with the process that forked it, also one killed or
    leaving by os._exit (the server's engine process, when its front end goes), which never shuts
    its pool down."""
    import ctypes
    import signal
    with contextlib.suppress(Exception):   # Linux only; elsewhere the pool's own shutdown ends it
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


@contextlib.contextmanager
def _as_parent(process):
    """Python refuses a daemonic process children (the server's engine process is one) only
    because it would not wait for them at its exit; compile workers die with it (_die_with)."""
    daemon = process._config.pop("daemon", False)
    try:
        yield
    finally:
        if daemon:
            process._config["daemon"] = daemon


@contextlib.contextmanager
def compile_processes(workers: int):
    """Worker processes forked from this one (its modules already imported), or None where fork
    is not available. They fork here, before any compile thread exists (Python warns of forking a
    process with threads: CUDA's own are there; a child only compiles, and one that hangs times
    out), and end with this process, daemonic or not."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        yield None
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=_die_with, initargs=(os.getpid(),))
    try:
        with _as_parent(multiprocessing.current_process()), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pool.submit(int)     # a fork pool starts all its workers at its first submit
    except Exception:   # noqa: BLE001  (no processes after all: the threads compile)
        pool.shutdown(wait=False)
        pool = None
    try:
        yield pool
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def compile_only(workers: int):
    """Inside, a kernel launch only compiles (nothing runs): each compile goes to a worker
    process, then to a thread that loads it from the disk cache and builds its launcher
    (`with_launcher`); all are done on exit. Running a warm-up pass in here overlaps the
    compiles. In threads alone, the compiler's Python shared the GIL with every other compile
    and with the warm-up's launches: 16 threads ran ~10 compiles at once, each ~3x slower than
    alone (H200 host, benchmarks/RESULTS.md). A process that fails leaves its compile to the thread."""
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction
    run, do_compile = JITFunction.run, JITFunction._do_compile

    def compile_instead(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    def submit_once(self, key, signature, device, constexprs, options, attrs, warmup):
        nonlocal procs
        if procs is not None:
            try:
                mode.job = procs.submit(_compile_to_disk, self.fn.__module__, self.fn.__name__, signature,
                                        constexprs, attrs, self.device_caches[device][2], options.__dict__)
            except Exception:   # noqa: BLE001  (no processes after all: the threads compile)
                procs = None
        # the pending compile stands in the kernel cache (the pass's end replaces it with the
        # kernel; a launch finding it there waits for it): Triton adds a kernel there only then,
        # so every later launch of the same specialisation hashed the kernel's source again
        kernel = do_compile(self, key, signature, device, constexprs, options, attrs, warmup)
        mode.job = None     # taken by CompileAndLink.submit, unless Triton had this compile already
        if kernel is not None:
            self.device_caches[device][0][key] = kernel
        return kernel

    class CompileAndLink(AsyncCompileMode):
        job = None

        def submit(self, key, compile_fn, finalize_fn):
            job, self.job = self.job, None

            def compile_and_link():
                if job is not None:
                    with contextlib.suppress(Exception):
                        job.result(timeout=PROCESS_COMPILE_TIMEOUT)
                return with_launcher(compile_fn())
            return super().submit(key, compile_and_link, finalize_fn)

    JITFunction.run, JITFunction._do_compile = compile_instead, submit_once
    try:
        with ThreadPoolExecutor(workers) as pool, compile_processes(workers) as procs, CompileAndLink(pool) as mode:
            yield
    finally:
        JITFunction.run, JITFunction._do_compile = run, do_compile
        # a failed compile raises out of AsyncCompileMode's exit before it clears itself, and
        # every later engine in the process would then refuse to start
        from triton.runtime._async_compile import active_mode
        active_mode.set(None)


class CompileCounter:
    """Records every Triton kernel compiled (an in-process JIT cache miss) while active, with
    its time: the engine compiles everything at start-up, so a run after it expects none."""

    def __init__(self):
        self.compiles: list[tuple[str, float]] = []
        self._start = 0.0

    def __enter__(self):
        import time
        from triton import knobs
        self._clock = time.perf_counter
        self._saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc):
        from triton import knobs
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved

    def _before(self, *args, **kwargs):
        self._start = self._clock()
        return None     # a true value would skip the compile

    def _after(self, *args, **kwargs):
        self.compiles.append((kwargs["fn"].name, self._clock() - self._start))

    @property
    def seconds(self) -> float:
        return sum(t for _, t in self.compiles)
