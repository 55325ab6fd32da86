"""GEMMs of more rows than fused_linear's SMALL_M (prefill chunks, large decode steps) with the
elementwise op after them in their epilogue: gate/up + ReGLU, and o_proj / down_proj + residual
add + DyHT. cuBLAS and a separate elementwise kernel write the product to HBM and read it back
(gate/up's is twice ReGLU's output); here each program keeps its tile's fp32 accumulators and
finishes them itself (DyHT has no reduction), so the product is never stored nor rounded.

Tiles of BLOCK_M activation rows x BLOCK_N weight rows over K, in groups of GROUP_M row tiles so
that a group's programs share their weight tiles in L2. Rows past M and weight rows past N load
row M-1 / N-1 again (unmasked loads pipeline) and store nothing."""
import torch

from asynct.ops._triton import jit as _jit, tl, triton
from asynct.ops.dyht import _param_stride, output_buffer

GROUP_M = 8


@_jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row offsets, weight-row offsets), row tiles grouped for L2 reuse."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@_jit(do_not_specialize=["M"])
def _gemm_reglu_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sx, sw, so, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       PREC: tl.constexpr):
    """out[M, N] = relu(x @ gate.T) * (x @ up.T), gate = w[:N], up = w[N:]."""
    rm, rn = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * sx + rk[None, :]
    g_ptrs = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * sw + rk[None, :]
    up = N.to(tl.int64) * sw
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + rk) < K
        a = tl.load(a_ptrs + k0, mask=kmask[None, :], other=0.0)
        g = tl.load(g_ptrs + k0, mask=kmask[None, :], other=0.0)
        u = tl.load(g_ptrs + up + k0, mask=kmask[None, :], other=0.0)
        acc_g = tl.dot(a, tl.trans(g), acc_g, input_precision=PREC)
        acc_u = tl.dot(a, tl.trans(u), acc_u, input_precision=PREC)
    y = tl.maximum(acc_g, 0.0) * acc_u
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * so + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@_jit(do_not_specialize=["M"])
def _gemm_dyht_add_kernel(x_ptr, w_ptr, res_ptr, hid_ptr, out_ptr, a_ptr, dw_ptr, pa_ptr, pw_ptr, M, N, K,
                          sx, sw, sr, sa, sdw, spa, spw, HAS_POST: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          PREC: tl.constexpr):
    """hidden = [post DyHT of] x @ w.T + residual, and DyHT(hidden), both [M, N] contiguous;
    hidden may be the residual itself (each element is read before it is written)."""
    rm, rn = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * sx + rk[None, :]
    w_ptrs = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * sw + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + rk) < K
        a = tl.load(a_ptrs + k0, mask=kmask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=kmask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
    nmask = rn < N
    if HAS_POST:
        pa = tl.load(pa_ptr + rn * spa, mask=nmask, other=0.0).to(tl.float32)
        pw = tl.load(pw_ptr + rn * spw, mask=nmask, other=0.0).to(tl.float32)
        acc = pw[None, :] * tl.minimum(tl.maximum(pa[None, :] * acc, -1.0), 1.0)
    mask = (rm < M)[:, None] & nmask[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    res = tl.load(res_ptr + rm.to(tl.int64)[:, None] * sr + rn[None, :], mask=mask, other=0.0)
    hidden = (acc + res.to(tl.float32)).to(hid_ptr.dtype.element_ty)
    tl.store(hid_ptr + offs, hidden, mask=mask)
    alpha = tl.load(a_ptr + rn * sa, mask=nmask, other=0.0).to(tl.float32)
    weight = tl.load(dw_ptr + rn * sdw, mask=nmask, other=0.0).to(tl.float32)
    normed = weight[None, :] * tl.minimum(tl.maximum(alpha[None, :] * hidden.to(tl.float32), -1.0), 1.0)
    tl.store(out_ptr + offs, normed.to(out_ptr.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): benchmarks/fused_gemm.py's sweep on the H200
REGLU_CONFIG = (128, 64, 64, 8, 4)
DYHT_ADD_CONFIG = (128, 128, 64, 8, 4)


def _launch(cfg, m, n, x):
    bm, bn, bk, warps, stages = cfg
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    return grid, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, PREC=prec, num_warps=warps,
                      num_stages=stages)


def gemm_reglu(x, weight, config=None):
    """relu(x @ gate.T) * (x @ up.T) of the fused gate_up weight [2I, K]."""
    (m, k), i = x.shape, weight.shape[0] // 2
    out = torch.empty(m, i, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid, opts = _launch(config or REGLU_CONFIG, m, i, x)
    _gemm_reglu_kernel[grid](x, weight, out, m, i, k, x.stride(0), weight.stride(0), out.stride(0), **opts)
    return out


def gemm_dyht_add(x, weight, residual, alpha, dyht_weight, post_alpha=None, post_weight=None, out=None,
                  config=None):
    """(hidden, DyHT(hidden)) of hidden = [post DyHT of] x @ weight.T + residual (dyht_add's)."""
    (m, k), n = x.shape, weight.shape[0]
    hidden = output_buffer(out, residual.shape, residual.dtype, residual.device)
    normed = torch.empty_like(residual)
    if m == 0:
        return hidden, normed
    has_post = post_alpha is not None
    pa, pw = (post_alpha, post_weight) if has_post else (alpha, dyht_weight)
    strides = [_param_stride(p, n, s) for p, s in ((alpha, "alpha"), (dyht_weight, "weight"),
                                                    (pa, "post_alpha"), (pw, "post_weight"))]
    grid, opts = _launch(config or DYHT_ADD_CONFIG, m, n, x)
    _gemm_dyht_add_kernel[grid](x, weight, residual, hidden, normed, alpha, dyht_weight, pa, pw, m, n, k,
                                x.stride(0), weight.stride(0), residual.stride(0), *strides,
                                HAS_POST=has_post, **opts)
    return hidden, normed
