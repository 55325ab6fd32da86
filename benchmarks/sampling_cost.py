"""What sampling costs a decode step: the sampler alone on 256 rows of bench-0.6b's 152k
vocabulary (wall and device time a call, each variant of SamplingParams, and the torch ops a sort
filter is made of), then whole decode steps (CUDA graphs) of 256 sequences and of one, each
variant against greedy. A peer tree runs the same with its `asynct` first on PYTHONPATH.

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
VARIANTS = {
    "greedy": dict(temperature=0),
    "temp 1": dict(temperature=1.0),
    "temp 1, top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "temp 1, top_k 50": dict(temperature=1.0, top_k=50),
    "temp 1, min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "temp 1, seeded": dict(temperature=1.0, seed=1),
    "temp 0.8, top_p 0.95, top_k 20": dict(temperature=0.8, top_p=0.95, top_k=20),
}


def alone():
    logits = (torch.randn(R, V, device="cuda") * 3).to(torch.bfloat16)
    print("| variant | sampler wall us | device us |")
    for name, kw in VARIANTS.items():
        seqs = [Sequence(i, str(i), 0, [1, 2], SamplingParams(max_tokens=8, **kw), 16) for i in range(R)]
        for _ in range(3):
            sample(logits, seqs)
        torch.cuda.synchronize()
        walls, devs = [], []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            s.record()
            sample(logits, seqs)
            e.record()
            e.synchronize()
            walls.append(time.perf_counter() - t)
            devs.append(s.elapsed_time(e) / 1e3)
        print(f"| {name} | {sorted(walls)[10] * 1e6:.0f} | {sorted(devs)[10] * 1e6:.0f} |", flush=True)
    x = logits.float()
    for name, fn in (("sort fp32", lambda: x.sort(dim=-1, descending=True)), ("softmax fp32", lambda: x.softmax(-1)),
                     ("topk 50", lambda: x.topk(50, dim=-1)), ("argmax", lambda: x.argmax(-1)),
                     ("exponential_", lambda: torch.empty_like(x).exponential_()), ("cumsum", lambda: x.cumsum(-1))):
        for _ in range(3):
            fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fn()
        e.record()
        e.synchronize()
        print(f"| op: {name} | | {s.elapsed_time(e) / 20 * 1e3:.0f} |", flush=True)


def engine(model):
    llm = LLM(model, max_num_seqs=R, gpu_memory_utilization=0.45)
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(200)] for _ in range(R)]
    print("| variant | wall s | graph steps at 256 rows, mean ms |")
    for name, kw in VARIANTS.items():
        params = SamplingParams(max_tokens=160, ignore_eos=True, **kw)
        reqs = [(p, params) for p in prompts]
        run_engine(llm, reqs[:8])
        res = run_engine(llm, reqs)
        steps = [r.wall_s for r in res["step_log"] if r.kind == "graph" and r.num_seqs == R]
        print(f"| {name} | {res['wall_s']:.3f} | {sum(steps) / max(1, len(steps)) * 1e3:.3f} ({len(steps)}) |", flush=True)
    print("| batch 1 variant | wall s | graph steps at 1 row, mean ms |")
    for name in ("greedy", "temp 1, top_p 0.9", "temp 0.8, top_p 0.95, top_k 20"):
        reqs = [(prompts[0], SamplingParams(max_tokens=256, ignore_eos=True, **VARIANTS[name]))]
        run_engine(llm, reqs)
        res = run_engine(llm, reqs)
        steps = [r.wall_s for r in res["step_log"] if r.kind == "graph" and r.num_seqs == 1]
        print(f"| {name} | {res['wall_s']:.3f} | {sum(steps) / max(1, len(steps)) * 1e3:.4f} ({len(steps)}) |", flush=True)


if __name__ == "__main__":
    if "--no-alone" not in sys.argv:
        alone()
    engine(sys.argv[1])
