"""The Triton kernels of fused_linear.py: decode-sized linears (at most 64 rows) with their
elementwise epilogue. A program streams 16 weight rows (a 16-row dot with a tile of 16, 32 or 64
activation rows), or, for one to four activation rows (GEMV), 2-8 weight rows multiplied on the
CUDA cores; RoPE and ReGLU pair rows that are far apart (d and d + head_dim/2, gate j and up j),
so their programs load the two halves as one tile and split the accumulator. The accumulator
is rounded to the weights' dtype before the epilogue, as the unfused ops receive it."""
from asynct.ops._triton import jit as _jit, prefetch_l2, tl, wait_for_prior
from asynct.ops.kv_cache import store_cache_rows


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
def _x_row(x_ptr, sx, i: tl.constexpr, M, k, km):
    # a row past M (the fourth of a 3-row call) reads as zeros; one past BLOCK_M is never used,
    # so its load compiles away
    if i > 0:           # every call has row 0: no predicate on M
        km = km & (M > i)
    return tl.load(x_ptr + i * sx + k, mask=km, other=0.0).to(tl.float32)[None, :]


@_jit
def _gemv_rows(x_ptr, sx, M, w_ptr, rows, rmask, K: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """_dot_rows for one to four activation rows (BLOCK_M 1, 2 or 4), on the CUDA cores: K is
    unrolled, so all of a program's weight loads go out at once, straight into registers, and
    a 16-row dot tile's empty rows cost nothing. Each weight tile, loaded once, meets every
    row, each in an accumulator of its own (one 3-D one reduced K through shared memory and
    lost: RESULTS.md). Fewer weight rows a program than a dot tile's 16 make more programs
    (o_proj: 512, not 64), so every SM streams. Where one K tile holds the whole rows, they
    load before the PDL wait (weights are no kernel's output): the DRAM round trip overlaps
    the kernel before instead of following it (batch-1 steps 1.07x faster, though most ops
    alone ran slower; an L2 prefetch there instead made steps 1.07x slower. H200,
    benchmarks/RESULTS.md)."""
    kk = tl.arange(0, BLOCK_K)
    base = w_ptr + tl.where(rmask, rows, 0).to(tl.int64)[:, None] * K
    if BLOCK_K >= K:
        km = kk < K
        w = tl.load(base + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0).to(tl.float32)
        wait_for_prior(PDL)
        # products, not sums onto zeros: each fuses into the reduction's adds (FMA)
        acc0, acc1 = w * _x_row(x_ptr, sx, 0, M, kk, km), w * _x_row(x_ptr, sx, 1, M, kk, km)
        acc2, acc3 = w * _x_row(x_ptr, sx, 2, M, kk, km), w * _x_row(x_ptr, sx, 3, M, kk, km)
    else:
        wait_for_prior(PDL)
        acc0 = tl.zeros((rows.shape[0], BLOCK_K), dtype=tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0
        for k0 in tl.static_range(0, K, BLOCK_K):
            km = k0 + kk < K
            w = tl.load(base + k0 + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0).to(tl.float32)
            acc0 += w * _x_row(x_ptr + k0, sx, 0, M, kk, km)
            acc1 += w * _x_row(x_ptr + k0, sx, 1, M, kk, km)
            acc2 += w * _x_row(x_ptr + k0, sx, 2, M, kk, km)
            acc3 += w * _x_row(x_ptr + k0, sx, 3, M, kk, km)
    # the weights' dtype: an fp32 x beside 16-bit weights (the decode's sums into o_proj) rounds as
    # a 16-bit x would
    return _row_sums(acc0, acc1, acc2, acc3, BLOCK_M).to(w_ptr.dtype.element_ty).to(tl.float32)


@_jit
def _row_sums(acc0, acc1, acc2, acc3, BLOCK_M: tl.constexpr):
    """[BLOCK_M, weight rows]: the first BLOCK_M accumulators, each reduced over K once."""
    if BLOCK_M == 1:
        out = tl.sum(acc0, axis=1)[None, :]
    elif BLOCK_M == 2:
        out = tl.trans(tl.join(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1)))
    else:   # one reduction of [rows, K, 2, 2] (4 CTA barriers, not 4 sums' 13); row i at [:, i % 2, i // 2]
        out = tl.sum(tl.join(tl.join(acc0, acc1), tl.join(acc2, acc3)), axis=1)
        out = tl.reshape(tl.permute(out, (2, 1, 0)), (4, acc0.shape[0]))
    return out


@_jit
def _weight_rows(x_ptr, sx, M, w_ptr, rows, rmask, K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                 PDL: tl.constexpr, LINES: tl.constexpr, GEMV: tl.constexpr):
    if GEMV:
        acc = _gemv_rows(x_ptr, sx, M, w_ptr, rows, rmask, K, BLOCK_M, BLOCK_K, PDL)
    else:
        acc = _dot_rows(x_ptr, sx, M, w_ptr, rows, rmask, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
                        PDL, LINES)
    return acc


@_jit
def _halves(acc, BLOCK_M: tl.constexpr, HB: tl.constexpr):
    """[BLOCK_M, 2 * HB] -> its first and second HB columns."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HB)), (0, 2, 1)))


@_jit
def _norm_params(a_ptr, w_ptr, cols, sa, sw):
    """A DyHT's (alpha, weight) at `cols` (strides 0 for scalars), fp32."""
    return tl.load(a_ptr + cols * sa).to(tl.float32), tl.load(w_ptr + cols * sw).to(tl.float32)


@_jit
def _dyht(x, params):
    a, w = params
    return w[None, :] * tl.minimum(tl.maximum(a[None, :] * x, -1.0), 1.0)


@_jit(do_not_specialize=["M", "HQ", "HKV"])
def qkv_rope_kernel(x_ptr, sx, w_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, M, K: tl.constexpr, HQ, HKV,
                     qa_ptr, qw_ptr, ka_ptr, kw_ptr, sqa, sqw, ska, skw,
                     kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, s_blk, s_tok, s_head, sums_ptr,
                     HALF: tl.constexpr, HB: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                     PDL: tl.constexpr, LINES: tl.constexpr, WRITE_KV: tl.constexpr, BS: tl.constexpr,
                     FP8: tl.constexpr, GEMV: tl.constexpr, ZERO_SUMS: tl.constexpr):
    # one program: dims [d0, d0 + HB) and their RoPE partners [d0 + HALF, ...) of one head
    per_head: tl.constexpr = HALF // HB
    head = tl.program_id(0) // per_head
    d0 = (tl.program_id(0) % per_head) * HB
    m = tl.arange(0, BLOCK_M)[:, None]
    d = d0 + tl.arange(0, HB)
    # the epilogue's operands load before the PDL wait (in _weight_rows), off the critical path:
    # positions, slots (host-written: the caller's contract) and the norms (weights). After the
    # reduction, the position -> cos/sin round trips cost 2.3 us a layer of QKV + decode + o_proj
    # at batch 1 (12.9-13.1 against 10.6-10.9; batch 8: 14.6-15.2 against 13.9-14.5; H200)
    is_q = head < HQ
    a_ptr, nw_ptr = tl.where(is_q, qa_ptr, ka_ptr), tl.where(is_q, qw_ptr, kw_ptr)
    sa, sw = tl.where(is_q, sqa, ska), tl.where(is_q, sqw, skw)
    norm_lo, norm_hi = _norm_params(a_ptr, nw_ptr, d, sa, sw), _norm_params(a_ptr, nw_ptr, d + HALF, sa, sw)
    cs = cs_ptr + tl.load(pos_ptr + m, mask=m < M, other=0) * (2 * HALF) + d[None, :]
    cos, sin = tl.load(cs), tl.load(cs + HALF)
    slot = tl.load(slot_ptr + m, mask=m < M, other=-1) if WRITE_KV else m
    j = tl.arange(0, 2 * HB)
    rows = head * (2 * HALF) + d0 + tl.where(j < HB, j, j + HALF - HB)
    acc = _weight_rows(x_ptr, sx, M, w_ptr, rows, j >= 0, K, BLOCK_M, 2 * HB, BLOCK_K, EVEN_K, PRECISION, PDL,
                       LINES, GEMV)
    lo, hi = _halves(acc, BLOCK_M, HB)
    if head < HQ + HKV:
        lo, hi = _dyht(lo, norm_lo), _dyht(hi, norm_hi)
        if is_q:
            out, h, nh, cache, scales = q_ptr, head, HQ, kc_ptr, ks_ptr
        else:
            out, h, nh, cache, scales = k_ptr, head - HQ, HKV, kc_ptr, ks_ptr
        lo, hi = lo * cos - hi * sin, hi * cos + lo * sin
    else:
        out, h, nh, cache, scales = v_ptr, head - HQ - HKV, HKV, vc_ptr, vs_ptr
    ty = q_ptr.dtype.element_ty
    lo, hi = lo.to(ty), hi.to(ty)     # the cache gets k and v as the unfused path stores them
    if WRITE_KV and head >= HQ:       # this step's keys and values go straight to the cache
        ok, dd = (m < M) & (slot >= 0), d[None, :]
        store_cache_rows(cache, scales, slot, h, dd, lo, ok, dd >= 0, s_blk, s_tok, s_head, BS, 2 * HALF, FP8)
        store_cache_rows(cache, scales, slot, h, dd + HALF, hi, ok, dd >= 0, s_blk, s_tok, s_head, BS,
                         2 * HALF, FP8)
    else:
        dst = out + (m * nh + h) * (2 * HALF) + d[None, :]
        tl.store(dst, lo, mask=m < M)
        tl.store(dst + HALF, hi, mask=m < M)
    if ZERO_SUMS and is_q:   # after the wait (in _weight_rows): the memory may be sums the o_proj before read
        sums = sums_ptr + (m * HQ + head) * (2 * HALF) + d[None, :]
        zero = tl.zeros((BLOCK_M, HB), dtype=tl.float32)
        tl.store(sums, zero, mask=m < M)
        tl.store(sums + HALF, zero, mask=m < M)


@_jit(do_not_specialize=["M"])
def gate_up_reglu_kernel(x_ptr, sx, w_ptr, out_ptr, M, K: tl.constexpr, I, HB: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          PRECISION: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr, GEMV: tl.constexpr):
    # one program: gate rows [n0, n0 + HB) and their up rows [I + n0, ...)
    j = tl.arange(0, 2 * HB)
    n = tl.program_id(0) * HB + tl.where(j < HB, j, j - HB)
    rows = tl.where(j < HB, n, n + I)
    acc = _weight_rows(x_ptr, sx, M, w_ptr, rows, n < I, K, BLOCK_M, 2 * HB, BLOCK_K, EVEN_K, PRECISION, PDL,
                       LINES, GEMV)
    gate, up = _halves(acc, BLOCK_M, HB)
    m = tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(0) * HB + tl.arange(0, HB)[None, :]
    tl.store(out_ptr + m * I + cols, (tl.maximum(gate, 0.0) * up).to(out_ptr.dtype.element_ty),
             mask=(m < M) & (cols < I))


@_jit(do_not_specialize=["M"])
def linear_dyht_add_kernel(x_ptr, sx, w_ptr, res_ptr, hid_ptr, out_ptr, a_ptr, dw_ptr, pa_ptr, pw_ptr,
                            M, K: tl.constexpr, N, sa, sw, spa, spw, HAS_POST: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                            LINES: tl.constexpr, GEMV: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    h = _weight_rows(x_ptr, sx, M, w_ptr, cols, cmask, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, PDL,
                     LINES, GEMV)
    safe = tl.where(cmask, cols, 0)
    if HAS_POST:
        h = _dyht(h, _norm_params(pa_ptr, pw_ptr, safe, spa, spw))
    m = tl.arange(0, BLOCK_M)[:, None]
    offs, mask = m * N + cols[None, :], (m < M) & cmask[None, :]
    h = (h + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(hid_ptr.dtype.element_ty)
    tl.store(hid_ptr + offs, h, mask=mask)
    n = _dyht(h.to(tl.float32), _norm_params(a_ptr, dw_ptr, safe, sa, sw))   # the rounded hidden's, as unfused
    tl.store(out_ptr + offs, n.to(out_ptr.dtype.element_ty), mask=mask)
