"""Where an evaluation's scoring pass goes on the GPU: prompts of 200-2,000 tokens, one new token
each (the `prefill` workload's shape), kernel time summed by name (torch profiler), then the
GPU's idle gaps over 150 us with the host ops running in them.

    PYTHONPATH=. python3 benchmarks/prefill_profile.py MODEL_DIR [--prompts 96] [--eager]
"""
import argparse
import collections
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from asynct import LLM, SamplingParams

CUDA = torch.autograd.DeviceType.CUDA


def kernel_table(prof, top=28):
    agg, cnt = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == CUDA:
            agg[e.name[:90]] += e.device_time_total
            cnt[e.name[:90]] += 1
    total = sum(agg.values())
    for name, t in agg.most_common(top):
        print(f"{t / 1e3:9.2f} ms {100 * t / total:5.1f}% x{cnt[name]:5d}  {name}")
    return total


def gaps(prof, min_us=150, top=14):
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == CUDA)
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    found = [(b[0] - a[1], a[1], b[0], a[2][:40], b[2][:40]) for a, b in zip(ks, ks[1:]) if b[0] - a[1] > min_us]
    print(f"span {(ks[-1][1] - ks[0][0]) / 1e3:.1f} ms, {len(found)} gaps > {min_us} us, "
          f"total {sum(g[0] for g in found) / 1e3:.1f} ms")
    for g, start, end, before, after in sorted(found, reverse=True)[:top]:
        ops = collections.Counter()
        for c in cpu:
            lo, hi = max(c.time_range.start, start), min(c.time_range.end, end)
            if hi > lo:
                ops[c.name[:50]] += hi - lo
        print(f"gap {g / 1e3:.2f} ms at {(start - ks[0][0]) / 1e3:.1f} ms: {before} -> {after}")
        print("    host: " + "; ".join(f"{n} {t / 1e3:.2f}" for n, t in ops.most_common(6)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (piecewise graphs by default)")
    a = ap.parse_args()
    llm = LLM(a.model, gpu_memory_utilization=0.5, enforce_eager=a.eager)
    rng = random.Random(0)
    reqs = [{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(rng.randint(200, 2000))]}
            for _ in range(a.prompts)]
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(reqs[:16], params, use_tqdm=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(reqs, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    print(f"wall {wall * 1e3:.1f} ms, {tokens} tokens, {tokens / wall:.0f} tok/s (profiled)")
    total = kernel_table(prof)
    print(f"GPU kernels {total / 1e3:.1f} ms")
    gaps(prof)


if __name__ == "__main__":
    main()
