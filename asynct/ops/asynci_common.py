"""The Triton pieces that paged AsyncI's decode (asynci_decode.py) and prefill
(asynci_prefill.py) share: paged K/V row loads, the FP8 scale folding, the causal pool's gate
over a key tile, and the split-K bookkeeping (key ranges, fp32 partials, their sum).

An FP8 cache is dequantised in registers by folding its static per-channel scales into the
math: s = q.(k*ks) = (q*ks).k, so q is scaled once per program, and sum_j a_j (v_j*vs) =
vs * sum_j a_j v_j, so the accumulator is scaled once at the end; K/V tiles are only cast.
Without FP8 (a constexpr) the kernels compile exactly as before."""
import os
import functools

import torch

from asynct.ops._triton import KernelLaunch, jit as _jit, next_power_of_2, pdl, tl, triton, wait_for_prior
from asynct.ops.kv_cache import check_kv_scales, is_fp8


@_jit
def kv_row_offsets(bt_row_ptr, keys, mask, kv_head, s_blk, s_tok, s_head, BS: tl.constexpr):
    """Element offsets of rows `keys` of one KV head in a paged cache [num_blocks, BS, HKV, D]
    of any strides (s_blk, s_tok, s_head; unit stride along D). Strides let vLLM's block-major
    cache [num_blocks, 2, BS, HKV, D] be read in place."""
    blk = tl.load(bt_row_ptr + keys // BS, mask=mask, other=0)
    return blk.to(tl.int64) * s_blk + (keys % BS) * s_tok + kv_head * s_head


@_jit
def load_rows(cache_ptr, rows, mask, D: tl.constexpr):
    """[N, D] from the row offsets of kv_row_offsets."""
    d = tl.arange(0, D)
    return tl.load(cache_ptr + rows[:, None] + d[None, :], mask=mask[:, None], other=0.0)


@_jit
def load_kv_rows(cache_ptr, bt_row_ptr, keys, mask, kv_head, s_blk, s_tok, s_head,
                 BS: tl.constexpr, D: tl.constexpr):
    """Rows `keys` of one KV head -> [N, D] (kv_row_offsets, then load_rows)."""
    return load_rows(cache_ptr, kv_row_offsets(bt_row_ptr, keys, mask, kv_head, s_blk, s_tok, s_head, BS), mask, D)


# e4m3 pairs -> fp16 pairs, exactly: one instruction for two bytes of a word
CVT_E4M3 = tl.constexpr("{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
                        "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }") if triton else None


@_jit
def _e4m3_byte(x, i: tl.constexpr):
    return ((x >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@_jit
def unpack_e4m3(x, PTX: tl.constexpr):
    """int32 words [N, W] of four e4m3 each (little-endian) -> fp16 [N, 4W], exactly. PTX: by
    `cvt.rn.f16x2.e4m3x2` (the interpreter runs no PTX: shifts and casts there)."""
    if PTX:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(CVT_E4M3, "=h,=h,=h,=h,r", [x], dtype=(tl.float16,) * 4,
                                                   is_pure=True, pack=1)
    else:
        c0, c1, c2, c3 = _e4m3_byte(x, 0), _e4m3_byte(x, 1), _e4m3_byte(x, 2), _e4m3_byte(x, 3)
    pairs = tl.join(tl.join(c0, c1), tl.join(c2, c3))      # [N, W, within a pair, which pair]
    return tl.reshape(pairs.permute(0, 1, 3, 2), [x.shape[0], 4 * x.shape[1]])


@_jit
def load_kv_tile(cache_ptr, bt_row_ptr, keys, mask, kv_head, s_blk, s_tok, s_head, BS: tl.constexpr,
                 D: tl.constexpr, FP8: tl.constexpr, PTX: tl.constexpr):
    """load_kv_rows, or for an FP8 cache (int32 words, strides in words: kv_operands) its rows
    unpacked in registers. Loaded as bytes, a tile went through shared memory one byte at a time
    (Triton converts its layout before the e4m3 cast): 64 `ld.shared.b8` a thread a tile, and the
    FP8 decode 1.11-1.25x slower from 32 sequences up (H200, benchmarks/RESULTS.md)."""
    if FP8:
        rows = kv_row_offsets(bt_row_ptr, keys, mask, kv_head, s_blk, s_tok, s_head, BS)
        w = tl.arange(0, D // 4)
        tile = unpack_e4m3(tl.load(cache_ptr + rows[:, None] + w[None, :], mask=mask[:, None], other=0), PTX)
    else:
        tile = load_kv_rows(cache_ptr, bt_row_ptr, keys, mask, kv_head, s_blk, s_tok, s_head, BS, D)
    return tile


def kv_operands(kv_cache, fp8):
    """The K and V caches as attend_keys reads them, their (block, token, head) strides, and
    whether FP8 words convert by PTX: an FP8 cache as int32 words of four e4m3 (load_kv_tile)."""
    k, v = kv_cache[0], kv_cache[1]
    if fp8:
        k, v = k.view(torch.int32), v.view(torch.int32)
    return k, v, k.stride()[:3], k.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


@_jit
def fold_k_scale(q, ks_ptr, kv_head, D: tl.constexpr, FP8: tl.constexpr):
    """q [M, D] times the KV head's k scales: scores of q against raw FP8 keys are then exact."""
    if FP8:
        ks = tl.load(ks_ptr + kv_head * D + tl.arange(0, D))
        qs = q.to(tl.float32) * ks[None, :]
        # 16-bit queries go to fp16, so FP8 tiles convert to the dot's type in one instruction
        # per pair (e4m3 -> bf16 takes four); |q| <= its DyHT weight, far inside fp16's range
        if q.dtype == tl.float32:
            q = qs
        else:
            q = qs.to(tl.float16)
    return q


@_jit
def apply_v_scale(acc, vs_ptr, kv_head, D: tl.constexpr, FP8: tl.constexpr):
    """An fp32 accumulator of a @ raw-FP8 values [M, D] -> a @ dequantised values."""
    if FP8:
        acc = acc * tl.load(vs_ptr + kv_head * D + tl.arange(0, D))[None, :]
    return acc


def scale_args(kv_cache, k_scale, v_scale, dummy):
    """(k scale, v scale, FP8 flag) for a kernel launch; `dummy` stands in (never read) for a
    cache that is not FP8, so the non-FP8 compile is unchanged."""
    check_kv_scales(kv_cache, k_scale, v_scale)
    fp8 = is_fp8(kv_cache.dtype)
    return (k_scale, v_scale, fp8) if fp8 else (dummy, dummy, False)


@_jit
def pool_gate(s, r, r_prev, sigma, P: tl.constexpr, BLOCK_N: tl.constexpr):
    """a = clamp(s - sigma * mean(r[j-P+1..j]), 0, 1) over a [M, BLOCK_N] tile whose left
    neighbour tile's r is `r_prev`. One index serves both: n-m for n >= m, else N+n-m."""
    n = tl.arange(0, BLOCK_N)[None, :]
    total = r
    for m in tl.static_range(1, P):
        idx = tl.broadcast_to((n - m + BLOCK_N) % BLOCK_N, r.shape)
        cur = tl.gather(r, idx, axis=1)
        prev = tl.gather(r_prev, idx, axis=1)
        total += tl.where(n >= m, cur, prev)
    lp = total / P
    return tl.minimum(tl.maximum(s - sigma[:, None] * lp, 0.0), 1.0)


@_jit
def halo_scores(q, k_ptr, bt_row_ptr, kvh, lo, hi, scale, s_blk, s_tok, s_head, D: tl.constexpr, BS: tl.constexpr,
                BLOCK_N: tl.constexpr, P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr,
                FP8: tl.constexpr, PTX: tl.constexpr):
    """The pooled scores r of the P-1 keys before lo (none before key 0), zeros elsewhere: the
    [M, BLOCK_N] tile left of the first one."""
    keys = lo - BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = (keys >= 0) & (keys >= lo - (P - 1)) & (lo < hi)
    k = load_kv_tile(k_ptr, bt_row_ptr, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D, FP8, PTX).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    return tl.where(kmask[None, :], tl.maximum(s, 0.0) if RELU else s, 0.0)


@_jit
def split16(x, dtype: tl.constexpr):
    """fp32 x as its rounding to a 16-bit dtype and what that rounding left out, in that dtype:
    two operands whose products with an exact tile sum to x's in fp32."""
    hi = x.to(dtype)
    return hi, (x - hi.to(tl.float32)).to(dtype)


@_jit
def gate_dot(a, v, acc, PREC: tl.constexpr, STACKED: tl.constexpr):
    """acc + a @ v for fp32 gates a in [0, 1] and a tile v, exactly: a 16-bit v takes a as its
    rounding to v's type plus what that rounding left out. One bf16 rounding of every gate (up
    to 2^-9 relative, as the torch backend rounds it) was the Triton engine's whole excess over
    exact attention in teacher-forced bf16 logprobs (h80 in the prefill, gqa2 in the decode;
    bf16_parity.py). Two products, or STACKED: a's second half of rows repeats its first half's
    queries and takes the remainder, one product over rows a decode tile pads anyway (M >= 16
    for GQA groups of 1-8), summed by unstack_rows. The prefill's second product costs its kernel
    1.05x at 512 tokens and 1.21-1.27x at 2K-8K (H100, benchmarks/RESULTS.md)."""
    if STACKED:
        first = tl.arange(0, a.shape[0])[:, None] < a.shape[0] // 2
        if v.dtype == tl.float32:
            return tl.dot(tl.where(first, a, 0.0), v, acc, input_precision=PREC)
        hi, lo = split16(a, v.dtype)
        return tl.dot(tl.where(first, hi, lo), v, acc, input_precision=PREC)
    if v.dtype == tl.float32:
        return tl.dot(a, v, acc, input_precision=PREC)
    # the remainder formed after the first product, not with it: the prefill's 64 x 32 config then
    # compiles to 172 registers, two programs an SM, not 168 (sm_90); three an SM, as a cap of 168
    # gave, ran 1.12x slower at 2K tokens (H100, benchmarks/RESULTS.md)
    hi = a.to(v.dtype)
    acc = tl.dot(hi, v, acc, input_precision=PREC)
    return tl.dot((a - hi.to(tl.float32)).to(v.dtype), v, acc, input_precision=PREC)


@_jit
def unstack_rows(acc, M: tl.constexpr, D: tl.constexpr):
    """[M // 2, D]: a STACKED gate_dot's two halves of rows added."""
    return tl.sum(tl.reshape(acc, [2, M // 2, D]), axis=0)


@_jit
def attend_keys(q, sigma, k_ptr, v_ptr, bt_row_ptr, vs_ptr, kvh, lo, hi, scale, s_blk, s_tok, s_head,
                D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                RELU: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr, PTX: tl.constexpr,
                STACKED: tl.constexpr):
    """fp32 [M, D]: AsyncI of the query rows `q` over keys [lo, hi) of one KV head, their pool
    window reaching back into the P-1 keys before lo (the halo, recomputed; none before key 0).
    The cache as kv_operands gives it; the gates' product as gate_dot's STACKED says.
    The halo tile is taken only where keys precede lo. A row's first split (every row of a
    batch of 99+ sequences, one split each) then skips its load and dot, and in its own branch
    the halo leaves the key loop its registers: the decode's variants take 111-125 a thread, not
    124-162 (sm_90), four programs an SM uncapped. The decode alone (H200): 1.01-1.03x at 8-256
    rows; gsm8k-shaped cascade rows (a halo in every split, ~4 tiles each) 1.015x slower, the
    branch's load no longer overlapping the loop's first ones (benchmarks/RESULTS.md)."""
    n = tl.arange(0, BLOCK_N)
    r_prev = tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32)
    if P > 1:
        if (lo > 0) & (lo < hi):
            r_prev = halo_scores(q, k_ptr, bt_row_ptr, kvh, lo, hi, scale, s_blk, s_tok, s_head, D, BS, BLOCK_N,
                                 P, RELU, PREC, FP8, PTX)
    acc = tl.zeros([q.shape[0], D], dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        keys = j0 + n
        kmask = keys < hi
        k = load_kv_tile(k_ptr, bt_row_ptr, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D, FP8, PTX).to(q.dtype)
        v = load_kv_tile(v_ptr, bt_row_ptr, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D, FP8, PTX).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        r = tl.where(kmask[None, :], tl.maximum(s, 0.0) if RELU else s, 0.0)
        a = tl.where(kmask[None, :], pool_gate(s, r, r_prev, sigma, P, BLOCK_N), 0.0)
        acc = gate_dot(a, v, acc, PREC, STACKED)
        r_prev = r
    return apply_v_scale(acc, vs_ptr, kvh, D, FP8)


@_jit
def split_range(seq_ptr, plen_ptr, b, split, n_splits, BLOCK_N: tl.constexpr, CASCADE: tl.constexpr):
    """Keys [lo, hi) of one split of sequence b, the splits holding keys (`used`; split 0 always
    counts) and where the sequence's own keys start (past a shared prefix). Taken from the
    device-side lengths: no host sync, any length is right, and a graph sized for its longest
    context skips the splits past a shorter one's last key."""
    n_keys = tl.load(seq_ptr + b)
    start = 0
    if CASCADE:      # keys below the shared prefix's length are the prefix tiles' (asynci_decode)
        start = tl.minimum(tl.load(plen_ptr), n_keys)
    per = tl.cdiv(tl.cdiv(n_keys - start, n_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per
    used = tl.maximum(tl.cdiv(n_keys - start, tl.maximum(per, 1)), 1)
    return lo, tl.minimum(lo + per, n_keys), used, start


@_jit
def split_partials(mid_ptr, seq_ptr, plen_ptr, S, D: tl.constexpr, BLOCK_N: tl.constexpr, CASCADE: tl.constexpr):
    """Program (b, h)'s row of a decode's fp32 partials (split s at row + s * D), how many
    splits held keys and where the row's own keys start (split_range: past a shared prefix)."""
    b = tl.program_id(0)
    row = mid_ptr + ((b * tl.num_programs(1) + tl.program_id(1)) * S).to(tl.int64) * D + tl.arange(0, D)
    _, _, used, start = split_range(seq_ptr, plen_ptr, b, 0, S, BLOCK_N, CASCADE)
    return row, used, start


MAX_PREFIX_SPLITS = 8   # the prefix partials a split sum adds (_sum_splits_kernel's loop)


@_jit(do_not_specialize=["S", "S_PRE"])
def _sum_splits_kernel(mid_ptr, out_ptr, seq_ptr, plen_ptr, pre_ptr, sob, soh, S, S_PRE, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, CASCADE: tl.constexpr, PDL: tl.constexpr):
    """out[b, h] = the sum of a decode's fp32 partials in split order, of only the splits that
    held keys (split_range), then (CASCADE, where the row holds prefix keys) the shared prefix's
    S_PRE <= 8 partials, at the same (b, h) of pre [B, H, S_PRE, D]. The lengths are read before
    the PDL wait (host-written, not the decode kernel's output), so the loop does not start one
    L2 round trip late (H200, batch 32: 12.7 against 13.8 us a layer). Sixteen loads issued
    before the length was known were slower still. The used splits load eight at a time, all
    eight in flight before the first add (one at a time, batch 1 at 2,048 keys: 14.7-15.2
    against 13.8-14.1 us a layer of QKV + decode + o_proj; H200, benchmarks/RESULTS.md)."""
    row, used, start = split_partials(mid_ptr, seq_ptr, plen_ptr, S, D, BLOCK_N, CASCADE)
    written = False
    if CASCADE:     # nothing shared and one split a row: the decode wrote out itself (cascade_direct)
        written = cascade_direct(plen_ptr, S)
    wait_for_prior(PDL)
    if not written:
        acc = tl.zeros([D], dtype=tl.float32)
        for c in range(tl.cdiv(used, 8)):   # a run-time count: one compiled kernel for every split count
            for j in tl.static_range(8):    # past `used`: masked off, x + 0.0 is x
                acc += tl.load(row + (c * 8 + j) * D, mask=c * 8 + j < used, other=0.0)
        if CASCADE:     # a row holding no prefix keys (none shared, or an empty row) has none written
            pre = (pre_ptr + ((tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * S_PRE).to(tl.int64) * D
                   + tl.arange(0, D))
            for j in tl.static_range(8):    # MAX_PREFIX_SPLITS
                acc += tl.load(pre + j * D, mask=(start > 0) & (j < S_PRE), other=0.0)
        dst = out_ptr + tl.program_id(0).to(tl.int64) * sob + tl.program_id(1) * soh + tl.arange(0, D)
        tl.store(dst, acc.to(out_ptr.dtype.element_ty))


@_jit
def cascade_direct(plen_ptr, n_splits):
    """Whether a cascade decode's rows write their output themselves, not partials for the sum:
    where no prefix is shared this step (every decode graph of 16+ rows runs the cascade variant)
    and each row is one split, the sum would only copy. Host-written lengths: read before the
    PDL wait. The sum kernel still runs (a graph holds it) and only waits."""
    return (tl.load(plen_ptr) == 0) & (n_splits == 1)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(t) -> int:
    """The SMs of `t`'s device, which the launch plans size their grids by; off CUDA (the
    interpreted kernels of the tests) an H200's 132."""
    return _sm_count(t.device.index or 0) if t.is_cuda else 132


def layer_layout(q, kv_cache, out) -> tuple:
    """What a launch planned once for many layers (DecodeLaunch, PrefillLaunch) assumes of each
    layer's tensors: their shapes, strides and dtypes."""
    return q.shape, q.stride(), q.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, out.shape, out.stride(), \
        out.dtype


def check_layer(layout, q, kv_cache, out):
    if layer_layout(q, kv_cache, out) != layout:
        raise ValueError(f"a launch planned for q, cache and out of {layout} got {layer_layout(q, kv_cache, out)}")


def split_output(out, splits, partials=False):
    """Where a kernel split `splits` ways over keys writes, and its (row, head, split) strides:
    `out` itself for one split (unless `partials`), else fp32 partials [rows, heads, splits, D]
    that `sum_splits` adds."""
    if splits == 1 and not partials:
        return out, (out.stride(0), out.stride(1), 0)
    rows, hq, d = out.shape
    return (torch.empty(rows, hq, splits, d, dtype=torch.float32, device=out.device),
            (hq * splits * d, splits * d, d))


def sum_splits(dst, out, splits, lens, pre=None, launch=None):
    """AsyncI has no normalisation: the partials of disjoint key ranges add. A decode's: only
    its splits that held keys wrote partials, known from `lens` (seq_lens, prefix_len, BLOCK_N,
    cascade); with `pre` (cascade: the shared prefix's partials [B, H, S_PRE, D]) those too,
    then even one split is summed. Launched with programmatic dependent launch where the device
    has it; `launch`, sum_splits_launch(out) kept for many layers (DecodeLaunch)."""
    if splits > 1 or pre is not None:
        seq, plen, block_n, cascade = lens
        s_pre = 0 if pre is None else pre.shape[2]
        (launch or sum_splits_launch(out))(dst, out, seq, plen, dst if pre is None else pre, out.stride(0),
                                           out.stride(1), splits, s_pre, D=out.shape[2], BLOCK_N=block_n,
                                           CASCADE=cascade, PDL=pdl(out))
    return out


def sum_splits_launch(out) -> KernelLaunch:
    return KernelLaunch(_sum_splits_kernel, out.shape[:2], num_warps=4, launch_pdl=pdl(out))


@_jit(do_not_specialize=["S", "B"])
def _sum_all_splits_kernel(mid_ptr, out_ptr, qsl_ptr, B, sot, soh, H, S, HP: tl.constexpr, D: tl.constexpr,
                           MAX_S: tl.constexpr):
    """out[t] = the sum of row t's S fp32 partials in split order, all its heads at once, every
    load issued before the first add (S <= MAX_S; the loads past S are masked off). A prefill
    has thousands of rows: one program a (row, head) adding one dependent load after another
    left the sum latency-bound. Only the chunks' rows [qsl[0], qsl[B]) are stored: rows before
    them (vLLM's decode rows) or after (padding) hold partials nobody wrote."""
    t = tl.program_id(0)
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, D)[None, :]
    mask = h < H
    row = mid_ptr + ((t.to(tl.int64) * H + h) * S) * D + d
    acc = tl.zeros([HP, D], dtype=tl.float32)
    for s in tl.static_range(MAX_S):
        acc += tl.load(row + s * D, mask=mask & (s < S), other=0.0)
    own = (t >= tl.load(qsl_ptr)) & (t < tl.load(qsl_ptr + B))
    tl.store(out_ptr + t.to(tl.int64) * sot + h * soh + d, acc.to(out_ptr.dtype.element_ty), mask=mask & own)


def sum_all_splits(dst, out, splits, max_splits, query_start_loc, launch=None):
    """`sum_splits` of a prefill, whose every split wrote a partial of every row of its chunks
    (zeros where it holds no key of that row); `max_splits`, the most it ever launches, fixes
    the one compile. Rows of `out` outside the chunks keep their values. `launch`:
    sum_all_splits_launch(out) kept for many layers (PrefillLaunch)."""
    if splits > max_splits:
        raise ValueError(f"{splits} key splits, more than the {max_splits} the sum is compiled for")
    if splits > 1:
        t, h, d = out.shape
        (launch or sum_all_splits_launch(out))(dst, out, query_start_loc, query_start_loc.shape[0] - 1,
                                               out.stride(0), out.stride(1), h, splits, HP=next_power_of_2(h),
                                               D=d, MAX_S=max_splits)
    return out


def sum_all_splits_launch(out) -> KernelLaunch:
    t, h, d = out.shape
    # 8 elements a thread, as measured (8 heads of 128, 4 warps), for any row size
    return KernelLaunch(_sum_all_splits_kernel, (t,), num_warps=max(1, min(16, next_power_of_2(h) * d // 256)))
