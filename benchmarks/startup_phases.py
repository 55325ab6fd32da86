"""Where an engine start's seconds go: each start-up phase's wall time and the Triton kernels
compiled in it. Run it on an empty Triton cache to see a new user's first start:

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python3 benchmarks/startup_phases.py MODEL_DIR [--server]

All compiles belong in the parallel compile pass (`compile_ahead`); a phase that is slow on an
empty cache and fast on a warm one without compiling anything is building launchers or loading
modules (benchmarks/RESULTS.md, eighth session). Last, the compiles (Triton's `compile` in this
process, cache hits included; each compile in a worker process) and the launcher builds: their
span, seconds summed, how many ran at once, the longest. `--profile`: the compile pass under
cProfile (from Python 3.12 it sees every thread, the compile threads' too). `--server`: the
engine in its own daemonic process instead, as `asynct serve` and `data_parallel_size` > 1 start
it: its start-up phases (no compile detail: they run in that process), then whether any of its
processes (compile workers) outlived its shutdown."""
import os
import sys
import threading
import time

from asynct import LLM
from asynct.engine import cuda_graph, model_runner, piecewise_graph

PHASE, LOG = ["init"], []
# (kernel, start s, seconds, thread or process) of each Triton compile in this process (cache
# hits when compile processes ran first), each compile in a worker process, each launcher built
CALLS = {"compile": [], "process compile": [], "launcher": []}
T0 = time.perf_counter()     # CLOCK_MONOTONIC: the same clock in the forked compile processes
PROCESS_LOG = f"/tmp/startup_phases_{os.getpid()}.log"


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


def timed(kind, fn, name_of):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CALLS[kind].append((name_of(*args), t0 - T0, time.perf_counter() - t0, threading.get_ident()))
    return wrapped


def in_process(*args):
    """_compile_to_disk in a worker process: its time goes to a file the parent reads."""
    t0 = time.perf_counter()
    try:
        return REAL_COMPILE_TO_DISK(*args)
    finally:
        with open(PROCESS_LOG, "a") as f:
            f.write(f"{args[1]} {t0 - T0} {time.perf_counter() - t0} {os.getpid()}\n")


def time_compiles():
    """Wraps triton.compiler.compile (each JITFunction binds it at its first launch), the
    worker processes' compiles and the launcher builds."""
    global REAL_COMPILE_TO_DISK
    import importlib
    import triton.compiler as tc
    try:
        passes = importlib.import_module("asynct.ops.compile_pass")
    except ImportError:     # a tree before compile_pass.py (a same-run peer): _triton held it
        passes = importlib.import_module("asynct.ops._triton")
    tc.compile = timed("compile", tc.compile, lambda src, *a: getattr(src, "name", "?"))
    passes.with_launcher = timed("launcher", passes.with_launcher, lambda k: getattr(k, "name", "?"))
    REAL_COMPILE_TO_DISK = getattr(passes, "_compile_to_disk", None)   # None: a tree without processes
    if REAL_COMPILE_TO_DISK is not None:
        in_process.__module__, in_process.__qualname__ = passes.__name__, "_compile_to_disk"   # pickled by name
        passes._compile_to_disk = in_process


def compile_report():
    if os.path.exists(PROCESS_LOG):
        with open(PROCESS_LOG) as f:
            CALLS["process compile"] = [(n, float(a), float(b), p) for n, a, b, p in (ln.split() for ln in f)]
        os.remove(PROCESS_LOG)
    for kind, calls in CALLS.items():
        if not calls:
            continue
        first, last = min(c[1] for c in calls), max(c[1] + c[2] for c in calls)
        busy = sum(c[2] for c in calls)
        print(f"{len(calls)} {kind} calls from {first:.1f} to {last:.1f} s, {busy:.1f} s summed "
              f"({busy / max(last - first, 1e-9):.1f} at once on average), {len({c[3] for c in calls})} threads/processes")
        for name, start, secs, _ in sorted(calls, key=lambda c: -c[2])[:5]:
            print(f"  {secs:5.2f} s from {start:5.2f} s  {name}")


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


def server(model):
    """The server's path: DataParallelEngine of one engine process."""
    import multiprocessing
    from asynct.engine.data_parallel import DataParallelEngine
    from asynct.engine.engine_args import EngineArgs
    t0 = time.perf_counter()
    engine = DataParallelEngine(EngineArgs(model=model, data_parallel_size=1, gpu_memory_utilization=0.45))
    print(f"engine process ready in {time.perf_counter() - t0:.1f} s: " +
          ", ".join(f"{k} {v:.2f} s" for k, v in engine.startup_seconds.items()))
    family = descendants({p.pid for p in multiprocessing.active_children()})
    engine.shutdown()
    time.sleep(1)
    left = [pid for pid in family if os.path.exists(f"/proc/{pid}")]
    print(f"processes left after its shutdown: {left or 'none'} (of {len(family)})")


def descendants(pids):
    """`pids` and every process below them (Linux /proc; their parents read from each stat)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found = set(pids)
    while grown := {p for p, pp in parent.items() if pp in found} - found:
        found |= grown
    return found


if __name__ == "__main__":
    if "--server" in sys.argv[2:]:
        server(sys.argv[1])
    else:
        main(sys.argv[1], "--profile" in sys.argv[2:])
