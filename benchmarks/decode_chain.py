"""Decode attention as a decode step runs it: 35 layers' chains of [fused QKV (+ KV store) ->]
decode attention [-> o_proj], one CUDA graph, programmatic dependent launch, bench-0.6b's heads,
context 384, each layer its own cache and weights. Prints microseconds a layer.

    PYTHONPATH=. python3 benchmarks/decode_chain.py now [--batches 1,8,32,64]

The kernels come from the `asynct` first on PYTHONPATH, so two commits compare in one run:
    mkdir -p /tmp/old && git archive <commit> asynct | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python3 benchmarks/decode_chain.py old; PYTHONPATH=. python3 benchmarks/decode_chain.py now
`max_len` is the host bound that sizes the split grid: 384 as eager steps pass it, 4,096 as a
CUDA graph captured for long contexts does (more splits than the context fills). Above 32 rows
(batch 64) the projections run unfused (cuBLAS + the elementwise ops), without the KV store."""
import argparse
import importlib
from types import SimpleNamespace

import torch
from kernel_bench import bench

from asynct.ops import fused_linear as fl
from asynct.ops.rope import rope_cos_sin_cache

dec = importlib.import_module("asynct.ops.asynci_decode")   # the module, not the function
HQ, HKV, D, BS, C, LAYERS, CONTEXT = 8, 4, 128, 16, 1024, 35, 384
BF = torch.bfloat16


def layers(b, gen):
    blocks = CONTEXT // BS + 1
    return [dict(cache=torch.randn(2, b * blocks, BS, HKV, D, device="cuda", dtype=BF, generator=gen),
                 table=torch.arange(b * blocks, dtype=torch.int32, device="cuda").view(b, blocks),
                 lens=torch.full((b,), CONTEXT, dtype=torch.int32, device="cuda"),
                 w_o=torch.randn(C, HQ * D, device="cuda", dtype=BF, generator=gen) * 0.02,
                 w_qkv=torch.randn((HQ + 2 * HKV) * D, C, device="cuda", dtype=BF, generator=gen) * 0.02)
            for _ in range(LAYERS)]


def chain_inputs(b):
    """A chain's layers and its step's tensors, batch b at CONTEXT keys (the last one this step's)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    stack = layers(b, gen)
    q = torch.randn(b, HQ, D, device="cuda", dtype=BF, generator=gen)
    x = torch.randn(b, C, device="cuda", dtype=BF, generator=gen)
    return SimpleNamespace(
        stack=stack, q=q, x=x, sigma=torch.randn(HQ, device="cuda", generator=gen), out=torch.empty_like(q),
        one=torch.ones(C, device="cuda", dtype=BF), ones=torch.ones(D, device="cuda"),
        cos_sin=rope_cos_sin_cache(D, 4096).cuda(), pos=torch.full((b,), CONTEXT - 1, device="cuda", dtype=torch.int64),
        slots=torch.arange(b, device="cuda") * (CONTEXT // BS + 1) * BS + CONTEXT - 1)


def qkv(t, layer):
    fl.linear_qk_norm_rope(t.x, layer["w_qkv"], t.pos, HQ, HKV, t.ones, t.ones, t.ones, t.ones, t.cos_sin,
                           layer["cache"], t.slots)


def decode(t, layer, max_len, **kw):
    dec.asynci_decode_triton(t.q, layer["cache"], layer["table"], layer["lens"], t.sigma, D ** -0.5, 3, True,
                             t.out, max_seq_len=max_len, **kw)


def chain_us(b, max_len, parts, **kw):
    """us a layer of the chain's `parts` (decode always; "qkv", "o"), decode launched with `kw`."""
    t = chain_inputs(b)

    def step():
        for layer in t.stack:
            if "qkv" in parts:
                qkv(t, layer)
            decode(t, layer, max_len, **kw)
            if "o" in parts:
                fl.linear_dyht_add(t.out.view(b, -1), layer["w_o"], t.x, t.one, t.one)
    return bench([step]) / LAYERS * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tag", help="a name for the package under test, printed on every row")
    ap.add_argument("--batches", default="1,8,16,32,64")
    a = ap.parse_args()
    print("tag | batch | max_len | chain | us a layer")
    for b in map(int, a.batches.split(",")):
        for parts in (("decode",), ("decode", "o"), ("qkv", "decode", "o")):
            for max_len in (CONTEXT, 4096):
                print(f"{a.tag} | {b} | {max_len} | {' + '.join(parts)} | {chain_us(b, max_len, parts):.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
