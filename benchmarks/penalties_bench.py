"""What the repetition, frequency and presence penalties cost: whole generations at batch 1
(ms a token) and 256 x 128 tokens (s), plain and penalised, and adjust_logits alone at 256
rows of the model's vocabulary (us, CUDA events). The package under test is the `asynct`
first on PYTHONPATH, so two commits compare in one call:

    mkdir -p /tmp/old && git archive <commit> asynct | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python3 benchmarks/penalties_bench.py old --model M
    PYTHONPATH=. python3 benchmarks/penalties_bench.py new --model M"""
import argparse
import cProfile
import os
import pstats
import time

import torch

from asynct import LLM, SamplingParams

CASES = {"plain": {}, "frequency + presence": dict(frequency_penalty=0.5, presence_penalty=0.3),
         "repetition 1.2": dict(repetition_penalty=1.2)}


def prompts(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(10, vocab, (length,), generator=g).tolist()} for _ in range(n)]


def generate_s(llm, batch, tokens, params, vocab, reps=3):
    """(wall s, this process's CPU s) of the fastest of `reps` timed generations after a warm one:
    a single slow run does not stand for the process (the fourteenth session timed one a process,
    and old's batch-1 repetition runs differed by 13 % between processes). CPU time below wall time
    means the host thread waited (on the GPU, or on a busy host)."""
    p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, **params)
    llm.generate(prompts(batch, 128, vocab, 0), p, use_tqdm=False)     # warm
    times = []
    for rep in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate(prompts(batch, 128, vocab, 1 + rep), p, use_tqdm=False)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    return min(times)


def adjust_us(vocab, rows=256, reps=20):
    """adjust_logits alone (us a call: the device's, and the host's): `rows` rows, each with 128
    output tokens counted, frequency + presence + repetition penalties, every row's counts kept
    from the step before. Device time near host time means the host is what limits it."""
    from asynct.engine.penalties import adjust_logits
    from asynct.engine.penalty_counts import PenaltyCounts
    from asynct.engine.sequence import Sequence
    params = SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(rows):
        s = Sequence(i, str(i), 0, torch.randint(vocab, (128,), generator=g).tolist(), params, 16)
        for t in torch.randint(vocab, (128,), generator=g).tolist():
            s.append_token(t)
        seqs.append(s)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    counts = PenaltyCounts(rows_hint=rows + 1)
    adjust_logits(logits, seqs, None, counts)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        adjust_logits(logits, seqs, None, counts)
    host = time.perf_counter() - t0     # the host's own time: no wait inside the loop
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / reps, host * 1e6 / reps


def profile(llm, cases, vocab, tokens=512, top=22):
    """Where a batch-1 generation's host time goes: the `top` functions by own time (the profiler
    slows the host, so steps bound by the host run longer than unprofiled)."""
    for name in cases:
        p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, **CASES[name])
        llm.generate(prompts(1, 128, vocab, 0), p, use_tqdm=False)     # warm
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(llm.generate, prompts(1, 128, vocab, 1), p, use_tqdm=False)
        print(f"=== {name}: {(time.perf_counter() - t0) / tokens * 1e3:.3f} ms a token under cProfile", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tag")
    ap.add_argument("--model", required=True)
    ap.add_argument("--no-large", action="store_true", help="batch 1 only (no 256 x 128, no adjust_logits)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    ap.add_argument("--profile", action="store_true", help="cProfile one batch-1 generation a case instead")
    a = ap.parse_args()
    llm = LLM(a.model, gpu_memory_utilization=0.45)
    vocab = llm.llm_engine.config.vocab_size
    if a.profile:
        return profile(llm, a.cases.split(","), vocab)
    for rows in (1,) if a.no_large else (1, 256):
        dev_us, host_us = adjust_us(vocab, rows)
        print(f"{a.tag} | adjust_logits, {rows} rows, all three penalties | {dev_us:.0f} us (host {host_us:.0f})",
              flush=True)
    print(f"{a.tag} | load average {os.getloadavg()[0]:.2f}", flush=True)
    for name in a.cases.split(","):
        params = CASES[name]
        wall, cpu = (t / 512 * 1e3 for t in generate_s(llm, 1, 512, params, vocab))
        big = "" if a.no_large else f" | 256 x 128: {generate_s(llm, 256, 128, params, vocab)[0]:.3f} s"
        print(f"{a.tag} | {name} | batch 1: {wall:.3f} ms a token (CPU {cpu:.3f}){big}", flush=True)


if __name__ == "__main__":
    main()
