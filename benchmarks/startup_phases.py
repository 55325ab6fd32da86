"""Where an engine start's seconds go: each start-up phase's wall time and the Triton kernels
compiled in it. Run it on an empty Triton cache to see a new user's first start:

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python3 benchmarks/startup_phases.py MODEL_DIR

All compiles belong in the parallel compile pass (`compile_ahead`); a phase that is slow on an
empty cache and fast on a warm one without compiling anything is building launchers or loading
modules (benchmarks/RESULTS.md, eighth session)."""
import sys
import time

from asynct import LLM
from asynct.engine import cuda_graph, model_runner, piecewise_graph

PHASE, LOG = ["init"], []


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


def instrument():
    runner = model_runner.ModelRunner
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


def main(model):
    instrument()
    t0 = time.perf_counter()
    LLM(model, gpu_memory_utilization=0.45)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s, {len(LOG)} Triton compiles")
    phases = {}
    for phase, name in LOG:
        phases.setdefault(phase, []).append(name)
    for phase, names in phases.items():
        print(f"  {phase}: {len(names)} compiles ({', '.join(sorted(set(names)))})")


if __name__ == "__main__":
    main(sys.argv[1])
