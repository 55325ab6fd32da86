"""The engine's compile pass on Triton's machinery: launches that only compile, their compiles
in forked worker processes and threads, launchers built ahead (runner_startup.py runs the warm-up
inside `compile_only`), and a counter of compiles for the checks that nothing compiles later."""
import contextlib
import os
import warnings
from concurrent.futures import ThreadPoolExecutor


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


def _cache_empty() -> bool:
    """Triton's disk cache holds nothing (a fresh machine's): every compile will be a miss."""
    from triton import knobs
    return not os.path.isdir(knobs.cache.dir) or not any(os.scandir(knobs.cache.dir))


def _on_disk(cache_key: str, name: str) -> bool:
    """Whether Triton's disk cache holds this compile, looked up as `triton.compiler.compile` does."""
    import hashlib
    from triton.runtime.cache import get_cache_manager
    group = get_cache_manager(hashlib.sha256(cache_key.encode("utf-8")).hexdigest()).get_group(f"{name}.json")
    return f"{name}.json" in (group or {})


@contextlib.contextmanager
def compile_only(workers: int):
    """Inside, a kernel launch only compiles (nothing runs): each compile goes to a thread that
    builds its launcher too (`with_launcher`), one missing from the disk cache first to a worker
    process that leaves it there; all are done on exit. Running a warm-up pass in here overlaps
    the compiles. In threads alone, the compiler's Python shared the GIL with every other compile
    and with the warm-up's launches: 16 threads ran ~10 compiles at once, each ~3x slower than
    alone (H200 host, benchmarks/RESULTS.md). A process that fails leaves its compile to the thread."""
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction
    run, do_compile = JITFunction.run, JITFunction._do_compile

    def compile_instead(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    def submit_once(self, key, signature, device, constexprs, options, attrs, warmup):
        if mode.procs is None and not mode.raw_futures and _cache_empty():
            mode.start_workers()    # before the pass's first compile hashes its kernel (0.4 s)
        mode.pending = (self.fn.__module__, self.fn.__name__, signature, constexprs, attrs,
                        self.device_caches[device][2], options.__dict__)
        # the pending compile stands in the kernel cache (the pass's end replaces it with the
        # kernel; a launch finding it there waits for it): Triton adds a kernel there only then,
        # so every later launch of the same specialisation hashed the kernel's source again
        kernel = do_compile(self, key, signature, device, constexprs, options, attrs, warmup)
        mode.pending = None     # taken by CompileAndLink.submit, unless a compile hook skipped it
        if kernel is not None:
            self.device_caches[device][0][key] = kernel
        return kernel

    class CompileAndLink(AsyncCompileMode):
        pending = None      # _compile_to_disk's arguments for the compile being submitted
        procs = None        # the worker processes; False: none

        def submit(self, key, compile_fn, finalize_fn):
            job = self.to_process(key)

            def compile_and_link():
                if job is not None:
                    with contextlib.suppress(Exception):
                        job.result(timeout=PROCESS_COMPILE_TIMEOUT)
                return with_launcher(compile_fn())
            return super().submit(key, compile_and_link, finalize_fn)

        def to_process(self, key):
            """A worker process's compile of the pending kernel, or None: Triton has it already,
            the disk cache has it, or there are no workers. They fork at the pass's first compile
            if the disk cache lacks it (at its first launch if the cache is empty: hashing that
            kernel first held them back 0.4 s), while no compile thread exists (one mid-compile
            could leave a lock held in a child): a warm cache compiles in threads (16 workers
            forked there for nothing: the pass 1.3-1.4 s against 0.9-1.1, H200)."""
            pending, self.pending = self.pending, None
            if pending is None or key in self.future_kernels or _on_disk(key, pending[1]):
                return None
            self.start_workers()
            try:
                return self.procs.submit(_compile_to_disk, *pending) if self.procs else None
            except Exception:   # noqa: BLE001  (no processes after all: the threads compile)
                self.procs = False
                return None

        def start_workers(self):
            """Forks the workers, once, while no compile thread exists (else there are none)."""
            if self.procs is None:
                self.procs = not self.raw_futures and stack.enter_context(compile_processes(workers)) or False

    JITFunction.run, JITFunction._do_compile = compile_instead, submit_once
    try:
        with ThreadPoolExecutor(workers) as pool, contextlib.ExitStack() as stack, CompileAndLink(pool) as mode:
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
