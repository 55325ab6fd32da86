"""Paged AsyncI decode: one query token per sequence, two-stage split-K (Triton), plus the
dispatch between it and the CUDA kernel of cuda_ext.py.

Stage 1: a program per (sequence, KV head, split) scores its key range for all query heads of
the KV group at once (one K/V load serves them all), forms the causal pool from the previous
tile's scores kept in registers (a `tl.gather` shift, no Toeplitz product), and accumulates
`a @ V` in fp32. Its first tile's halo, the P-1 scores left of the split, is recomputed from
those P-1 keys (none left of key 0). Stage 2: AsyncI has no normalisation, so the partials of
disjoint key ranges simply add. A graph's split count is sized for its longest context; the
splits past a shorter sequence's last key load no keys and store nothing, and the sum reads
only the others.

The pieces it shares with prefill (K/V row loads, FP8 scales, the pool's gate, split sums) are
in asynci_common.py."""
import torch

from asynct.ops._triton import jit as _jit, pdl_args, pow2, tl, triton, wait_for_prior
from asynct.ops.asynci_common import (attend_keys, fold_k_scale, kv_operands, scale_args, sm_count,
                                      split_output, split_range, sum_splits)
from asynct.ops.kv_cache import check_kv_cache
from asynct.ops.paged_ref import asynci_decode_ref

# Keys a tile. benchmarks/decode_sweep.py found no tile / warps / split rule that wins on every
# batch (32 keys: 10-15 % faster at batches of 1-8, 4-10 % slower at 128-256; RESULTS.md)
BLOCK_N = 64
# Every variant (a shared prefix's partials, the rows in an order, bf16 or FP8 cache) takes
# 110-128 registers a thread at the compiler's will (sm_90): four programs an SM, which a program
# an SM fewer would cost 8-25 % (H200). Caps of 128 held them there while the halo tile sat
# before the loop (156-162 uncapped); they now change nothing (steps of 1-256 sequences
# 0.99-1.00x). At 96 (five an SM) the plain variant ran batch-8 steps 3 % slower
# (benchmarks/RESULTS.md).


