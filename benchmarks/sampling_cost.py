"""What sampling costs a decode step: the sampler alone on 1-256 rows of bench-0.6b's 152k
vocabulary (device time and host wall a call, each variant of SamplingParams), then whole decode
steps (CUDA graphs) of 256, 16 and 1 sequences, each variant against greedy. A peer tree runs the
same with its `asynct` first on PYTHONPATH.

    PYTHONPATH=. python3 benchmarks/sampling_cost.py /tmp/bench-0.6b [--no-alone]     # GPU only"""
import random
import sys
import time

import torch

from asynct import LLM, SamplingParams
from asynct.engine.sampler import sample
from asynct.engine.sequence import Sequence
from asynct.entrypoints.bench import run_engine

V, R = 151936, 256
ROWS = (1, 4, 16, 64, 256)
VARIANTS = {
    "greedy": dict(temperature=0),
    "temp 1": dict(temperature=1.0),
    "temp 1, top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "temp 1, top_k 50": dict(temperature=1.0, top_k=50),
    "temp 1, min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "temp 1, seeded": dict(temperature=1.0, seed=1),
    "temp 0.8, top_p 0.95, top_k 20": dict(temperature=0.8, top_p=0.95, top_k=20),
    # Qwen's generation_config: the penalty makes the logits fp32 (32-bit keys, 8 passes a bisection)
    "temp 0.7, top_p 0.8, top_k 20, rep 1.05": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
}


def timed(fn, reps=20):
    """(median host wall, median device time) of fn, in us."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    walls, devs = [], []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        s.record()
        fn()
        e.record()
        walls.append(time.perf_counter() - t)
        e.synchronize()
        devs.append(s.elapsed_time(e) / 1e3)
    return sorted(walls)[reps // 2] * 1e6, sorted(devs)[reps // 2] * 1e6


def alone():
    logits = (torch.randn(R, V, device="cuda") * 3).to(torch.bfloat16)
    print("| variant | " + " | ".join(f"{r} rows: host / device us" for r in ROWS) + " |")
    for name, kw in VARIANTS.items():
        cells = []
        for r in ROWS:
            seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(max_tokens=8, **kw), 16) for i in range(r)]
            wall, dev = timed(lambda: sample(logits[:r], seqs))
            cells.append(f"{wall:.0f} / {dev:.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def steps(llm, prompts, rows, names, max_tokens):
    print(f"| variant at {rows} rows | wall s | graph steps, mean ms |")
    for name in names:
        reqs = [(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **VARIANTS[name])) for p in prompts[:rows]]
        run_engine(llm, reqs[:8])
        res = run_engine(llm, reqs)
        got = [s.wall_s for s in res["step_log"] if s.kind == "graph" and s.num_seqs == rows]
        print(f"| {name} | {res['wall_s']:.3f} | {sum(got) / max(1, len(got)) * 1e3:.4f} ({len(got)}) |", flush=True)


def engine(model):
    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=R, gpu_memory_utilization=0.45)
    print(f"engine start {time.perf_counter() - t0:.1f} s")
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(200)] for _ in range(R)]
    steps(llm, prompts, R, list(VARIANTS), 160)
    few = ["greedy", "temp 1", "temp 1, top_p 0.9", "temp 1, seeded", "temp 0.8, top_p 0.95, top_k 20",
           "temp 0.7, top_p 0.8, top_k 20, rep 1.05"]
    steps(llm, prompts, 16, few, 256)
    steps(llm, prompts, 1, few, 256)


if __name__ == "__main__":
    if "--no-alone" not in sys.argv:
        alone()
    engine(sys.argv[1])
