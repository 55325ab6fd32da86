"""Paged AsyncI decode: one query token per sequence, two-stage split-K (Triton), plus the
dispatch between it and the CUDA kernel of cuda_ext.py.

Stage 1: a program per (sequence, KV head, split) scores its key range for all query heads of
the KV group at once (one K/V load serves them all), forms the causal pool from the previous
tile's scores kept in registers (a `tl.gather` shift, no Toeplitz product), and accumulates
`a @ V` in fp32. Its first tile's halo, the P-1 scores left of the split, is recomputed from
those P-1 keys. Stage 2: AsyncI has no normalisation, so the partials of disjoint key ranges
simply add. A graph's split count is sized for its longest context; the splits past a shorter
sequence's last key neither compute nor write, and the sum reads only the others.

An FP8 cache is dequantised in registers by folding its static per-channel scales into the
math: s = q.(k*ks) = (q*ks).k, so q is scaled once per program, and sum_j a_j (v_j*vs) =
vs * sum_j a_j v_j, so the accumulator is scaled once at the end; K/V tiles are only cast.
Without FP8 (a constexpr) the kernels compile exactly as before."""
import functools

import torch

from asynct.ops._triton import jit as _jit, pdl_args, tl, triton, wait_for_prior
from asynct.ops.kv_cache import check_kv_cache, check_kv_scales, is_fp8
from asynct.ops.paged_ref import asynci_decode_ref

# Keys a tile. benchmarks/decode_sweep.py found no tile / warps / split rule that wins on every
# batch (32 keys: 10-15 % faster at batches of 1-8, 4-10 % slower at 128-256; RESULTS.md)
BLOCK_N = 64


