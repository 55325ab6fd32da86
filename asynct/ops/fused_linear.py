"""Decode-sized linear layers (at most SMALL_M rows) with the elementwise op after them fused into
their epilogue: QKV + q/k DyHT + RoPE, gate/up + ReGLU, o_proj and down_proj + residual add +
DyHT. At batch 1-32 a decode step is bound by launches and ramp-ups, not bytes: ~11 kernels a
layer (cuBLAS added a split-K reduction to two of them) become 4 plus attention. DyHT has no
reduction, so a program that owns a tile of output columns can finish it alone.

The kernels are in fused_linear_kernels.py, what they take in fused_linear_checks.py; this module
plans and launches them.

Each op's `*_unfused` twin is the composition of the ops it fuses (their own dispatch: Triton on
CUDA, torch references elsewhere): the test reference, and the path of CPUs and larger batches."""
import torch
import torch.nn.functional as F

from asynct.ops._triton import cdiv, next_power_of_2, pdl_args, triton
from asynct.ops.asynci_common import scale_args, sm_count
from asynct.ops.dyht import _param_stride, dyht_add, output_buffer
from asynct.ops.fused_linear_checks import (SMALL_M, cache_problem, check, head_dim_problem,  # noqa: F401
                                            operands_problem, residual_problem, sums_problem)
from asynct.ops.fused_linear_kernels import gate_up_reglu_kernel, linear_dyht_add_kernel, qkv_rope_kernel
from asynct.ops.kv_cache import check_kv_cache
from asynct.ops.reglu import reglu
from asynct.ops.rope import qk_norm_rope, qk_norm_rope_to_cache

L2_PREFETCH = True  # off only for the same-run peer of benchmarks/small_batch.py
HALF_TILE = 8       # paired programs: 8 rows of each half, one 16-row tile
TILE_N = 16         # unpaired programs: 16 weight rows (the smallest tl.dot operand)
# The CUDA-core path (GEMV) where it beat the tl.dot kernels (H200, bench-0.6b's shapes, the best
# of 50 configs, then in whole steps; benchmarks/RESULTS.md): (weight rows a program, K tile,
# warps), the first and last at 1, 2, ... activation rows: as many rows as it serves. QKV at 3-4
# rows with 4 weight rows, not 8: batch-3/4 steps 1.02-1.045x faster in two runs (1 and 2 rows:
# 1.04-1.05x slower; RESULTS.md, eighteenth session). At 5-8 rows a GEMV (one 8-row kernel) made
# steps 1.10-1.11x slower than the dot tiles: not kept. gate/up loses at two rows
# (0.95x as an op); QKV ran batch-1 steps 1.01x faster at 4 warps, batch-2 ones 1.04x at 8.
# At 3-4 rows (untuned warps) o_proj/down off their dot tiles took batch-4 steps from 1.066 to
# 0.998 ms (with a since-reverted argmax in the run); QKV's and the joined reduction 1.01-1.02x.
# A fourth element caps a thread's registers at each row count, where the whole K (<= 1,024) is
# one tile: gate/up's one-row programs take 48 at will, so 10 fit an SM and bench-0.6b's 1,536
# ran in two waves; at 40, 12 fit, all in one (batch-1 steps 1.012-1.014x faster, three processes,
# both orders; RESULTS.md). The cap holds for this config only: K 2,048 spills 266 bytes, 8 rows
# or 2 warps 4-286 (sm_90 compiles, benchmarks/compile_report.py's method).
GEMV = {"qkv": ((8, 8, 4, 4), 512, (4, 8, 8, 8)), "reglu": ((4,), 1024, (4,), (40,)),
        "dyht_add": ((2,) * 4, 1024, (4, 4, 4, 4))}
