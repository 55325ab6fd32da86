"""Where an engine start's seconds go: each start-up phase's wall time and the Triton kernels
compiled in it. Run it on an empty Triton cache to see a new user's first start:

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python3 benchmarks/startup_phases.py MODEL_DIR

All compiles belong in the parallel compile pass (`compile_ahead`); a phase that is slow on an
empty cache and fast on a warm one without compiling anything is building launchers or loading
modules (benchmarks/RESULTS.md, eighth session). Last, each compile's seconds (Triton's `compile`,
cache hits included), the longest ones, and how much of the pass they overlapped. `--profile`:
where the compile pass's own thread (its warm-up launches) spends its time, by cProfile."""
import sys
import threading
import time

from asynct import LLM
from asynct.engine import cuda_graph, model_runner, piecewise_graph

PHASE, LOG, COMPILES = ["init"], [], []   # COMPILES: (kernel, start s, seconds, thread)


def phased(name, fn):
    def wrapped(*args, **kwargs):
        PHASE.append(name)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            print(f"phase {'/'.join(PHASE)}: {time.perf_counter() - t0:.2f} s", flush=True)
            PHASE.pop()
    return wrapped


def time_compiles():
    """Wraps triton.compiler.compile (each JITFunction binds it at its first launch)."""
    import triton.compiler as tc
    real, t_start = tc.compile, time.perf_counter()

    def timed(src, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(src, *args, **kwargs)
        finally:
            COMPILES.append((getattr(src, "name", "?"), t0 - t_start, time.perf_counter() - t0,
                             threading.get_ident()))
    tc.compile = timed


def compile_report():
    if not COMPILES:
        return
    first, last = min(c[1] for c in COMPILES), max(c[1] + c[2] for c in COMPILES)
    busy = sum(c[2] for c in COMPILES)
    print(f"{len(COMPILES)} compile calls over {last - first:.1f} s of wall, {busy:.1f} s summed "
          f"({busy / max(last - first, 1e-9):.1f} at once on average), {len({c[3] for c in COMPILES})} threads")
    for name, start, secs, _ in sorted(COMPILES, key=lambda c: -c[2])[:8]:
        print(f"  {secs:5.2f} s from {start - first:5.2f} s  {name}")


def profiled(fn):
    def wrapped(*args, **kwargs):
        import cProfile
        import pstats
        prof = cProfile.Profile()
        try:
            return prof.runcall(fn, *args, **kwargs)
        finally:
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return wrapped


def instrument(profile=False):
    time_compiles()
    runner = model_runner.ModelRunner
    if profile:
        runner._compile_ahead = profiled(runner._compile_ahead)
    for attr, name in (("_compile_ahead", "compile_ahead"), ("profile_activation_memory", "profile"),
                       ("_warmup", "warmup")):
        setattr(runner, attr, phased(name, getattr(runner, attr)))
    for cls, name in ((cuda_graph.CudaGraphRunner, "decode_graphs"),
                      (piecewise_graph.PiecewiseGraphRunner, "piecewise_graphs")):
        cls.__init__ = phased(name, cls.__init__)
    try:
        from triton import knobs
    except ImportError:
        return
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: LOG.append(("/".join(PHASE), kw["fn"].name))


def main(model, profile=False):
    instrument(profile)
    t0 = time.perf_counter()
    LLM(model, gpu_memory_utilization=0.45)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s, {len(LOG)} Triton compiles")
    phases = {}
    for phase, name in LOG:
        phases.setdefault(phase, []).append(name)
    for phase, names in phases.items():
        print(f"  {phase}: {len(names)} compiles ({', '.join(sorted(set(names)))})")
    compile_report()


if __name__ == "__main__":
    main(sys.argv[1], "--profile" in sys.argv[2:])
