"""Decode-kernel launch configs on the batches the engine's graphs meet (bench-0.6b's attention:
8 q / 4 KV heads of 128, blocks of 16, pool 3, bf16): time per call from a CUDA graph of 20
calls, and the KV bandwidth it reaches against a device copy.

    PYTHONPATH=. python benchmarks/decode_sweep.py [--engine [--save OUT.pt]]

Shapes: gsm8k-shaped (224 seqs of 880-1010 keys, 688 shared: cascade), the same without
cascade, throughput-shaped (144 seqs of 200-2048 keys), dense 256 x 1024, and small batches.
--engine: the engine's config only (best of three timings), each shape without a shared prefix
also as the cascade variant with a prefix of 0, which every decode graph of 16+ sequences runs,
and with the rows longest first where the engine orders them (64+ rows); --save keeps its
outputs, for a bit-for-bit compare between two trees."""
import argparse
import itertools
import time

import torch

from asynct.attention.graph_inputs import longest_first
from asynct.attention.triton_backend import CASCADE_MIN_DECODES, DECODE_ORDER_MIN_ROWS
from asynct.ops.asynci_decode import asynci_decode_triton, num_splits

HQ, HKV, D, BS = 8, 4, 128, 16
# the sweep of 2026-12-01 (block_n 32/64 x warps 2/4 x stages 1-3) kept its best three; the
# last is the default
CONFIGS = [dict(block_n=32, num_warps=4, num_stages=2), dict(block_n=32, num_warps=2, num_stages=2),
           dict(block_n=64, num_warps=4, num_stages=2)]
DEFAULT = CONFIGS[2]
SHAPES = {   # name: (batch, min keys, max keys, shared prefix keys)
    "gsm8k-cascade": (224, 880, 1010, 688), "gsm8k-no-cascade": (224, 880, 1010, 0),
    "throughput": (144, 200, 2048, 0), "dense-256x1024": (256, 1024, 1024, 0),
    "b32x1024": (32, 1024, 1024, 0), "b8x1024": (8, 1024, 1024, 0), "b1x640": (1, 640, 640, 0),
}


def make_batch(b, lo, hi, shared, g):
    lens = torch.randint(lo, hi + 1, (b,), generator=g)
    width = (hi + BS - 1) // BS
    nshared = shared // BS
    blocks = nshared + b * (width - nshared)
    cache = (torch.randn(2, blocks, BS, HKV, D, generator=g) * 0.5).to(torch.bfloat16).cuda()
    table = torch.empty(b, width, dtype=torch.int32)
    table[:, :nshared] = torch.arange(nshared, dtype=torch.int32)
    table[:, nshared:] = nshared + torch.randperm(b * (width - nshared), generator=g).view(b, -1).int()
    q = (torch.randn(b, HQ, D, generator=g) * 0.5).to(torch.bfloat16).cuda()
    sigma = torch.randn(HQ, generator=g).cuda()
    kv_bytes = (shared + (lens - shared).clamp_min(0).sum().item() if shared else lens.sum().item())
    kv_bytes *= 2 * HKV * D * 2
    prefix = torch.tensor([shared], dtype=torch.int32).cuda() if shared else None
    return q, cache, table.cuda(), lens.int().cuda(), sigma, prefix, kv_bytes, hi


def time_call(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (5 * reps)


def copy_bw():
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = time_call(lambda: y.copy_(x), reps=10)
    return 2 * x.numel() / t


def engine_config(bw, save=None):
    g = torch.Generator().manual_seed(0)
    print("shape | variant | us | of copy BW")
    outs = {}
    for name, (b, lo, hi, shared) in SHAPES.items():
        q, cache, table, lens, sigma, prefix, kv_bytes, max_len = make_batch(b, lo, hi, shared, g)
        variants = {"cascade": prefix} if shared else {"plain": None}
        if not shared and b >= CASCADE_MIN_DECODES:
            variants["cascade, prefix 0"] = torch.zeros(1, dtype=torch.int32, device="cuda")
        order = None
        if b >= DECODE_ORDER_MIN_ROWS:
            order = torch.from_numpy(longest_first(lens.tolist(), b)).cuda()
            variants = {f"{v}, ordered": plen for v, plen in variants.items()}
        for variant, plen in variants.items():
            out = torch.empty_like(q)
            fn = lambda: asynci_decode_triton(q, cache, table, lens, sigma, 0.088, 3, True, out,  # noqa: E731
                                              max_seq_len=max_len, prefix_len=plen, order=order)
            t = min(time_call(fn) for _ in range(3))
            outs[name, variant] = out.cpu()
            print(f"{name} | {variant} | {t * 1e6:.1f} | {kv_bytes / t / bw:.2f}", flush=True)
    if save:
        torch.save(outs, save)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", action="store_true", help="the engine's config only, plain and cascade variants")
    ap.add_argument("--save", default=None, help="with --engine: a file for its outputs")
    a = ap.parse_args()
    bw = copy_bw()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    if a.engine:
        return engine_config(bw, a.save)
    g = torch.Generator().manual_seed(0)
    print("shape | config (pre: prefix-pass splits) | splits | us | of copy BW | max err vs default")
    for name, (b, lo, hi, shared) in SHAPES.items():
        q, cache, table, lens, sigma, prefix, kv_bytes, max_len = make_batch(b, lo, hi, shared, g)
        auto = num_splits(b, HKV, max_len)
        ref = torch.empty_like(q)
        asynci_decode_triton(q, cache, table, lens, sigma, 0.088, 3, True, ref, max_seq_len=max_len,
                             prefix_len=prefix)
        rows = []
        pre_splits = (None, 1, 2, 4) if shared else (None,)
        for cfg, mult, ps in itertools.product(CONFIGS, (1, 2, 4), pre_splits):
            out = torch.empty_like(q)
            s = min(auto * mult, 64)
            cfg = dict(cfg, prefix_splits=ps)
            fn = lambda: asynci_decode_triton(q, cache, table, lens, sigma, 0.088, 3, True, out,  # noqa: E731
                                              max_seq_len=max_len, prefix_len=prefix, splits=s, **cfg)
            try:
                t = time_call(fn)
            except Exception as e:  # a config that does not compile (shared memory) is skipped
                print(f"{name} | {cfg} | {s} | failed: {type(e).__name__}")
                continue
            err = (out.float() - ref.float()).abs().max().item()
            rows.append((t, cfg, s, err))
        rows.sort(key=lambda r: r[0])
        default = next(r for r in rows if r[1] == dict(DEFAULT, prefix_splits=None) and r[2] == auto)
        for t, cfg, s, err in rows[:5] + [default]:
            tag = " (default)" if (cfg, s) == default[1:3] else ""
            print(f"{name} | n{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']} "
                  f"pre{cfg['prefix_splits'] or 'auto'}{tag} | {s} | {t * 1e6:.1f} | {kv_bytes / t / bw:.2f} | "
                  f"{err:.1e}")


if __name__ == "__main__":
    main()
