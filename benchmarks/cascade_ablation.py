"""Cascade decode on and off, in one run: the decode kernel alone on a gsm8k-shaped batch, then
the engine on the bench workloads (an engine built with the cascade threshold out of reach
captures its graphs without the prefix pass: the engine as it was before cascade attention).

    PYTHONPATH=. python3 benchmarks/cascade_ablation.py [--model DIR]
"""
import argparse
import gc

import torch

from asynct import LLM
from asynct.attention import triton_backend
from asynct.entrypoints.bench import copy_bandwidth, decode_roofline, run_engine, workload
from asynct.model.checkpoint import make_checkpoint
from asynct.ops.asynci_decode import asynci_decode_triton


def kernel_case(b, prefix, suffix_max, hq=8, hkv=4, d=128, bs=16, seed=0):
    """A paged cache where b sequences share `prefix` keys and own up to suffix_max more."""
    g = torch.Generator().manual_seed(seed)
    suffix = torch.randint(1, suffix_max + 1, (b,), generator=g)
    own = (suffix + bs - 1) // bs + 1
    nblk = prefix // bs + int(own.sum())
    cache = torch.randn(2, nblk, bs, hkv, d, generator=g).bfloat16().cuda()
    width = prefix // bs + int(own.max())
    table = torch.zeros(b, width, dtype=torch.int32)
    table[:, :prefix // bs] = torch.arange(prefix // bs, dtype=torch.int32)
    nxt = prefix // bs
    for i in range(b):
        table[i, prefix // bs:prefix // bs + own[i]] = torch.arange(nxt, nxt + int(own[i]), dtype=torch.int32)
        nxt += int(own[i])
    seq = (prefix + suffix).int().cuda()
    q = torch.randn(b, hq, d, generator=g).bfloat16().cuda()
    sigma = torch.randn(hq, generator=g).cuda()
    return q, cache, table.cuda(), seq, sigma


def time_us(fn, iters=50):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def kernel_rows():
    rows = []
    for b, prefix, suffix in ((224, 704, 400), (224, 2048, 400), (64, 704, 400), (16, 704, 400)):
        q, cache, table, seq, sigma = kernel_case(b, prefix, suffix)
        out = torch.empty_like(q)
        plen = torch.tensor([prefix], dtype=torch.int32, device="cuda")
        args = (q, cache, table, seq, sigma, 1 / 32, 3, True, out)
        hint = int(seq.max())
        off = time_us(lambda: asynci_decode_triton(*args, max_seq_len=hint))
        ref = out.float().clone()
        on = time_us(lambda: asynci_decode_triton(*args, max_seq_len=hint, prefix_len=plen))
        err = ((out.float() - ref).norm() / ref.norm()).item()
        rows.append((b, prefix, suffix, off, on, off / on, err))
    print("\n| batch | shared prefix | suffix <= | no cascade us | cascade us | speed-up | rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.2f}x | {r[6]:.1e} |")


def engine_rows(model, bw):
    rows, default = [], triton_backend.CASCADE_MIN_DECODES
    for label, threshold in (("no cascade", 1 << 30), ("cascade", default)):
        triton_backend.CASCADE_MIN_DECODES = threshold
        llm = LLM(str(model), gpu_memory_utilization=0.45)
        for name in ("gsm8k", "throughput"):
            reqs = workload(name, llm.llm_engine.config.vocab_size, 1.0)
            run_engine(llm, reqs[:8])
            res = run_engine(llm, reqs)
            batch = 256 if name == "throughput" else None
            roof = decode_roofline(res, llm, bw, batch, reqs)
            rows.append((label, name, res["wall_s"], res["output_tok_s"], roof))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    triton_backend.CASCADE_MIN_DECODES = default
    print("\n| engine | workload | wall s | output tok/s | step ms | roofline ms (shared prefix once) |")
    print("|---|---|---|---|---|---|")
    for label, name, wall, tps, roof in rows:
        print(f"| {label} | {name} | {wall:.2f} | {tps:.0f} | {roof['step_ms']:.2f} | {roof['roofline_ms']:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    model = a.model or make_checkpoint("bench-0.6b", "/tmp/bench-0.6b-cascade", tokenizer=False)
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    kernel_rows()
    engine_rows(model, bw)


if __name__ == "__main__":
    main()
