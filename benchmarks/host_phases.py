"""The host's cost of a large decode step, by phase, unprofiled: what bounds a gsm8k-shaped
evaluation where the GPU step is shorter than the host's (an H100's host with lm-eval's stop
strings: wall 4.3-5.1 ms a step against 3.8-4.0 of GPU, benchmarks/RESULTS.md).

Phases, timed around the engine's own calls: schedule (Scheduler.schedule), launch (the
runner's; off CUDA less the forward and sampling it computes there), advance (LLMEngine._advance), finish (LLMEngine._finish less the runner's wait for
the device), detok (Detokenizer.step, inside finish). Means over decode-only steps, in us a row
and ms a step; on CUDA also the decode graph steps' wall and GPU time (the engine's step log): a
host whose ms a step exceed the GPU's bounds the run.

    python benchmarks/host_phases.py                      (CPU: the tiny preset, 220 rows)
    python benchmarks/host_phases.py --model DIR          (a GPU: bench-0.6b with a tokenizer)
    PYTHONPATH=<old tree> python benchmarks/host_phases.py  (another tree's engine, same script)
"""
import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from asynct import LLM, SamplingParams
from asynct.entrypoints.bench import workload
from asynct.model.checkpoint import make_checkpoint

LM_EVAL_GSM8K_STOPS = ["Question:", "</s>", "<|im_end|>"]


class PhaseClock:
    """Seconds spent in wrapped calls, kept per step; `exclude` calls count against the phase
    whose call encloses them."""

    def __init__(self):
        self.now, self.steps = defaultdict(float), []

    def wrap(self, obj, name, phase, inside=None):
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                self.now[phase] += dt
                if inside:
                    self.now[inside] -= dt
        setattr(obj, name, timed)

    def end_step(self, decode_only: bool, rows: int):
        if decode_only and rows:
            self.steps.append((rows, dict(self.now)))
        self.now.clear()


def instrument(eng, clock):
    runner = eng.runner
    clock.wrap(eng.scheduler, "schedule", "schedule")
    clock.wrap(runner, "launch", "launch")
    if runner.device.type != "cuda":    # the CPU computes what a GPU's launch only queues
        clock.wrap(runner, "_run_model", "model", inside="launch")
        clock.wrap(runner, "_sample", "model", inside="launch")
    clock.wrap(eng, "_advance", "advance")
    clock.wrap(eng, "_finish", "finish")
    clock.wrap(runner, "finish", "wait", inside="finish")
    if eng.detokenizer is not None:
        clock.wrap(eng.detokenizer, "step", "detok")
    step, schedule = eng.step, eng.scheduler.schedule
    last = []

    def scheduled():
        last[:] = [schedule()]
        return last[0]

    def counted_step():    # a step's phases: its batch's schedule, launch and advance, the one before's finish
        out = step()
        b = last[0] if last else None
        clock.end_step(b is not None and b.is_decode_only, len(b.seqs) if b else 0)
        return out
    eng.scheduler.schedule, eng.step = scheduled, counted_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a checkpoint with a tokenizer (default: one made of --preset)")
    ap.add_argument("--preset", default=None, help="default: bench-0.6b on CUDA, tiny off it")
    ap.add_argument("--rows", type=int, default=220)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-stop", action="store_true", help="without lm-eval's gsm8k stop strings")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    torch.set_num_threads(1)
    path = a.model
    if path is None:
        path = Path(tempfile.mkdtemp()) / "m"
        make_checkpoint(a.preset or ("bench-0.6b" if cuda else "tiny"), path, seed=0, tokenizer=True)
    kw = dict(gpu_memory_utilization=0.45) if cuda else {}
    llm = LLM(str(path), max_num_seqs=max(256, a.rows), max_model_len=2048, **kw)
    eng = llm.llm_engine
    clock = PhaseClock()
    instrument(eng, clock)
    prompts = [{"prompt_token_ids": p} for p, _ in workload("gsm8k", 259, 0.2)[:a.rows]]
    stop = None if a.no_stop else LM_EVAL_GSM8K_STOPS
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=a.tokens, stop=stop)
    print(f"{'round':>5} {'steps':>5} {'rows':>5} | us a row: schedule launch advance finish (detok) | "
          f"host ms a step | graph steps' wall / GPU ms | wall s")
    for r in range(a.rounds + 1):
        clock.steps.clear()
        eng.step_log = []
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        graph = [x for x in eng.step_log if x.kind == "graph" and x.gpu_s is not None]
        eng.step_log = None
        if r == 0 or not clock.steps:   # the first round warms up
            continue
        rows = sum(n for n, _ in clock.steps)
        us = {k: sum(s.get(k, 0.0) for _, s in clock.steps) / rows * 1e6
              for k in ("schedule", "launch", "advance", "finish", "detok")}
        host = sum(us[k] for k in ("schedule", "launch", "advance", "finish")) * rows / len(clock.steps) / 1e3
        steps = (f"{sum(x.wall_s for x in graph) / len(graph) * 1e3:.3f} / {sum(x.gpu_s for x in graph) / len(graph) * 1e3:.3f}"
                 if graph else "-")
        print(f"{r:>5} {len(clock.steps):>5} {rows // len(clock.steps):>5} | {us['schedule']:8.2f} "
              f"{us['launch']:6.2f} {us['advance']:7.2f} {us['finish']:6.2f} {'(%.2f)' % us['detok']:>7} | "
              f"{host:14.3f} | {steps:>25} | {wall:6.3f}")


if __name__ == "__main__":
    main()
