"""Decode-sized linear layers (at most SMALL_M rows) with the elementwise op after them fused into
their epilogue: QKV + q/k DyHT + RoPE, gate/up + ReGLU, o_proj and down_proj + residual add +
DyHT. At batch 1-16 a decode step is bound by launches and ramp-ups, not bytes: ~11 kernels a
layer (cuBLAS added a split-K reduction to two of them) become 4 plus attention. DyHT has no
reduction, so a program that owns a tile of output columns can finish it alone.

Every program streams 16 weight rows (a 16-row dot with the <= 16 activation rows); RoPE and
ReGLU pair rows that are far apart (d and d + head_dim/2, gate j and up j), so their programs
load the two halves as one 16-row tile and split the accumulator. The accumulator is rounded
to the activation dtype before the epilogue, as the unfused ops receive it.

Each op's `*_unfused` twin is the composition of the ops it fuses (their own dispatch: Triton on
CUDA, torch references elsewhere): the test reference, and the path of CPUs and larger batches."""
import torch
import torch.nn.functional as F

from asynct.ops._triton import jit as _jit, pdl_args, prefetch_l2, tl, triton, wait_for_prior
from asynct.ops.asynci_decode import _sm_count, scale_args
from asynct.ops.dyht import _param_stride, dyht_add
from asynct.ops.kv_cache import check_kv_cache, store_cache_rows
from asynct.ops.reglu import reglu
from asynct.ops.rope import qk_norm_rope

SMALL_M = 16
L2_PREFETCH = True  # off only for the same-run peer of benchmarks/small_batch.py
HALF_TILE = 8       # paired programs: 8 rows of each half, one 16-row tile
TILE_N = 16         # unpaired programs: 16 weight rows (the smallest tl.dot operand)


def linear_qk_norm_rope_unfused(x, weight, positions, num_heads, num_kv_heads, q_alpha, q_weight,
                                k_alpha, k_weight, cos_sin_cache):
    qkv = F.linear(x, weight)
    t, d = x.shape[0], cos_sin_cache.shape[-1]
    nq, nk = num_heads * d, num_kv_heads * d
    q, k = qkv[:, :nq].view(t, num_heads, d), qkv[:, nq:nq + nk].view(t, num_kv_heads, d)
    q, k = qk_norm_rope(q, k, positions, q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache)
    return q, k, qkv[:, nq + nk:].view(t, num_kv_heads, d)


def linear_reglu_unfused(x, weight):
    return reglu(F.linear(x, weight))


def linear_dyht_add_unfused(x, weight, residual, alpha, dyht_weight, post_alpha=None, post_weight=None):
    return dyht_add(F.linear(x, weight), residual, alpha, dyht_weight, post_alpha, post_weight)