@_jit(do_not_specialize=["sbt", "sob", "soh", "sos", "S_PRE"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, sigma_ptr, out_ptr, plen_ptr, pre_ptr, order_ptr, scale,
                   sqb, sqh, sbt, sob, soh, sos, s_blk, s_tok, s_head, G, S_PRE, ks_ptr, vs_ptr,
                   D: tl.constexpr, BS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                   P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr, CASCADE: tl.constexpr,
                   FP8: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr, ACCUMULATE: tl.constexpr,
                   ORDERED: tl.constexpr):
    if ORDERED:     # the caller's order of the rows (a host-written step input), a row's KV heads side by side
        b = tl.load(order_ptr + tl.program_id(1))
        kvh = tl.program_id(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    # read while the kernel before finishes: the lengths are not that kernel's output (the
    # caller's contract, asynci_decode_triton). sigma may be cast by the kernel just before: after.
    lo, hi, used, start = split_range(seq_ptr, plen_ptr, b, split, tl.num_programs(2), BLOCK_N, CASCADE)
    wait_for_prior(PDL)
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
                      D, BS, BLOCK_N, P, RELU, PREC, FP8, PTX, HALO_BRANCH=True)
    if CASCADE:
        if (split == 0) & (start > 0):   # the shared prefix's partials: AsyncI's partial sums simply add
            row = (b.to(tl.int64) * tl.num_programs(0 if ORDERED else 1) * G + head) * S_PRE
            for s_ in range(S_PRE):
                acc += tl.load(pre_ptr + (row + s_)[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    dst = out_ptr + b.to(tl.int64) * sob + head[:, None] * soh + split * sos + d[None, :]
    # splits past the last key load and add nothing (lo >= hi) and leave no partial to sum
    mask = gmask[:, None] & (split < used)
    if ACCUMULATE:  # into the caller's zeroed fp32 sums, in whatever order the splits finish
        tl.atomic_add(dst, acc, mask=mask, sem="relaxed")
    else:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@_jit(do_not_specialize=["B", "S_PRE"])
def _prefix_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, plen_ptr, sigma_ptr, pre_ptr, scale, sqb, sqh, B,
                   s_blk, s_tok, s_head, G, S_PRE, ks_ptr, vs_ptr,
                   D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr,
                   PTX: tl.constexpr, PDL: tl.constexpr):
    """Keys [0, prefix_len) that every sequence of the batch shares (same blocks): a program
    takes BLOCK_M query rows of one KV head, from many sequences, so each prefix key is loaded
    once per row tile instead of once per sequence. Every prefix key precedes every query: no
    causal mask. Writes its split's partial to pre[b, head, split]."""
    wait_for_prior(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    lo, hi, _, _ = split_range(plen_ptr, plen_ptr, 0, split, S_PRE, BLOCK_N, False)

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
                      D, BS, BLOCK_N, P, RELU, PREC, FP8, PTX, HALO_BRANCH=False)
    dst = pre_ptr + ((b.to(tl.int64) * tl.num_programs(1) * G + head) * S_PRE + split)[:, None] * D + d[None, :]
    # nothing to store when no prefix is shared (hi is 0 exactly then): a graph's prefix pass
    # then costs a launch
    tl.store(dst, acc, mask=rmask[:, None] & (hi > 0))


def num_splits(batch, num_kv_heads, max_seq_len, sms=132):
    """Enough programs for ~3 waves of the SMs, each split at least a tile long."""
    want = triton.cdiv(3 * sms, max(1, batch * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_seq_len, BLOCK_N), 64))


def check_decode_args(q, kv_cache, block_table, seq_lens, sigma, out, order=None):
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [B, Hq, D] with unit last stride, got {tuple(q.shape)}")
    check_kv_cache(kv_cache)
    b, hq, d = q.shape
    hkv = kv_cache.shape[3]
    if kv_cache.shape[4] != d or hq % hkv:
        raise ValueError(f"q heads {hq} / head_dim {d} do not fit the cache {tuple(kv_cache.shape)}")
    if not pow2(d) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if block_table.dim() != 2 or block_table.shape[0] < b or block_table.dtype != torch.int32:
        raise ValueError("block_table must be int32 [B, max_blocks]")
    if seq_lens.shape[0] < b or seq_lens.dtype != torch.int32:
        raise ValueError("seq_lens must be int32 [B]")
    if sigma.shape != (hq,):
        raise ValueError(f"sigma must be [{hq}]")
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with unit last stride")
    if order is not None and (order.shape != (b,) or order.dtype != torch.int32 or not order.is_contiguous()):
        raise ValueError(f"order must be a contiguous int32 ({b},) permutation of the rows, got "
                         f"{tuple(order.shape)} {order.dtype}")


def num_prefix_splits(batch, num_kv_heads, group, prefix_len, sms=132):
    """Key splits of the shared prefix: about one wave of programs, a tile each at least, 8 at
    most: every decode program adds up all the splits' partials, so more splits slow decode
    (224 gsm8k-shaped sequences: 5 splits 1.07x faster than 10, benchmarks/decode_sweep.py)."""
    tiles = triton.cdiv(batch * group, PREFIX_BLOCK_M)
    want = triton.cdiv(sms, tiles * num_kv_heads)
    return max(1, min(want, triton.cdiv(max(prefix_len, 1), BLOCK_N), 8))


PREFIX_BLOCK_M = 64
PREFIX_WARPS = 4


def _prefix_pass(q, kv, hkv, block_table, prefix_len, sigma, scale, fp8_args, s_pre, consts, num_stages):
    """The shared prefix's fp32 partials [B, Hq, s_pre, D] (_prefix_kernel); `kv` from kv_operands."""
    (b, hq, d), g = q.shape, q.shape[1] // hkv
    (k_cache, v_cache, kv_strides, ptx), (ks, vs, fp8) = kv, fp8_args
    pre = torch.empty(b, hq, s_pre, d, dtype=torch.float32, device=q.device)
    _prefix_kernel[(triton.cdiv(b * g, PREFIX_BLOCK_M), hkv, s_pre)](
        q, k_cache, v_cache, block_table, prefix_len, sigma, pre, float(scale), q.stride(0), q.stride(1),
        b, *kv_strides, g, s_pre, ks, vs, BLOCK_M=PREFIX_BLOCK_M, FP8=fp8, PTX=ptx, **consts,
        num_warps=PREFIX_WARPS, num_stages=num_stages, **pdl_args(q))
    return pre


def asynci_decode_triton(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre,
                         out, max_seq_len=None, splits=None, prefix_len=None, prefix_splits=None,
                         block_n=BLOCK_N, num_warps=4, num_stages=2,
                         k_scale=None, v_scale=None, accumulate=False, order=None):
    """`order` (int32 [B] on the device, a permutation of the rows): the order in which the
    programs take the rows, each row's KV heads side by side (grid (KV head, row, split)).
    Longest first, a batch of uneven lengths ends with the short rows filling the SMs rather
    than a few long ones running alone (H200, rows of 100-2,048 keys: 256 rows 1.22-1.34x
    faster, 96-192 1.10-1.21x, 64 1.08x; a row's heads apart, 1.14x at 256; equal lengths: no
    change). Read before the PDL wait, as `seq_lens` is.
    `accumulate`: every split adds its fp32 partial into `out` (fp32, zeroed by the caller) by
    relaxed atomics, so no partials are kept and no sum kernel runs (one kernel boundary fewer
    a layer: the engine's batch-1 decode, attention/triton_backend.py); the order of the adds
    varies, so the last bits may differ from run to run.
    `prefix_len` (int32 [1] on the device): the batch's sequences share the KV blocks of their
    first prefix_len keys; those are then read once per tile of sequences (cascade attention).
    `max_seq_len`, a host upper bound of the lengths, sizes both grids (graph-safe).
    `seq_lens` and `prefix_len` must not be written by the kernel launched just before this call
    (copied in from the host, or filled earlier): with programmatic dependent launch the decode
    and sum kernels read them before waiting for that kernel."""
    check_decode_args(q, kv_cache, block_table, seq_lens, sigma, out, order)
    if accumulate and out.dtype != torch.float32:
        raise ValueError(f"an accumulating decode adds into fp32 sums, got out of {out.dtype}")
    b, hq, d = q.shape
    _, _, bs, hkv, _ = kv_cache.shape
    if b == 0:
        return out
    sms = sm_count(q)
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
    kv = kv_operands(kv_cache, fp8)
    k_cache, v_cache, kv_strides, ptx = kv
    s_pre, pre = 0, out
    if prefix_len is not None:
        s_pre = prefix_splits or num_prefix_splits(b, hkv, g, hint, sms)
        pre = _prefix_pass(q, kv, hkv, block_table, prefix_len, sigma, scale, (ks, vs, fp8), s_pre, consts,
                           num_stages)
    dst, strides = split_output(out, 1 if accumulate else splits)   # accumulating: straight into out
    plen = prefix_len if s_pre else seq_lens
    ordered = order is not None
    _decode_kernel[(hkv, b, splits) if ordered else (b, hkv, splits)](
        q, k_cache, v_cache, block_table, seq_lens, sigma, dst, plen, pre, order if ordered else seq_lens,
        float(scale), q.stride(0), q.stride(1), block_table.stride(0), *strides, *kv_strides, g, s_pre, ks, vs,
        M=max(16, triton.next_power_of_2(g)), CASCADE=s_pre > 0, FP8=fp8, PTX=ptx, **consts, num_warps=num_warps,
        num_stages=num_stages, ACCUMULATE=accumulate, ORDERED=ordered, **pdl_args(q))
    return out if accumulate else sum_splits(dst, out, splits, (seq_lens, plen, block_n, s_pre > 0))


def asynci_decode(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                  max_seq_len=None, prefix_len=None, k_scale=None, v_scale=None, splits=None,
                  accumulate=False, order=None):
    """Writes AsyncI of each sequence's last token into `out` [B, Hq, D] and returns it; with
    `accumulate`, adds it into `out` (fp32 sums, see asynci_decode_triton).
    `prefix_len` and `order` are hints (shared leading blocks, the rows' order: see
    asynci_decode_triton): ignoring them is always correct, so the references and the CUDA
    kernel do. The CUDA kernel reads no FP8 cache (cuda_ext.cuda_decode_supported), so the
    scales go to Triton and the reference only."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    fn = asynci_decode_ref
    if q.is_cuda:
        from asynct.ops import cuda_ext  # lazy: building the extension is only worth it on CUDA
        fn = cuda_ext.pick_decode(q, kv_cache, pool_size)
    if fn is asynci_decode_triton:
        return fn(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                  max_seq_len=max_seq_len, prefix_len=prefix_len, splits=splits, accumulate=accumulate,
                  order=order, **scales)
    # the others write: their output is added (the reference's in fp32, the CUDA kernel's in q's dtype)
    dst = torch.empty_like(out if fn is asynci_decode_ref else q) if accumulate else out
    if fn is asynci_decode_ref:
        fn(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, dst, **scales)
    else:
        fn(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, dst,
           max_seq_len=max_seq_len, splits=splits)
    return out.add_(dst) if accumulate else out