GEMV_MAX_ROWS = 4   # the kernel keeps one accumulator a row (one 3-D one lost: RESULTS.md)
# Past two rows only up to this K: four accumulators of a wider K spill (sm_90: down at K 11,008
# 92 B, at 14,336 766 B a thread), measured at bench-0.6b's K of 1,024-3,072 only
GEMV_WIDE_ROWS_MAX_K = 8192
# Weights a GEMV program may load as one K tile, before its PDL wait (_gemv_rows): 16 KB of
# bf16, 64 fp32 registers a thread at 4 warps. Past it (K > 1,024 at 8 weight rows, > 4,096 at
# 2), K tiles after the wait.
GEMV_EARLY_ELEMENTS = 8192


def linear_qk_norm_rope_unfused(x, weight, positions, num_heads, num_kv_heads, q_alpha, q_weight,
                                k_alpha, k_weight, cos_sin_cache, kv_cache=None, slot_mapping=None,
                                k_scale=None, v_scale=None, out=None):
    """`out` (qkv [T, rows], q, k buffers): the projection, q and k go there (v is a view of qkv).
    Given the cache, k and v go there instead (qk_norm_rope_to_cache) and come back None."""
    qkv = F.linear(x, weight) if out is None else torch.mm(x, weight.t(), out=_qkv_buffer(out[0], x, weight))
    t, d = x.shape[0], cos_sin_cache.shape[-1]
    nq, nk = num_heads * d, num_kv_heads * d
    q, k = qkv[:, :nq].view(t, num_heads, d), qkv[:, nq:nq + nk].view(t, num_kv_heads, d)
    v = qkv[:, nq + nk:].view(t, num_kv_heads, d)
    norms = (q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache)
    if kv_cache is not None:
        q = qk_norm_rope_to_cache(q, k, v, positions, *norms, kv_cache, slot_mapping, k_scale, v_scale,
                                  None if out is None else out[1])
        return q, None, None
    q, k = qk_norm_rope(q, k, positions, *norms, None if out is None else out[1:])
    return q, k, v


def _qkv_buffer(buf, x, weight):
    return output_buffer(buf, (x.shape[0], weight.shape[0]), x.dtype, x.device, "qkv out")


def linear_reglu_unfused(x, weight):
    return reglu(F.linear(x, weight))


def linear_dyht_add_unfused(x, weight, residual, alpha, dyht_weight, post_alpha=None, post_weight=None,
                            out=None):
    if x.dtype != weight.dtype:     # fp32 sums beside 16-bit weights: the product rounded as the kernel's
        y = F.linear(x.float(), weight.float()).to(weight.dtype)
    else:
        y = F.linear(x, weight)
    return dyht_add(y, residual, alpha, dyht_weight, post_alpha, post_weight, out)


ROW_TILES = (16, 32, 64)


def row_tile(m: int) -> int:
    """Activation rows a program's tile holds (BLOCK_M): the smallest of ROW_TILES that holds m
    (16: the smallest tl.dot operand). Each program reads the whole activation tile beside its
    weight rows, so a tile past the batch costs L2 traffic and shared memory at every program.
    The 64-row tile (33-64 rows) made decode steps of 40-64 sequences 1.13x faster than cuBLAS
    and the unfused elementwise kernels; a 128-wide K tile for it (80 KB of shared memory a
    program, not 120) 1.02-1.06x slower than 256 (H200, bench-0.6b, benchmarks/RESULTS.md)."""
    return next(t for t in ROW_TILES if m <= t)


