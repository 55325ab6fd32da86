"""One decode step at 256 running sequences: kernel time vs gaps (torch profiler), and the CUDA
graph gain measured cleanly (same engine, same sequences, warm, many steps each way).

    python benchmarks/profile_decode.py [--model DIR] [--batch 256] [--context 1024] [--shared-prefix 700]
    python benchmarks/profile_decode.py --batch 1 --context 384 --timeline    # where a graphed step goes
"""
import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from asynct import LLM, SamplingParams
from asynct.model.checkpoint import make_checkpoint


def fill_decodes(llm, batch, context, shared=0):
    """Queues `batch` sequences of `context` tokens (a count, or one a sequence) and steps until
    every one is decoding. With `shared`, every prompt starts with the same `shared` tokens,
    computed once (the first request's) and then found in the prefix cache by all the others:
    gsm8k's 5-shot prompts (cascade decode)."""
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=100000)
    lens = context if isinstance(context, list) else [context] * batch
    prompt = lambda i: [(j * 13 + 5) % 30000 if j < shared else (i * 7 + j) % 30000  # noqa: E731
                        for j in range(lens[i])]
    for i in range(batch):
        eng.add_request(f"p{i}", prompt(i), params)
        if i == 0 and shared:
            _drain(eng)
    _drain(eng)
    return eng


def _drain(eng):
    while any(s.is_prefilling for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()


def mean_step(eng, steps) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def kernel_summary(eng, steps=5):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = mean_step(eng, steps)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel = sum(e.device_time for e in events) / steps / 1e6
    top = {}
    for e in events:
        top[e.name] = top.get(e.name, 0.0) + e.device_time / steps / 1e3
    return wall, kernel, sorted(top.items(), key=lambda kv: -kv[1])[:12]


def _layer_names(step):
    """The kernels' names, a kernel that runs k times a layer numbered by its place there (o_proj
    and down are both `linear_dyht_add`: #1 and #2), the layer count being the commonest count."""
    names = [e.name[:60] for e in step]
    counts = Counter(names)
    layers = Counter(c for c in counts.values() if c >= 8).most_common(1)[0][0]
    seen = Counter()
    out = []
    for n in names:
        per = counts[n] // layers if counts[n] % layers == 0 else 1
        out.append(f"{n[:56]} #{seen[n] % per + 1}" if per > 1 else n)
        seen[n] += 1
    return out


def graph_timeline(eng, steps=20):
    """Graph-replayed steps from the profiler's kernel records: per kernel, its duration and its
    advance (the next kernel's start minus its own). Under PDL a kernel starts early and waits, so
    its duration overstates it; the advances of a step add up to the step's span."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mean_step(eng, steps)
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and e.device_time > 0), key=lambda e: e.time_range.start)
    runs, cur = [], []
    # the profile starts between steps: its first record (the embedding's gather, or an input
    # copy) starts each step; the host may leave no gap between steps to split at
    for e in events:
        if e.name == events[0].name and cur:
            runs.append(cur)
            cur = []
        cur.append(e)
    runs = [r for r in runs if len(r) > 50][1:]     # whole steps only
    rows = {}
    for r in runs:
        for a, b, name in zip(r, r[1:] + [None], _layer_names(r)):
            n, dur, adv = rows.get(name, (0, 0.0, 0.0))
            rows[name] = (n + 1, dur + a.device_time,
                          adv + (b or a).time_range.start - a.time_range.start + (0 if b else a.device_time))
    span = sum(r[-1].time_range.end - r[0].time_range.start for r in runs) / len(runs)
    print(f"graph steps: {len(runs)}, {len(runs[0])} kernels and copies a step, span {span:.1f} us")
    print(f"{'kernel':60s} {'a step':>6s} {'dur us':>7s} {'advance us':>10s} {'a step us':>9s}")
    for name, (n, dur, adv) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"{name:60s} {n / len(runs):6.0f} {dur / n:7.2f} {adv / n:10.2f} {adv / len(runs):9.1f}")
    step = runs[len(runs) // 2]
    print("one step's kernels outside the layers, in order (advance us):")
    for i, (a, b, name) in enumerate(zip(step, step[1:] + [None], _layer_names(step))):
        if rows[name][0] < len(runs) * 8:      # fewer than 8 a step: not a layer's
            adv = (b.time_range.start if b else a.time_range.end) - a.time_range.start
            print(f"  {i:4d} {a.name[:70]:70s} {adv:7.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="leading prompt tokens all sequences share (gsm8k-shaped: 700 of ~900)")
    ap.add_argument("--timeline", action="store_true",
                    help="only the graph-replayed step's kernels: durations and what each adds to the step")
    a = ap.parse_args()
    model = a.model or make_checkpoint("bench-0.6b", Path(tempfile.mkdtemp()) / "m", tokenizer=False)
    llm = LLM(str(model), max_num_seqs=a.batch, gpu_memory_utilization=0.6)
    eng = fill_decodes(llm, a.batch, a.context, a.shared_prefix)
    if a.timeline:
        mean_step(eng, 30)
        return graph_timeline(eng)
    runner = eng.runner
    graphs = runner.graphs
    mean_step(eng, 5)
    t_graph = mean_step(eng, a.steps)
    runner.graphs = None
    mean_step(eng, 5)
    t_eager = mean_step(eng, a.steps)
    wall_e, kern_e, top_e = kernel_summary(eng)
    runner.graphs = graphs
    wall_g, kern_g, _ = kernel_summary(eng)
    print(f"decode step, {a.batch} seqs, context ~{a.context}, shared prefix {a.shared_prefix}: "
          f"top kernels (eager, ms/step)")
    for name, ms in top_e:
        print(f"  {ms:8.3f}  {name[:90]}")
    print(f"{'mode':8s} {'step ms':>9s} {'kernel ms':>10s} {'gaps ms':>8s} {'kernel %':>9s}")
    for mode, wall, kern in (("eager", wall_e, kern_e), ("graphs", wall_g, kern_g)):
        print(f"{mode:8s} {wall * 1e3:9.3f} {kern * 1e3:10.3f} {(wall - kern) * 1e3:8.3f} {100 * kern / wall:8.1f}%")
    print(f"clean timing over {a.steps} steps: eager {t_eager * 1e3:.3f} ms, graphs {t_graph * 1e3:.3f} ms, "
          f"graph gain {t_eager / t_graph:.2f}x")


if __name__ == "__main__":
    main()
