"""Issue 13: the decode's key splits added into fp32 sums by relaxed atomics (asynci_decode's
`accumulate`: the engine's decode steps of up to DECODE_SUMS_MAX_ROWS sequences), against split
partials + a sum kernel + o_proj on bf16, in decode_chain.py's 35-layer chains of QKV -> decode
-> o_proj in one CUDA graph. With the sums, the QKV kernel zeroes them after its PDL wait (no
launch of its own) and o_proj's CUDA-core path reads them in fp32: one kernel boundary fewer a
layer. AsyncI's partials of disjoint key ranges simply add, so no split waits for another.

    cd benchmarks && PYTHONPATH=.. python3 decode_atomic.py [--batches 1,2,3,4]

Prints us a layer, both variants in one process, and the largest difference of the sums from
the engine's bf16 attention output (one layer), relative to its largest value: bf16's rounding."""
import argparse

import torch
from decode_chain import CONTEXT, D, HKV, HQ, LAYERS, chain_inputs
from kernel_bench import bench

from asynct.ops import fused_linear as fl
from asynct.ops.asynci_decode import asynci_decode_triton


def layer_chain(t, layer, max_len, sums):
    """One layer's QKV -> decode -> o_proj; `sums` (fp32) or None: the split partials' path."""
    fl.linear_qk_norm_rope(t.x, layer["w_qkv"], t.pos, HQ, HKV, t.ones, t.ones, t.ones, t.ones, t.cos_sin,
                           layer["cache"], t.slots, attn_sums=sums)
    out = t.out if sums is None else sums
    asynci_decode_triton(t.q, layer["cache"], layer["table"], layer["lens"], t.sigma, D ** -0.5, 3, True, out,
                         max_seq_len=max_len, accumulate=sums is not None)
    return fl.linear_dyht_add(out.view(out.shape[0], -1), layer["w_o"], t.x, t.one, t.one)


def chain_us(b, max_len, with_sums):
    t = chain_inputs(b)
    sums = torch.zeros(b, HQ, D, device="cuda") if with_sums else None

    def step():
        for layer in t.stack:
            layer_chain(t, layer, max_len, sums)
    return bench([step]) / LAYERS * 1e6


def max_difference(b, max_len):
    t = chain_inputs(b)
    sums = torch.zeros(b, HQ, D, device="cuda")
    layer_chain(t, t.stack[0], max_len, None)
    layer_chain(t, t.stack[0], max_len, sums)
    return ((sums - t.out.float()).abs().max() / sums.abs().max()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,3,4")
    a = ap.parse_args()
    print("batch | max_len | split partials + sum us a layer | fp32 sums us a layer | ratio | max |diff| / max")
    for b in map(int, a.batches.split(",")):
        for max_len in (CONTEXT, 4096):
            diff = max_difference(b, max_len)
            base, new = chain_us(b, max_len, False), chain_us(b, max_len, True)
            print(f"{b} | {max_len} | {base:.2f} | {new:.2f} | {base / new:.3f} | {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