@_jit
def _dot_rows(x_ptr, sx, M, w_ptr, rows, rmask, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
              LINES: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = x[:M] @ w[rows].T, rounded to x's dtype. Before the wait for the
    kernel before (PDL), the program asks L2 for its weight rows, LINES 128-byte lines per row
    and K tile (0: no prefetch). Loading them into registers instead lost: all of K (<= 1,024)
    made decode steps 1.15x slower, the first K tile gained nothing. benchmarks/RESULTS.md."""
    m = tl.arange(0, BLOCK_M)[:, None]
    xp = x_ptr + m * sx
    wp = w_ptr + rows.to(tl.int64)[:, None] * K
    if LINES > 0:
        base = w_ptr + tl.where(rmask, rows, 0).to(tl.int64)[:, None] * K
        line = tl.arange(0, LINES)[None, :] * (BLOCK_K // LINES)
        for k0 in range(0, K, BLOCK_K):
            prefetch_l2(base + tl.minimum(k0 + line, K - 1))
    wait_for_prior(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)[None, :]
        if EVEN_K:
            x = tl.load(xp + kk, mask=m < M, other=0.0)
            w = tl.load(wp + kk, mask=rmask[:, None], other=0.0)
        else:
            x = tl.load(xp + kk, mask=(m < M) & (kk < K), other=0.0)
            w = tl.load(wp + kk, mask=rmask[:, None] & (kk < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc.to(x_ptr.dtype.element_ty).to(tl.float32)


@_jit
def _halves(acc, BLOCK_M: tl.constexpr, HB: tl.constexpr):
    """[BLOCK_M, 2 * HB] -> its first and second HB columns."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HB)), (0, 2, 1)))


@_jit
def _dyht(x, a_ptr, w_ptr, cols, sa, sw):
    a = tl.load(a_ptr + cols * sa).to(tl.float32)
    w = tl.load(w_ptr + cols * sw).to(tl.float32)
    return w[None, :] * tl.minimum(tl.maximum(a[None, :] * x, -1.0), 1.0)


@_jit(do_not_specialize=["M", "HQ", "HKV"])
def _qkv_rope_kernel(x_ptr, sx, w_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, M, K, HQ, HKV,
                     qa_ptr, qw_ptr, ka_ptr, kw_ptr, sqa, sqw, ska, skw,
                     kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, s_blk, s_tok, s_head,
                     HALF: tl.constexpr, HB: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                     PDL: tl.constexpr, LINES: tl.constexpr, WRITE_KV: tl.constexpr, BS: tl.constexpr,
                     FP8: tl.constexpr):
    # one program: dims [d0, d0 + HB) and their RoPE partners [d0 + HALF, ...) of one head
    per_head: tl.constexpr = HALF // HB
    head = tl.program_id(0) // per_head
    d0 = (tl.program_id(0) % per_head) * HB
    j = tl.arange(0, 2 * HB)
    rows = head * (2 * HALF) + d0 + tl.where(j < HB, j, j + HALF - HB)
    acc = _dot_rows(x_ptr, sx, M, w_ptr, rows, j >= 0, K, BLOCK_M, 2 * HB, BLOCK_K, EVEN_K, PRECISION, PDL, LINES)
    lo, hi = _halves(acc, BLOCK_M, HB)
    m = tl.arange(0, BLOCK_M)[:, None]
    d = d0 + tl.arange(0, HB)
    if head < HQ + HKV:
        if head < HQ:
            lo, hi = _dyht(lo, qa_ptr, qw_ptr, d, sqa, sqw), _dyht(hi, qa_ptr, qw_ptr, d + HALF, sqa, sqw)
            out, h, nh, cache, scales = q_ptr, head, HQ, kc_ptr, ks_ptr
        else:
            lo, hi = _dyht(lo, ka_ptr, kw_ptr, d, ska, skw), _dyht(hi, ka_ptr, kw_ptr, d + HALF, ska, skw)
            out, h, nh, cache, scales = k_ptr, head - HQ, HKV, kc_ptr, ks_ptr
        cs = cs_ptr + tl.load(pos_ptr + m, mask=m < M, other=0) * (2 * HALF) + d[None, :]
        cos, sin = tl.load(cs), tl.load(cs + HALF)
        lo, hi = lo * cos - hi * sin, hi * cos + lo * sin
    else:
        out, h, nh, cache, scales = v_ptr, head - HQ - HKV, HKV, vc_ptr, vs_ptr
    ty = q_ptr.dtype.element_ty
    lo, hi = lo.to(ty), hi.to(ty)     # the cache gets k and v as the unfused path stores them
    if WRITE_KV and head >= HQ:       # this step's keys and values go straight to the cache
        slot = tl.load(slot_ptr + m, mask=m < M, other=-1)
        ok, dd = (m < M) & (slot >= 0), d[None, :]
        store_cache_rows(cache, scales, slot, h, dd, lo, ok, dd >= 0, s_blk, s_tok, s_head, BS, 2 * HALF, FP8)
        store_cache_rows(cache, scales, slot, h, dd + HALF, hi, ok, dd >= 0, s_blk, s_tok, s_head, BS,
                         2 * HALF, FP8)
    else:
        dst = out + (m * nh + h) * (2 * HALF) + d[None, :]
        tl.store(dst, lo, mask=m < M)
        tl.store(dst + HALF, hi, mask=m < M)


@_jit(do_not_specialize=["M"])
def _gate_up_reglu_kernel(x_ptr, sx, w_ptr, out_ptr, M, K, I, HB: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                          PDL: tl.constexpr, LINES: tl.constexpr):
    # one program: gate rows [n0, n0 + HB) and their up rows [I + n0, ...)
    j = tl.arange(0, 2 * HB)
    n = tl.program_id(0) * HB + tl.where(j < HB, j, j - HB)
    rows = tl.where(j < HB, n, n + I)
    acc = _dot_rows(x_ptr, sx, M, w_ptr, rows, n < I, K, BLOCK_M, 2 * HB, BLOCK_K, EVEN_K, PRECISION, PDL, LINES)
    gate, up = _halves(acc, BLOCK_M, HB)
    m = tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(0) * HB + tl.arange(0, HB)[None, :]
    tl.store(out_ptr + m * I + cols, (tl.maximum(gate, 0.0) * up).to(out_ptr.dtype.element_ty),
             mask=(m < M) & (cols < I))


@_jit(do_not_specialize=["M"])
def _linear_dyht_add_kernel(x_ptr, sx, w_ptr, res_ptr, hid_ptr, out_ptr, a_ptr, dw_ptr, pa_ptr, pw_ptr,
                            M, K, N, sa, sw, spa, spw, HAS_POST: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                            PRECISION: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    h = _dot_rows(x_ptr, sx, M, w_ptr, cols, cmask, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, PDL, LINES)
    safe = tl.where(cmask, cols, 0)
    if HAS_POST:
        h = _dyht(h, pa_ptr, pw_ptr, safe, spa, spw)
    m = tl.arange(0, BLOCK_M)[:, None]
    offs, mask = m * N + cols[None, :], (m < M) & cmask[None, :]
    h = (h + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(hid_ptr.dtype.element_ty)
    tl.store(hid_ptr + offs, h, mask=mask)
    n = _dyht(h.to(tl.float32), a_ptr, dw_ptr, safe, sa, sw)     # from the rounded hidden, as unfused
    tl.store(out_ptr + offs, n.to(out_ptr.dtype.element_ty), mask=mask)


# What the kernels take, as the reason they cannot (None: they can): the *_triton functions
# raise it, the dispatch functions send such inputs to the unfused ops.
def _operands_problem(x, weight):
    if x.dim() != 2 or x.stride(-1) != 1 or not 0 < x.shape[0] <= SMALL_M:
        return f"x must be [T <= {SMALL_M}, K] with unit last stride, got {tuple(x.shape)}"
    if not weight.is_contiguous() or weight.dtype != x.dtype or weight.shape[1] != x.shape[1]:
        return (f"weight must be contiguous [N, {x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} "
                f"{weight.dtype}")
    return None


def _head_dim_problem(d):
    if d < 2 * HALF_TILE or d & (d - 1):
        return f"head_dim must be a power of two >= {2 * HALF_TILE}, got {d}"
    return None


def _residual_problem(residual, x, weight):
    shape = (x.shape[0], weight.shape[0])
    if (residual is None or residual.shape != shape or not residual.is_contiguous()
            or residual.dtype != x.dtype):
        return f"residual must be contiguous {shape} {x.dtype}"
    return None


def _check(*problems):
    for problem in problems:
        if problem:
            raise ValueError(problem)


def _tiles(x, k, tiles):
    """(BLOCK_M, BLOCK_K, EVEN_K, PRECISION) and the launch options for `tiles` programs over a
    K-wide stream. Fewer programs than SMs (a 1,024-column projection: 64) each keep more bytes
    in flight (H200, benchmarks/small_batch.py --sweep: o_proj 4.1 -> 3.9 us, down 7.5 -> 6.7);
    more tiles than SMs (gate/up: 384) run best as 2-warp programs (7.0 -> 6.2 us).
    Splitting K over more programs instead, summed in a workspace, cost more than it gained
    (o_proj 5.8 us, down 7.9 us: benchmarks/RESULTS.md)."""
    sms = _sm_count(x.device.index or 0) if x.is_cuda else 132
    wide = tiles < sms and k >= 1024 and x.element_size() <= 2   # 3 x 32 KiB of shared memory
    block_k = 512 if wide else 256
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    pdl = pdl_args(x)
    # only where every program starts in the first wave (QKV, o_proj, down: 1.12-1.17x faster
    # ops at 1-16 rows); gate/up's 384 programs were 1.03-1.08x slower with it
    lines = max(1, block_k * x.element_size() // 128) if pdl["PDL"] and L2_PREFETCH and tiles < sms else 0
    return dict(BLOCK_M=SMALL_M, BLOCK_K=block_k, EVEN_K=k % block_k == 0, PRECISION=precision,
                num_warps=4 if tiles < sms else 2, num_stages=3 if block_k == 512 else 4,
                LINES=lines, **pdl)


def _cache_problem(kv_cache, slot_mapping, x, num_kv_heads, d):
    t = x.shape[0]
    if (kv_cache.shape[3:] != (num_kv_heads, d) or kv_cache.device != x.device or slot_mapping is None
            or slot_mapping.shape != (t,) or not slot_mapping.is_contiguous()
            or slot_mapping.device != x.device):
        return (f"kv_cache must hold {num_kv_heads} heads of {d} and slot_mapping be a contiguous ({t},), "
                f"both on {x.device}, got {tuple(kv_cache.shape)} and "
                f"{None if slot_mapping is None else tuple(slot_mapping.shape)}")
    return None


def linear_qk_norm_rope_triton(x, weight, positions, num_heads, num_kv_heads, q_alpha, q_weight,
                               k_alpha, k_weight, cos_sin_cache, kv_cache=None, slot_mapping=None,
                               k_scale=None, v_scale=None):
    d = cos_sin_cache.shape[-1]
    _check(_operands_problem(x, weight), _head_dim_problem(d))
    if weight.shape[0] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"qkv weight has {weight.shape[0]} rows, the heads want "
                         f"{(num_heads + 2 * num_kv_heads) * d}")
    t, k = x.shape
    if positions.shape != (t,) or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError(f"positions must be ({t},) and cos_sin_cache contiguous fp32, got "
                         f"{tuple(positions.shape)} and {cos_sin_cache.dtype}")
    q = torch.empty(t, num_heads, d, dtype=x.dtype, device=x.device)
    strides = [_param_stride(p, d, n) for p, n in ((q_alpha, "q_alpha"), (q_weight, "q_weight"),
                                                    (k_alpha, "k_alpha"), (k_weight, "k_weight"))]
    write = kv_cache is not None
    if write:
        check_kv_cache(kv_cache)
        _check(_cache_problem(kv_cache, slot_mapping, x, num_kv_heads, d))
        ks, vs, fp8 = scale_args(kv_cache, k_scale, v_scale, q_alpha)
        k_out = v = None
        outs = (q, q)       # stand-ins, never written: k and v go to the cache
        cache = (kv_cache[0], kv_cache[1], slot_mapping, ks, vs, *kv_cache[0].stride()[:3])
        bs = kv_cache.shape[2]
    else:
        k_out, v = outs = tuple(torch.empty(t, num_kv_heads, d, dtype=x.dtype, device=x.device)
                                for _ in range(2))
        cache, bs, fp8 = (q, q, positions, q_alpha, q_alpha, 0, 0, 0), 1, False   # stand-ins, never read
    tiles = (num_heads + 2 * num_kv_heads) * d // (2 * HALF_TILE)
    _qkv_rope_kernel[(tiles,)](x, x.stride(0), weight, q, *outs, positions, cos_sin_cache, t, k, num_heads,
                               num_kv_heads, q_alpha, q_weight, k_alpha, k_weight, *strides, *cache,
                               HALF=d // 2, HB=HALF_TILE, WRITE_KV=write, BS=bs, FP8=fp8,
                               **_tiles(x, k, tiles))
    return q, k_out, v


def linear_reglu_triton(x, weight):
    _check(_operands_problem(x, weight))
    if weight.shape[0] % 2:
        raise ValueError(f"gate_up weight needs an even row count, got {weight.shape[0]}")
    (t, k), i = x.shape, weight.shape[0] // 2
    out = torch.empty(t, i, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(i, HALF_TILE)
    _gate_up_reglu_kernel[(tiles,)](x, x.stride(0), weight, out, t, k, i, HB=HALF_TILE,
                                    **_tiles(x, k, tiles))
    return out


def linear_dyht_add_triton(x, weight, residual, alpha, dyht_weight, post_alpha=None, post_weight=None):
    _check(_operands_problem(x, weight), _residual_problem(residual, x, weight))
    (t, k), n = x.shape, weight.shape[0]
    if (post_alpha is None) != (post_weight is None):
        raise ValueError("post_alpha and post_weight go together")
    hidden, normed = torch.empty_like(residual), torch.empty_like(residual)
    has_post = post_alpha is not None
    pa, pw = (post_alpha, post_weight) if has_post else (alpha, dyht_weight)
    strides = [_param_stride(p, n, s) for p, s in ((alpha, "alpha"), (dyht_weight, "weight"),
                                                    (pa, "post_alpha"), (pw, "post_weight"))]
    tiles = triton.cdiv(n, TILE_N)
    _linear_dyht_add_kernel[(tiles,)](
        x, x.stride(0), weight, residual, hidden, normed, alpha, dyht_weight, pa, pw, t, k, n,
        *strides, HAS_POST=has_post, BLOCK_N=TILE_N, **_tiles(x, k, tiles))
    return hidden, normed


def _fast(x, weight) -> bool:
    """The fused kernels serve decode-sized CUDA batches; the rest runs the unfused ops."""
    return x.is_cuda and triton is not None and _operands_problem(x, weight) is None


def linear_qk_norm_rope(x, weight, positions, num_heads, num_kv_heads, q_alpha, q_weight, k_alpha,
                        k_weight, cos_sin_cache, kv_cache=None, slot_mapping=None, k_scale=None,
                        v_scale=None):
    """q, k, v [T, H, D] of `x @ weight.T` (the fused QKV projection), q and k DyHT-normed and
    rotated (NeoX RoPE over the whole head). Given the paged cache and the tokens' slots, the
    fused kernel stores k and v there itself (one kernel fewer a layer) and returns (q, None,
    None); the unfused path returns k and v for the attention backend to store."""
    args = (x, weight, positions, num_heads, num_kv_heads, q_alpha, q_weight, k_alpha, k_weight,
            cos_sin_cache)
    d = cos_sin_cache.shape[-1]
    if not (_fast(x, weight) and _head_dim_problem(d) is None):
        return linear_qk_norm_rope_unfused(*args)
    if kv_cache is None or _cache_problem(kv_cache, slot_mapping, x, num_kv_heads, d):
        return linear_qk_norm_rope_triton(*args)
    return linear_qk_norm_rope_triton(*args, kv_cache, slot_mapping, k_scale, v_scale)


def linear_reglu(x, weight):
    """relu(gate) * up of `x @ weight.T` (weight = [gate; up])."""
    fn = linear_reglu_triton if _fast(x, weight) and weight.shape[0] % 2 == 0 else linear_reglu_unfused
    return fn(x, weight)


def linear_dyht_add(x, weight, residual, alpha, dyht_weight, post_alpha=None, post_weight=None):
    """dyht_add(x @ weight.T, residual, ...): (hidden, its DyHT), as ops.dyht_add returns them."""
    fast = _fast(x, weight) and _residual_problem(residual, x, weight) is None
    fn = linear_dyht_add_triton if fast else linear_dyht_add_unfused
    return fn(x, weight, residual, alpha, dyht_weight, post_alpha, post_weight)
