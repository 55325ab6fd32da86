"""A lead for steps of 65-1,024 rows: the projections split over K through cuBLAS's own batched
GEMM, their fp32 partials added by the elementwise kernel that follows anyway.

At 256 rows a bench-0.6b layer's four cuBLAS GEMMs take 26.8 us against ~6 us of weights and
~8 us of FLOPs (H200, benchmarks/RESULTS.md, thirtieth session); o_proj and down (1,024 columns)
took about as long at 96 rows as at 512: too few output tiles for 132 SMs, we think (16 at 128 x
128). `torch.bmm(x_chunks, W_chunks, out_dtype=fp32)` over
S slices of K multiplies S times the tiles with no custom GEMM and no copy (both operands are
strided views), and DyHT + residual add sums the S partials before it rounds, so the result
equals cuBLAS's up to the order of the fp32 adds. This script times, per projection and row
count: cuBLAS (+ the engine's dyht_add for o_proj / down) against split-K S (+ a prototype
dyht_add over the partials), each over several weight sets (HBM, not L2), in CUDA graphs.

    PYTHONPATH=. python3 benchmarks/splitk_linear.py [--rows 80,128,224,256,512,1024] [--splits 2,3,4,6,8]
"""
import argparse
import sys

import torch
import torch.nn.functional as F

from asynct import ops
from asynct.ops._triton import jit, tl, triton
from kernel_bench import bench, n_sets

BF = torch.bfloat16
# bench-0.6b: (name, N, K, consumer)
PROJECTIONS = (("qkv", 2048, 1024, None), ("o_proj", 1024, 1024, "post"), ("gate_up", 6144, 1024, None),
               ("down", 1024, 3072, "add"))


@jit(do_not_specialize=["T"])
def _sum_dyht_add_kernel(p_ptr, res_ptr, hid_ptr, out_ptr, a_ptr, w_ptr, pa_ptr, pw_ptr, T, C, S, sp,
                         HAS_POST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < T) & (cols[None, :] < C)
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    h = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for s in range(S):
        h += tl.load(p_ptr + s * sp + offs, mask=mask, other=0.0)
    h = h.to(hid_ptr.dtype.element_ty).to(tl.float32)    # cuBLAS's rounding of the product
    if HAS_POST:
        cm = cols < C
        h = tl.load(pw_ptr + cols, mask=cm)[None, :] * tl.minimum(tl.maximum(tl.load(pa_ptr + cols, mask=cm)[None, :] * h, -1.0), 1.0)
    h = (h + tl.load(res_ptr + offs, mask=mask).to(tl.float32)).to(hid_ptr.dtype.element_ty)
    tl.store(hid_ptr + offs, h, mask=mask)
    a = tl.load(a_ptr + cols, mask=cols < C)[None, :]
    n = tl.load(w_ptr + cols, mask=cols < C)[None, :] * tl.minimum(tl.maximum(a * h.to(tl.float32), -1.0), 1.0)
    tl.store(out_ptr + offs, n.to(out_ptr.dtype.element_ty), mask=mask)


def sum_dyht_add(p, res, a, w, pa=None, pw=None):
    s, t, c = p.shape
    hid, out = torch.empty_like(res), torch.empty_like(res)
    block_c, block_r = 1024, 8
    _sum_dyht_add_kernel[(triton.cdiv(t, block_r), triton.cdiv(c, block_c))](
        p, res, hid, out, a, w, a if pa is None else pa, w if pw is None else pw, t, c, s, p.stride(0),
        HAS_POST=pa is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8)
    return hid, out


def splitk(x, w, s):
    """[S, M, N] fp32 partials of x @ w.T over S slices of K: strided views, no copy."""
    (m, k), n = x.shape, w.shape[0]
    xs = x.view(m, s, k // s).transpose(0, 1)
    ws = w.view(n, s, k // s).permute(1, 2, 0)
    return torch.bmm(xs, ws, out_dtype=torch.float32)


def cases(name, n, k, consumer, m, splits):
    """(label, fns over the weight sets, check) for cuBLAS and each split."""
    sets = n_sets(n * k * 2)
    ws = [torch.randn(n, k, device="cuda", dtype=BF) / k ** 0.5 for _ in range(sets)]
    x = torch.randn(m, k, device="cuda", dtype=BF)
    res = torch.randn(m, n, device="cuda", dtype=BF)
    a, wt = torch.rand(n, device="cuda") + 0.5, torch.randn(n, device="cuda")
    post = (a, wt) if consumer == "post" else ()

    def plain(w):
        y = F.linear(x, w)
        return ops.dyht_add(y, res, a, wt, *post) if consumer else y

    def split(w, s):
        p = splitk(x, w, s)
        return sum_dyht_add(p, res, a, wt, *post) if consumer else p.sum(0).to(BF)
    yield "cuBLAS" + (" + dyht_add" if consumer else ""), [lambda w=w: plain(w) for w in ws], None
    want = plain(ws[0])
    for s in splits:
        if k % s:
            continue
        got = split(ws[0], s)
        err = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, want)) if consumer else \
            (got.float() - want.float()).abs().max().item()
        yield f"split-K {s}" + (" + sum dyht_add" if consumer else " + torch sum"), \
            [lambda w=w, s=s: split(w, s) for w in ws], err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="80,128,224,256,512,1024")
    ap.add_argument("--splits", default="2,3,4,6,8")
    a = ap.parse_args()
    splits = [int(s) for s in a.splits.split(",")]
    probe = torch.zeros(1, 16, 16, dtype=BF, device="cuda")
    try:
        torch.bmm(probe, probe, out_dtype=torch.float32)
    except (TypeError, RuntimeError) as e:
        sys.exit(f"this torch's bmm takes no out_dtype ({e}): split-K needs fp32 partials")
    table = []
    for name, n, k, consumer in PROJECTIONS:
        for m in (int(r) for r in a.rows.split(",")):
            base = None
            for label, fns, err in cases(name, n, k, consumer, m, splits):
                t = bench(fns) * 1e6
                base = base or t
                table.append((name, m, label, t, base / t, err))
                print(f"{name:8s} {m:5d} {label:28s} {t:7.2f} us  x{base / t:.2f}  err {err}", flush=True)
    print("\n| projection | rows | variant | us | cuBLAS / this | max err vs cuBLAS |")
    print("|---|---|---|---|---|---|")
    for name, m, label, t, ratio, err in table:
        print(f"| {name} | {m} | {label} | {t:.2f} | {ratio:.2f} | {'-' if err is None else f'{err:.2e}'} |")


if __name__ == "__main__":
    sys.exit(main())