def _tiles(x, k, tiles):
    """(BLOCK_M, BLOCK_K, EVEN_K, PRECISION, LINES: 128-byte lines of each weight row and K tile
    to prefetch into L2 before the PDL wait) and the launch options for `tiles` programs over a
    K-wide stream. Fewer programs than SMs (a 1,024-column projection: 64) each keep more bytes
    in flight (H200, benchmarks/small_batch.py --sweep: o_proj 4.1 -> 3.9 us, down 7.5 -> 6.7);
    more tiles than SMs (gate/up: 384) run best as 2-warp programs (7.0 -> 6.2 us).
    Splitting K over more programs instead, summed in a workspace, cost more than it gained
    (o_proj 5.8 us, down 7.9 us: benchmarks/RESULTS.md)."""
    sms = sm_count(x)
    block_m = row_tile(x.shape[0])
    wide = tiles < sms and k >= 1024 and x.element_size() <= 2 and block_m == 16  # 3 x 32 KiB of shared memory
    block_k = 512 if wide else 256
    block_k = max(16, min(block_k, next_power_of_2(k)))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    pdl = pdl_args(x)
    # only where every program starts in the first wave: QKV and o_proj 1.03-1.16x faster ops at
    # 1-32 rows; down loses as an op past 8 rows (0.90x at 24-32) but steps gain: without its
    # prefetch they ran 1.08x slower at 24-32 sequences, 1.01-1.02x at 1 and 16 (RESULTS.md);
    # gate/up's 384 programs 1.03-1.08x slower
    lines = max(1, block_k * x.element_size() // 128) if pdl["PDL"] and L2_PREFETCH and tiles < sms else 0
    # stages of activation + weight tiles within 128 KiB of shared memory (fp32 at 32 rows: 2)
    stages = min(3 if block_k == 512 else 4, (128 << 10) // ((block_m + TILE_N) * block_k * x.element_size()))
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, EVEN_K=k % block_k == 0, PRECISION=precision,
                num_warps=4 if tiles < sms else 2, num_stages=stages, LINES=lines, GEMV=False, **pdl)


def _half(rows, plan):
    """A paired op's rows of each half a program: half its GEMV rows, or HALF_TILE (benchmarks set it)."""
    return rows // 2 if plan else HALF_TILE


def _plan(x, k, op):
    """(weight rows a program, launch options) of `op` (a GEMV key) over a K-wide stream: the
    CUDA-core path for as few rows as it wins at, else 16-row dot tiles (_tiles, which needs
    the program count: the caller's). The GEMV takes one K tile where its rows fit
    GEMV_EARLY_ELEMENTS, else the table's."""
    rows, block_k, warps, *caps = GEMV[op]
    m = x.shape[0]
    if m > min(len(warps), GEMV_MAX_ROWS) or (m > 2 and k > GEMV_WIDE_ROWS_MAX_K):
        return TILE_N, None
    rows = rows[m - 1]
    whole = next_power_of_2(k)
    # the kernel loads before its wait whenever one tile holds K: past the budget, two at least
    block_k = whole if rows * whole <= GEMV_EARLY_ELEMENTS else min(block_k, whole // 2)
    cap = {"maxnreg": caps[0][m - 1]} if caps and caps[0][m - 1] and block_k == k <= 1024 else {}
    return rows, dict(BLOCK_M=next_power_of_2(m), BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                      PRECISION="ieee", num_warps=warps[m - 1], num_stages=1, LINES=0, GEMV=True, **cap,
                      **pdl_args(x))


def linear_qk_norm_rope_triton(x, weight, positions, num_heads, num_kv_heads, q_alpha, q_weight,
                               k_alpha, k_weight, cos_sin_cache, kv_cache=None, slot_mapping=None,
                               k_scale=None, v_scale=None, attn_sums=None, out=None):
    """`out` (qkv, q, k buffers, as the unfused op's): q and, unless the cache takes it, k go there."""
    d = cos_sin_cache.shape[-1]
    check(operands_problem(x, weight), head_dim_problem(d, 2 * HALF_TILE))
    if weight.shape[0] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"qkv weight has {weight.shape[0]} rows, the heads want "
                         f"{(num_heads + 2 * num_kv_heads) * d}")
    t, k = x.shape
    if positions.shape != (t,) or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError(f"positions must be ({t},) and cos_sin_cache contiguous fp32, got "
                         f"{tuple(positions.shape)} and {cos_sin_cache.dtype}")
    q = output_buffer(out and out[1], (t, num_heads, d), x.dtype, x.device, "q out")
    strides = [_param_stride(p, d, n) for p, n in ((q_alpha, "q_alpha"), (q_weight, "q_weight"),
                                                    (k_alpha, "k_alpha"), (k_weight, "k_weight"))]
    write = kv_cache is not None
    if write:
        check_kv_cache(kv_cache)
        check(cache_problem(kv_cache, slot_mapping, x, num_kv_heads, d))
        ks, vs, fp8 = scale_args(kv_cache, k_scale, v_scale, q_alpha)
        k_out = v = None
        outs = (q, q)       # stand-ins, never written: k and v go to the cache
        cache = (kv_cache[0], kv_cache[1], slot_mapping, ks, vs, *kv_cache[0].stride()[:3])
        bs = kv_cache.shape[2]
    else:
        k_out = output_buffer(out and out[2], (t, num_kv_heads, d), x.dtype, x.device, "k out")
        v = torch.empty_like(k_out)
        outs = (k_out, v)
        cache, bs, fp8 = (q, q, positions, q_alpha, q_alpha, 0, 0, 0), 1, False   # stand-ins, never read
    check(sums_problem(attn_sums, q))
    zero = attn_sums is not None
    rows, plan = _plan(x, k, "qkv")
    hb = _half(rows, plan)
    tiles = (num_heads + 2 * num_kv_heads) * d // (2 * hb)
    qkv_rope_kernel[(tiles,)](x, x.stride(0), weight, q, *outs, positions, cos_sin_cache, t, k, num_heads,
                               num_kv_heads, q_alpha, q_weight, k_alpha, k_weight, *strides, *cache,
                               attn_sums if zero else q, HALF=d // 2, HB=hb, WRITE_KV=write, BS=bs, FP8=fp8,
                               ZERO_SUMS=zero, **(plan or _tiles(x, k, tiles)))
    return q, k_out, v


def linear_reglu_triton(x, weight):
    check(operands_problem(x, weight))
    if weight.shape[0] % 2:
        raise ValueError(f"gate_up weight needs an even row count, got {weight.shape[0]}")
    (t, k), i = x.shape, weight.shape[0] // 2
    out = torch.empty(t, i, dtype=x.dtype, device=x.device)
    rows, plan = _plan(x, k, "reglu")
    hb = _half(rows, plan)
    tiles = cdiv(i, hb)
    gate_up_reglu_kernel[(tiles,)](x, x.stride(0), weight, out, t, k, i, HB=hb, **(plan or _tiles(x, k, tiles)))
    return out


def linear_dyht_add_triton(x, weight, residual, alpha, dyht_weight, post_alpha=None, post_weight=None, out=None):
    check(operands_problem(x, weight, _gemv_takes_fp32(x, weight)), residual_problem(residual, x, weight))
    (t, k), n = x.shape, weight.shape[0]
    if (post_alpha is None) != (post_weight is None):
        raise ValueError("post_alpha and post_weight go together")
    hidden = output_buffer(out, residual.shape, residual.dtype, residual.device)
    normed = torch.empty_like(residual)
    has_post = post_alpha is not None
    pa, pw = (post_alpha, post_weight) if has_post else (alpha, dyht_weight)
    strides = [_param_stride(p, n, s) for p, s in ((alpha, "alpha"), (dyht_weight, "weight"),
                                                    (pa, "post_alpha"), (pw, "post_weight"))]
    rows, plan = _plan(x, k, "dyht_add")
    tiles = cdiv(n, rows)
    linear_dyht_add_kernel[(tiles,)](
        x, x.stride(0), weight, residual, hidden, normed, alpha, dyht_weight, pa, pw, t, k, n,
        *strides, HAS_POST=has_post, BLOCK_N=rows, **(plan or _tiles(x, k, tiles)))
    return hidden, normed


def _gemv_takes_fp32(x, weight) -> bool:
    """Whether o_proj's CUDA-core path takes this x as fp32 beside 16-bit weights (the decode's
    fp32 sums, attention/triton_backend.py): it rounds each dot product to the weights' dtype,
    as the dot tiles (which want both operands alike) round theirs to the activation's."""
    return (x.dtype == torch.float32 and weight.element_size() == 2 and x.dim() == 2
            and 0 < x.shape[0] <= SMALL_M and _plan(x, x.shape[1], "dyht_add")[1] is not None)


def _fast(x, weight, fp32_x=False) -> bool:
    """The fused kernels serve decode-sized CUDA batches; the rest runs the unfused ops."""
    return x.is_cuda and triton is not None and operands_problem(x, weight, fp32_x) is None


def linear_qk_norm_rope(x, weight, positions, num_heads, num_kv_heads, q_alpha, q_weight, k_alpha,
                        k_weight, cos_sin_cache, kv_cache=None, slot_mapping=None, k_scale=None,
                        v_scale=None, attn_sums=None, out=None):
    """q, k, v [T, H, D] of `x @ weight.T` (the fused QKV projection), q and k DyHT-normed and
    rotated (NeoX RoPE over the whole head). Given the paged cache and the tokens' slots, k and v
    go there and come back None: the fused kernel stores them itself, the unfused path's q/k
    kernel does (qk_norm_rope_to_cache; one kernel fewer a layer either way). Without a cache
    (or with one that does not fit) k and v come back for the attention backend to store.
    `positions` and `slot_mapping` must not be written by the kernel launched just before this
    call (host-written step inputs are not): with programmatic dependent launch the fused kernel
    reads them, and their cos/sin, while that kernel still runs.
    `attn_sums` (fp32, q's shape) comes back zeroed, for a decode that adds into it: the fused
    kernel zeroes it after its wait for the kernel before, with no launch of its own.
    `out` (qkv [T, rows], q, k: contiguous buffers, a piecewise graph's static ones) is where the
    results go where the path can put them (the unfused path's v is a view of qkv; the fused
    kernel's v is its own): a caller that needs them there copies only what is elsewhere."""
    args = (x, weight, positions, num_heads, num_kv_heads, q_alpha, q_weight, k_alpha, k_weight,
            cos_sin_cache)
    d = cos_sin_cache.shape[-1]
    fits = kv_cache is not None and cache_problem(kv_cache, slot_mapping, x, num_kv_heads, d) is None
    target = (kv_cache, slot_mapping, k_scale, v_scale) if fits else (None,) * 4
    if not (_fast(x, weight) and head_dim_problem(d, 2 * HALF_TILE) is None):
        if attn_sums is not None:
            attn_sums.zero_()
        return linear_qk_norm_rope_unfused(*args, *target, out=out)
    return linear_qk_norm_rope_triton(*args, *target, attn_sums=attn_sums, out=out)


def linear_reglu(x, weight):
    """relu(gate) * up of `x @ weight.T` (weight = [gate; up])."""
    fn = linear_reglu_triton if _fast(x, weight) and weight.shape[0] % 2 == 0 else linear_reglu_unfused
    return fn(x, weight)


def linear_dyht_add(x, weight, residual, alpha, dyht_weight, post_alpha=None, post_weight=None, out=None):
    """dyht_add(x @ weight.T, residual, ...): (hidden, its DyHT), as ops.dyht_add returns them.
    x may be fp32 beside 16-bit weights (the decode's sums): the product is rounded to the weights'
    dtype. The hidden goes into `out` where given (contiguous, residual's shape)."""
    fast = _fast(x, weight, _gemv_takes_fp32(x, weight)) and residual_problem(residual, x, weight) is None
    fn = linear_dyht_add_triton if fast else linear_dyht_add_unfused
    return fn(x, weight, residual, alpha, dyht_weight, post_alpha, post_weight, out)
