"""Where a mixed step's host launch goes. On the H200 a gsm8k run's piecewise mixed steps (~220
decodes + ~7,900 prompt tokens) took 22.9 ms of host launch against 23.8 ms of GPU time, close
enough to suspect the launch waits for the device. This runs such steps and prints, a step:
host launch, GPU time and wall, with the device busy (the step before in flight, as a run has
it) and idle (synchronised first): a launch that waits for the device is much shorter when it
is idle; then the ops that synchronised during the launches (torch's sync debug mode), and the
launch under cProfile (its ranking, not its absolute numbers).

    python benchmarks/mixed_host.py [--model DIR] [--decodes 224] [--prompts 16] [--prompt-len 480]

Off CUDA (`--preset tiny --device cpu`, small counts) it only checks that the script runs."""
import argparse
import cProfile
import pstats
import tempfile
import time
import warnings
from pathlib import Path

import torch

from asynct import LLM, SamplingParams
from asynct.model.checkpoint import make_checkpoint
from profile_decode import fill_decodes


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mixed_steps(eng, a, steps, idle=False):
    """`steps` mixed steps: each adds a.prompts one-token requests and steps; the step log's
    mixed records (launch, GPU, wall ms means)."""
    eng.step_log = []
    params = SamplingParams(temperature=0, max_tokens=1)
    for s in range(steps):
        for i in range(a.prompts):
            eng.add_request(f"m{s}-{i}-{time.perf_counter_ns()}", [(s * 31 + i * 7 + j) % 30000 + 3
                                                                   for j in range(a.prompt_len)], params)
        if idle:
            sync()
        eng.step()
    sync()
    mixed = [r for r in eng.step_log if r.kind.endswith("mixed")]
    eng.step_log = None
    mean = lambda xs: sum(xs) / max(1, len(xs)) * 1e3   # noqa: E731
    return len(mixed), mean([r.launch_s for r in mixed]), mean([r.gpu_s or 0 for r in mixed]), \
        mean([r.wall_s for r in mixed])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="bench-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--decodes", type=int, default=224)
    ap.add_argument("--context", type=int, default=900)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=480)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    model = a.model or make_checkpoint(a.preset, Path(tempfile.mkdtemp()) / "m", tokenizer=False)
    llm = LLM(str(model), device=a.device, max_num_seqs=a.decodes + a.prompts, gpu_memory_utilization=0.6)
    eng = fill_decodes(llm, a.decodes, a.context)
    mixed_steps(eng, a, 3)
    for idle in (False, True, False, True):
        n, launch, gpu, wall = mixed_steps(eng, a, a.steps, idle)
        print(f"{'idle' if idle else 'busy'} device: {n} mixed steps, launch {launch:.2f} ms, GPU {gpu:.2f} ms, "
              f"wall {wall:.2f} ms")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixed_steps(eng, a, 3)
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    syncs = {str(w.message).splitlines()[0][:120] for w in caught}
    print(f"synchronising ops in 3 steps: {len(caught)}", *sorted(syncs), sep="\n  ")
    prof = cProfile.Profile()
    prof.enable()
    mixed_steps(eng, a, a.steps)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = [(f"{Path(f).name}:{line} {name}", tt / a.steps * 1e3, ct / a.steps * 1e3, nc / a.steps)
            for (f, line, name), (_, nc, tt, ct, _) in stats.stats.items()]
    print(f"top {a.top} by cumulative time (ms a step under cProfile; calls a step)")
    for name, own, cum, calls in sorted(rows, key=lambda r: -r[2])[:a.top]:
        print(f"  {cum:8.2f} {own:8.2f} {calls:7.1f}  {name[:100]}")


if __name__ == "__main__":
    main()