@_jit
def load_kv_rows(cache_ptr, bt_row_ptr, keys, mask, kv_head, s_blk, s_tok, s_head,
                 BS: tl.constexpr, D: tl.constexpr):
    """Rows `keys` of one KV head from a paged cache [num_blocks, BS, HKV, D] of any strides
    (s_blk, s_tok, s_head; unit stride along D) -> [N, D]. Strides let vLLM's block-major
    cache [num_blocks, 2, BS, HKV, D] be read in place."""
    blk = tl.load(bt_row_ptr + keys // BS, mask=mask, other=0)
    row = blk.to(tl.int64) * s_blk + (keys % BS) * s_tok + kv_head * s_head
    d = tl.arange(0, D)
    return tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask[:, None], other=0.0)


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
def attend_keys(q, sigma, k_ptr, v_ptr, bt_row_ptr, vs_ptr, kvh, lo, hi, scale, s_blk, s_tok, s_head,
                D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                RELU: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr):
    """fp32 [M, D]: AsyncI of the query rows `q` over keys [lo, hi) of one KV head, their pool
    window reaching back into the P-1 keys before lo (the halo, recomputed; none before key 0)."""
    n = tl.arange(0, BLOCK_N)
    keys = lo - BLOCK_N + n
    kmask = (keys >= 0) & (keys >= lo - (P - 1)) & (lo < hi)
    k = load_kv_rows(k_ptr, bt_row_ptr, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    r_prev = tl.where(kmask[None, :], tl.maximum(s, 0.0) if RELU else s, 0.0)
    acc = tl.zeros([q.shape[0], D], dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        keys = j0 + n
        kmask = keys < hi
        k = load_kv_rows(k_ptr, bt_row_ptr, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D).to(q.dtype)
        v = load_kv_rows(v_ptr, bt_row_ptr, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        r = tl.where(kmask[None, :], tl.maximum(s, 0.0) if RELU else s, 0.0)
        a = tl.where(kmask[None, :], pool_gate(s, r, r_prev, sigma, P, BLOCK_N), 0.0)
        acc += tl.dot(a.to(v.dtype), v, input_precision=PREC)
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
    if CASCADE:      # keys below the shared prefix's length were done by _prefix_kernel
        start = tl.minimum(tl.load(plen_ptr), n_keys)
    per = tl.cdiv(tl.cdiv(n_keys - start, n_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per
    used = tl.maximum(tl.cdiv(n_keys - start, tl.maximum(per, 1)), 1)
    return lo, tl.minimum(lo + per, n_keys), used, start


@_jit(do_not_specialize=["sbt", "sob", "soh", "sos", "S_PRE"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, sigma_ptr, out_ptr, plen_ptr, pre_ptr, scale,
                   sqb, sqh, sbt, sob, soh, sos, s_blk, s_tok, s_head, G, S_PRE, ks_ptr, vs_ptr,
                   D: tl.constexpr, BS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                   P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr, CASCADE: tl.constexpr,
                   FP8: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    lo, hi, used, start = split_range(seq_ptr, plen_ptr, b, split, tl.num_programs(2), BLOCK_N, CASCADE)
    g = tl.arange(0, M)
    gmask = g < G
    head = kvh * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + head[:, None] * sqh + d[None, :],
                mask=gmask[:, None], other=0.0)
    q = fold_k_scale(q, ks_ptr, kvh, D, FP8)
    sigma = tl.load(sigma_ptr + head, mask=gmask, other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * sbt
    acc = attend_keys(q, sigma, k_ptr, v_ptr, bt_row, vs_ptr, kvh, lo, hi, scale, s_blk, s_tok, s_head,
                      D, BS, BLOCK_N, P, RELU, PREC, FP8)
    if CASCADE:
        if (split == 0) & (start > 0):   # the shared prefix's partials: AsyncI's partial sums simply add
            row = (b.to(tl.int64) * tl.num_programs(1) * G + head) * S_PRE
            for s_ in range(S_PRE):
                acc += tl.load(pre_ptr + (row + s_)[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    dst = out_ptr + b.to(tl.int64) * sob + head[:, None] * soh + split * sos + d[None, :]
    # splits past the last key load and add nothing (lo >= hi) and leave no partial to sum
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (split < used))


@_jit(do_not_specialize=["B", "S_PRE"])
def _prefix_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, plen_ptr, sigma_ptr, pre_ptr, scale, sqb, sqh, B,
                   s_blk, s_tok, s_head, G, S_PRE, ks_ptr, vs_ptr,
                   D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr,
                   PDL: tl.constexpr):
    """Keys [0, prefix_len) that every sequence of the batch shares (same blocks): a program
    takes BLOCK_M query rows of one KV head, from many sequences, so each prefix key is loaded
    once per row tile instead of once per sequence. Every prefix key precedes every query: no
    causal mask. Writes its split's partial to pre[b, head, split]."""
    wait_for_prior(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_keys = tl.load(plen_ptr)
    per = tl.cdiv(tl.cdiv(n_keys, S_PRE), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, n_keys)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    b = rows // G
    head = kvh * G + rows % G
    rmask = b < B
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64)[:, None] * sqb + head[:, None] * sqh + d[None, :],
                mask=rmask[:, None], other=0.0)
    q = fold_k_scale(q, ks_ptr, kvh, D, FP8)
    sigma = tl.load(sigma_ptr + head, mask=rmask, other=0.0)
    acc = attend_keys(q, sigma, k_ptr, v_ptr, bt_ptr, vs_ptr, kvh, lo, hi, scale, s_blk, s_tok, s_head,
                      D, BS, BLOCK_N, P, RELU, PREC, FP8)
    dst = pre_ptr + ((b.to(tl.int64) * tl.num_programs(1) * G + head) * S_PRE + split)[:, None] * D + d[None, :]
    # nothing to store when no prefix is shared: a graph's prefix pass then costs a launch
    tl.store(dst, acc, mask=rmask[:, None] & (n_keys > 0))


@_jit(do_not_specialize=["S"])
def _sum_splits_kernel(mid_ptr, out_ptr, seq_ptr, plen_ptr, sob, soh, S, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, LENS: tl.constexpr, CASCADE: tl.constexpr, PDL: tl.constexpr):
    """out[b, h] = the sum of its splits' fp32 partials in split order. LENS: a decode's, of
    which only the splits that held keys wrote (split_range); its lengths are read before the
    PDL wait, so the loop does not start one L2 round trip late (H200, batch 32: 12.7 against
    13.8 us a layer). Sixteen loads issued before the length was known were slower still."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    row = mid_ptr + ((b * tl.num_programs(1) + h) * S).to(tl.int64) * D + d
    used = S
    if LENS:   # host-written lengths, not the decode kernel's output: read while it finishes
        _, _, used, _ = split_range(seq_ptr, plen_ptr, b, 0, S, BLOCK_N, CASCADE)
    wait_for_prior(PDL)
    acc = tl.zeros([D], dtype=tl.float32)
    for s in range(used):   # a run-time count: one compiled kernel for every split count
        acc += tl.load(row + s * D)
    tl.store(out_ptr + b.to(tl.int64) * sob + h * soh + d, acc.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(batch, num_kv_heads, max_seq_len, sms=132):
    """Enough programs for ~3 waves of the SMs, each split at least a tile long."""
    want = triton.cdiv(3 * sms, max(1, batch * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_seq_len, BLOCK_N), 64))


def check_decode_args(q, kv_cache, block_table, seq_lens, sigma, out):
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [B, Hq, D] with unit last stride, got {tuple(q.shape)}")
    check_kv_cache(kv_cache)
    b, hq, d = q.shape
    hkv = kv_cache.shape[3]
    if kv_cache.shape[4] != d or hq % hkv:
        raise ValueError(f"q heads {hq} / head_dim {d} do not fit the cache {tuple(kv_cache.shape)}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if block_table.dim() != 2 or block_table.shape[0] < b or block_table.dtype != torch.int32:
        raise ValueError("block_table must be int32 [B, max_blocks]")
    if seq_lens.shape[0] < b or seq_lens.dtype != torch.int32:
        raise ValueError("seq_lens must be int32 [B]")
    if sigma.shape != (hq,):
        raise ValueError(f"sigma must be [{hq}]")
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with unit last stride")


def num_prefix_splits(batch, num_kv_heads, group, prefix_len, sms=132):
    """Key splits of the shared prefix: about one wave of programs, a tile each at least, 8 at
    most: every decode program adds up all the splits' partials, so more splits slow decode
    (224 gsm8k-shaped sequences: 5 splits 1.07x faster than 10, benchmarks/decode_sweep.py)."""
    tiles = triton.cdiv(batch * group, PREFIX_BLOCK_M)
    want = triton.cdiv(sms, tiles * num_kv_heads)
    return max(1, min(want, triton.cdiv(max(prefix_len, 1), BLOCK_N), 8))


PREFIX_BLOCK_M = 64
PREFIX_WARPS = 4


def asynci_decode_triton(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre,
                         out, max_seq_len=None, splits=None, prefix_len=None, prefix_splits=None,
                         block_n=BLOCK_N, num_warps=4, num_stages=2,
                         k_scale=None, v_scale=None):
    """`prefix_len` (int32 [1] on the device): the batch's sequences share the KV blocks of their
    first prefix_len keys; those are then read once per tile of sequences (cascade attention).
    `max_seq_len`, a host upper bound of the lengths, sizes both grids (graph-safe)."""
    check_decode_args(q, kv_cache, block_table, seq_lens, sigma, out)
    b, hq, d = q.shape
    _, _, bs, hkv, _ = kv_cache.shape
    if b == 0:
        return out
    sms = _sm_count(q.device.index or 0) if q.is_cuda else 132
    hint = max_seq_len or block_table.shape[1] * bs  # a host upper bound: graph-safe
    if splits is None:
        splits = num_splits(b, hkv, hint, sms)
    g = hq // hkv
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    # a pool window reaches back into one previous tile only (pool_gate), so P - 1 <= BLOCK_N
    block_n = max(block_n, triton.next_power_of_2(int(pool_size)))
    consts = dict(D=d, BS=bs, BLOCK_N=block_n, P=int(pool_size), RELU=bool(relu_pre), PREC=prec)
    sigma = sigma.float().contiguous()
    ks, vs, fp8 = scale_args(kv_cache, k_scale, v_scale, sigma)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    s_pre, pre = 0, out
    if prefix_len is not None:
        s_pre = prefix_splits or num_prefix_splits(b, hkv, g, hint, sms)
        pre = torch.empty(b, hq, s_pre, d, dtype=torch.float32, device=q.device)
        _prefix_kernel[(triton.cdiv(b * g, PREFIX_BLOCK_M), hkv, s_pre)](
            q, k_cache, v_cache, block_table, prefix_len, sigma, pre, float(scale),
            q.stride(0), q.stride(1), b, *k_cache.stride()[:3], g, s_pre, ks, vs, BLOCK_M=PREFIX_BLOCK_M,
            FP8=fp8, **consts, num_warps=PREFIX_WARPS, num_stages=num_stages, **pdl_args(q))
    dst, strides = split_output(out, splits)
    plen = prefix_len if s_pre else seq_lens
    _decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_table, seq_lens, sigma, dst, plen, pre, float(scale), q.stride(0),
        q.stride(1), block_table.stride(0), *strides, *k_cache.stride()[:3], g, s_pre, ks, vs,
        M=max(16, triton.next_power_of_2(g)), CASCADE=s_pre > 0, FP8=fp8, **consts, num_warps=num_warps,
        num_stages=num_stages, **pdl_args(q))
    return sum_splits(dst, out, splits, lens=(seq_lens, plen, block_n, s_pre > 0))


def split_output(out, splits):
    """Where a kernel split `splits` ways over keys writes, and its (row, head, split) strides:
    `out` itself for one split, else fp32 partials [rows, heads, splits, D] that `sum_splits` adds."""
    if splits == 1:
        return out, (out.stride(0), out.stride(1), 0)
    rows, hq, d = out.shape
    return (torch.empty(rows, hq, splits, d, dtype=torch.float32, device=out.device),
            (hq * splits * d, splits * d, d))


def sum_splits(dst, out, splits, lens=None):
    """AsyncI has no normalisation: the partials of disjoint key ranges add. `lens`, a decode's
    (seq_lens, prefix_len, BLOCK_N, cascade): only its splits that held keys wrote partials."""
    if splits > 1:
        seq, plen, block_n, cascade = lens or (out, out, 16, False)    # stand-ins, never read
        _sum_splits_kernel[out.shape[:2]](dst, out, seq, plen, out.stride(0), out.stride(1), splits,
                                          D=out.shape[2], BLOCK_N=block_n, LENS=lens is not None,
                                          CASCADE=cascade, num_warps=4, **pdl_args(out, lens is not None))
    return out


def asynci_decode(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                  max_seq_len=None, prefix_len=None, k_scale=None, v_scale=None, splits=None):
    """Writes AsyncI of each sequence's last token into `out` [B, Hq, D] and returns it.
    `prefix_len` is a hint (shared leading blocks, see asynci_decode_triton): ignoring it is
    always correct, so the references and the CUDA kernel do. The CUDA kernel reads no
    FP8 cache (cuda_ext.cuda_decode_supported), so the scales go to Triton and the reference only."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if not q.is_cuda:
        return asynci_decode_ref(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size,
                                 relu_pre, out, **scales)
    from asynct.ops import cuda_ext  # lazy: building the extension is only worth it on CUDA
    fn = cuda_ext.pick_decode(q, kv_cache, pool_size)
    if fn is asynci_decode_triton:
        return fn(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                  max_seq_len=max_seq_len, prefix_len=prefix_len, splits=splits, **scales)
    if fn is asynci_decode_ref:
        return fn(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out, **scales)
    return fn(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
              max_seq_len=max_seq_len, splits=splits)
