"""Ablation (benchmarks/RESULTS.md, fourteenth session): batch-1 decode attention's split sum
done by its reader, o_proj's GEMV, instead of a kernel of its own (dropped: it wins at 6 used
splits and loses from 16), beside the sum kernel with its loads one at a time and eight at a time
(kept). QKV + decode + o_proj chains as decode_chain.py builds them, us a layer, and the largest
difference of o_proj's outputs from main's.

    PYTHONPATH=. python3 benchmarks/split_sum_reader.py"""
import importlib

import decode_chain as dc
import torch
import triton.language as tl
from kernel_bench import bench

from asynct.ops import asynci_common as ac
from asynct.ops import fused_linear as fl
from asynct.ops._triton import jit, pdl_args, wait_for_prior
from asynct.ops.asynci_common import split_partials, split_range

dec = importlib.import_module("asynct.ops.asynci_decode")
HQ, D, C = dc.HQ, dc.D, dc.C


@jit(do_not_specialize=["S"])
def oproj_partials_kernel(mid_ptr, seq_ptr, S, w_ptr, res_ptr, hid_ptr, out_ptr, a_ptr, dw_ptr,
                          K: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
                          SC: tl.constexpr, PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, K)
    w = tl.load(w_ptr + cols[:, None] * K + kk[None, :]).to(tl.float32)
    _, _, used, _ = split_range(seq_ptr, seq_ptr, 0, 0, S, SPLIT_N, False)    # batch 1: sequence 0
    wait_for_prior(PDL)
    base = mid_ptr + (kk // D) * S * D + kk % D
    x = tl.zeros([K], dtype=tl.float32)
    for c in range(tl.cdiv(used, SC)):
        for j in tl.static_range(SC):
            x += tl.load(base + (c * SC + j) * D, mask=c * SC + j < used, other=0.0)
    x = x.to(tl.bfloat16).to(tl.float32)
    h = tl.sum(w * x[None, :], axis=1).to(tl.bfloat16).to(tl.float32)
    h = (h + tl.load(res_ptr + cols).to(tl.float32)).to(tl.bfloat16)
    tl.store(hid_ptr + cols, h)
    a = tl.load(a_ptr + cols).to(tl.float32)
    dw = tl.load(dw_ptr + cols).to(tl.float32)
    n = dw * tl.minimum(tl.maximum(a * h.to(tl.float32), -1.0), 1.0)
    tl.store(out_ptr + cols, n.to(tl.bfloat16))


@jit(do_not_specialize=["S", "S_PRE"])
def sum_one_at_a_time_kernel(mid_ptr, out_ptr, seq_ptr, plen_ptr, pre_ptr, sob, soh, S, S_PRE, D: tl.constexpr,
                        BLOCK_N: tl.constexpr, CASCADE: tl.constexpr, PDL: tl.constexpr):
    row, used, _ = split_partials(mid_ptr, seq_ptr, plen_ptr, S, D, BLOCK_N, CASCADE)
    wait_for_prior(PDL)
    acc = tl.zeros([D], dtype=tl.float32)
    for s in range(used):       # the sum kernel before 4c94361
        acc += tl.load(row + s * D)
    dst = out_ptr + tl.program_id(0).to(tl.int64) * sob + tl.program_id(1) * soh + tl.arange(0, D)
    tl.store(dst, acc.to(out_ptr.dtype.element_ty))


ORIG_SUM = ac._sum_splits_kernel
PARTIALS = {}


def keep_partials(dst, out, splits, lens):
    PARTIALS["dst"], PARTIALS["splits"] = dst, splits
    return out


def chain_us(b, context, max_len, variant, rows=8):
    dc.CONTEXT = context
    t = dc.chain_inputs(b)
    outs = [(torch.empty_like(t.x), torch.empty_like(t.x)) for _ in t.stack]
    results = []
    ac._sum_splits_kernel = sum_one_at_a_time_kernel if variant == "one at a time" else ORIG_SUM
    dec.sum_splits = keep_partials if variant == "reader" else ac.sum_splits

    def step():
        results.clear()
        for layer, (hid, nrm) in zip(t.stack, outs):
            dc.qkv(t, layer)
            dc.decode(t, layer, max_len)
            if variant == "reader" and PARTIALS["splits"] > 1:
                s = PARTIALS["splits"]
                oproj_partials_kernel[(C // rows,)](PARTIALS["dst"], layer["lens"], s, layer["w_o"], t.x, hid, nrm,
                                                    t.one, t.one, K=HQ * D, D=D, BLOCK_N=rows, SPLIT_N=64, SC=8,
                                                    num_warps=4, **pdl_args(t.x))
                results.append((hid, nrm))
            else:
                results.append(fl.linear_dyht_add(t.out.view(b, -1), layer["w_o"], t.x, t.one, t.one))
    t = bench([step]) / dc.LAYERS * 1e6
    step()
    torch.cuda.synchronize()
    res = [tuple(r.clone() for r in pair) for pair in results[:2]]
    ac._sum_splits_kernel = ORIG_SUM
    dec.sum_splits = ac.sum_splits
    return t, res


def main():
    print("batch | context | max_len | variant | us a layer | max diff vs main")
    for context in (384, 1024, 2048):
        for max_len in (context, 4096):
            base_t, base_r = chain_us(1, context, max_len, "main")
            print(f"1 | {context} | {max_len} | main | {base_t:.2f} |", flush=True)
            for variant, rows in (("one at a time", 2), ("reader", 2), ("reader", 8)):
                t, r = chain_us(1, context, max_len, variant, rows)
                diff = max((a.float() - b_.float()).abs().max().item() for pa, pb in zip(r, base_r)
                           for a, b_ in zip(pa, pb))
                name = f"{variant}, {rows} rows a program" if variant == "reader" else f"sum {variant}"
                print(f"1 | {context} | {max_len} | {name} | {t:.2f} | {diff:.3g}", flush=True)
            t2, _ = chain_us(1, context, max_len, "main")
            print(f"1 | {context} | {max_len} | main again | {t2:.2f} |", flush=True)


if __name__ == "__main__":
    main()
