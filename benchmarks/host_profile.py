"""Where a small-batch decode step's host time goes: the engine loop under cProfile (us a step,
by function), beside the same steps unprofiled (wall, and the runner's launch time a step).
cProfile roughly doubles pure-Python time; read the ranking, not the absolute numbers.

    python benchmarks/host_profile.py [--batch 1] [--context 128] [--steps 300] [--top 40]
"""
import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch

from asynct import LLM
from asynct.model.checkpoint import make_checkpoint
from profile_decode import fill_decodes


def timed_steps(eng, steps):
    """(wall a step, launch host time a step) over `steps` steps, unprofiled."""
    eng.step_log = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    launch = sum(r.launch_s for r in eng.step_log) / max(1, len(eng.step_log))
    eng.step_log = None
    return wall, launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    model = a.model or make_checkpoint("bench-0.6b", Path(tempfile.mkdtemp()) / "m", tokenizer=False)
    llm = LLM(str(model), max_num_seqs=max(a.batch, 8), gpu_memory_utilization=0.6)
    eng = fill_decodes(llm, a.batch, a.context)
    timed_steps(eng, 50)
    wall, launch = timed_steps(eng, a.steps)
    print(f"batch {a.batch}: {wall * 1e3:.3f} ms a step, launch {launch * 1e3:.3f} ms a step (unprofiled)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = [(f"{Path(f).name}:{line} {name}", tt / a.steps * 1e6, ct / a.steps * 1e6, nc / a.steps)
            for (f, line, name), (_, nc, tt, ct, _) in stats.stats.items()]
    for key, title in ((2, "cumulative"), (1, "own")):
        print(f"top {a.top} by {title} time (us a step under cProfile; calls a step)")
        for name, own, cum, calls in sorted(rows, key=lambda r: -r[key])[:a.top]:
            print(f"  {cum:8.1f} {own:8.1f} {calls:6.1f}  {name[:100]}")


if __name__ == "__main__":
    main()
