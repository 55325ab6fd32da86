"""Issue 13 lead: the decode's key splits added by relaxed fp32 atomics where they are made, and
o_proj reading the fp32 sum, against the engine's split partials + sum kernel + bf16 o_proj.
AsyncI's partials of disjoint key ranges simply add, so no split waits for another; the sum
kernel (one PDL boundary a layer) goes. The accumulators (one a layer, [B, Hq, D] fp32) are
zeroed by one memset at the step's start, the upper bound of what the engine could do.

    cd benchmarks && PYTHONPATH=.. python3 decode_atomic.py [--batches 1,2,4]  (the GEMV o_proj: up to 4 rows)

Prints us a layer of 35 layers' [QKV ->] decode -> o_proj chains in one CUDA graph (as
decode_chain.py), and the atomic sum's largest difference from the engine's output."""
import argparse

import torch
from decode_chain import CONTEXT, HQ, LAYERS, chain_inputs, decode, qkv
from kernel_bench import bench

from asynct.ops import fused_linear as fl
from asynct.ops._triton import jit, pdl_args, tl, triton, wait_for_prior
from asynct.ops.asynci_common import attend_keys, split_range
from asynct.ops.asynci_decode import BLOCK_N, num_splits
from asynct.ops.dyht import _param_stride


@jit
def _decode_atomic_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, sigma_ptr, acc_ptr, scale, sqb, sqh, sbt,
                          s_blk, s_tok, s_head, G, D: tl.constexpr, BS: tl.constexpr, M: tl.constexpr,
                          BLOCK_N: tl.constexpr, P: tl.constexpr, RELU: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    lo, hi, used, _ = split_range(seq_ptr, seq_ptr, b, split, tl.num_programs(2), BLOCK_N, False)
    wait_for_prior(PDL)
    g = tl.arange(0, M)
    gmask = g < G
    head = kvh * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + head[:, None] * sqh + d[None, :], mask=gmask[:, None], other=0.0)
    sigma = tl.load(sigma_ptr + head, mask=gmask, other=0.0)
    acc = attend_keys(q, sigma, k_ptr, v_ptr, bt_ptr + b.to(tl.int64) * sbt, sigma_ptr, kvh, lo, hi, scale,
                      s_blk, s_tok, s_head, D, BS, BLOCK_N, P, RELU, "tf32", False, False)
    dst = acc_ptr + (b.to(tl.int64) * tl.num_programs(1) * G + head[:, None]) * D + d[None, :]
    tl.atomic_add(dst, acc, mask=gmask[:, None] & (split < used), sem="relaxed")


def decode_atomic(t, layer, acc, max_len):
    b, hq, d = t.q.shape
    cache = layer["cache"]
    hkv = cache.shape[3]
    k, v = cache[0], cache[1]
    _decode_atomic_kernel[(b, hkv, num_splits(b, hkv, max_len))](
        t.q, k, v, layer["table"], layer["lens"], t.sigma, acc, d ** -0.5, t.q.stride(0), t.q.stride(1),
        layer["table"].stride(0), *k.stride()[:3], hq // hkv, D=d, BS=cache.shape[2],
        M=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_N=BLOCK_N, P=3, RELU=True, num_warps=4,
        num_stages=2, **pdl_args(t.q))


def o_proj_fp32(x, w, res, one):
    """linear_dyht_add_triton on an fp32 activation (its checks want x and the weight alike)."""
    (m, k), n = x.shape, w.shape[0]
    hidden, normed = torch.empty_like(res), torch.empty_like(res)
    strides = [_param_stride(one, n, s) for s in ("alpha", "weight", "post_alpha", "post_weight")]
    rows, plan = fl._plan(x, k, "dyht_add")
    tiles = triton.cdiv(n, rows)
    fl.linear_dyht_add_kernel[(tiles,)](x, x.stride(0), w, res, hidden, normed, one, one, one, one, m, k, n,
                                        *strides, HAS_POST=False, BLOCK_N=rows, **(plan or fl._tiles(x, k, tiles)))
    return hidden


def chain_us(b, max_len, with_qkv, atomic):
    t = chain_inputs(b)
    accs = torch.zeros(LAYERS, b, HQ, t.q.shape[2], device="cuda")

    def step():
        if atomic:
            accs.zero_()
        for i, layer in enumerate(t.stack):
            if with_qkv:
                qkv(t, layer)
            if atomic:
                decode_atomic(t, layer, accs[i], max_len)
                o_proj_fp32(accs[i].view(b, -1), layer["w_o"], t.x, t.one)
            else:
                decode(t, layer, max_len)
                fl.linear_dyht_add(t.out.view(b, -1), layer["w_o"], t.x, t.one, t.one)
    return bench([step]) / LAYERS * 1e6


def max_difference(b, max_len):
    t = chain_inputs(b)
    acc = torch.zeros(b, HQ, t.q.shape[2], device="cuda")
    decode(t, t.stack[0], max_len)
    decode_atomic(t, t.stack[0], acc, max_len)
    return (acc - t.out.float()).abs().max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4")
    a = ap.parse_args()
    print("batch | max_len | chain | sum kernel us | atomics us | ratio | max |diff|")
    for b in map(int, a.batches.split(",")):
        for max_len in (CONTEXT, 4096):
            diff = max_difference(b, max_len)
            for with_qkv in (False, True):
                name = ("qkv + " if with_qkv else "") + "decode + o_proj"
                base, new = (chain_us(b, max_len, with_qkv, atomic) for atomic in (False, True))
                print(f"{b} | {max_len} | {name} | {base:.2f} | {new:.2f} | {base / new:.3f} | {diff:.2e}",
                      flush=True)


if __name__ == "__main__":
    main()
