"""One decode step at 256 running sequences: kernel time vs gaps (torch profiler), and the CUDA
graph gain measured cleanly (same engine, same sequences, warm, many steps each way).

    python benchmarks/profile_decode.py [--model DIR] [--batch 256] [--context 1024] [--shared-prefix 700]
"""
import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from asynct import LLM, SamplingParams
from asynct.model.checkpoint import make_checkpoint


def fill_decodes(llm, batch, context, shared=0):
    """Queues `batch` sequences and steps until every one is decoding. With `shared`, every
    prompt starts with the same `shared` tokens, computed once (the first request's) and then
    found in the prefix cache by all the others: gsm8k's 5-shot prompts (cascade decode)."""
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=100000)
    prompt = lambda i: [(j * 13 + 5) % 30000 if j < shared else (i * 7 + j) % 30000  # noqa: E731
                        for j in range(context)]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="leading prompt tokens all sequences share (gsm8k-shaped: 700 of ~900)")
    a = ap.parse_args()
    model = a.model or make_checkpoint("bench-0.6b", Path(tempfile.mkdtemp()) / "m", tokenizer=False)
    llm = LLM(str(model), max_num_seqs=a.batch, gpu_memory_utilization=0.6)
    eng = fill_decodes(llm, a.batch, a.context, a.shared_prefix)
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
