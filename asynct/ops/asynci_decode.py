"""Paged AsyncI decode: one query token per sequence, two-stage split-K (Triton), plus the
dispatch between it and the CUDA kernel of cuda_ext.py.

Stage 1: a program per (sequence, KV head, split) scores its key range for all query heads of
the KV group at once (one K/V load serves them all), forms the causal pool from the previous
tile's scores kept in registers (a `tl.gather` shift, no Toeplitz product), and accumulates
`a @ V` in fp32, each gate as its bf16 rounding plus the remainder in a query tile that holds
the group twice (gate_dot). Its first tile's halo, the P-1 scores left of the split, is
recomputed from those P-1 keys (none left of key 0). Stage 2: AsyncI has no normalisation, so
the partials of disjoint key ranges simply add. A graph's split count is sized for its longest
context; the splits past a shorter sequence's last key load no keys and store nothing, and the
sum reads only the others. Cascade (a prefix every row shares): the same launch's first programs
take the prefix for 8 query rows each (_prefix_tile), and the sum adds their partials too.

The pieces it shares with prefill (K/V row loads, FP8 scales, the pool's gate, split sums) are
in asynci_common.py."""
import functools

import torch

from asynct.ops._triton import KernelLaunch, jit as _jit, cdiv, next_power_of_2, pdl, pow2, tl, wait_for_prior
from asynct.ops.asynci_common import (MAX_PREFIX_SPLITS, attend_keys, cascade_direct, check_layer, fold_k_scale,
                                      kv_operands, layer_layout, scale_args, sm_count, split_output,
                                      split_range, sum_splits, sum_splits_launch, unstack_rows)
from asynct.ops.kv_cache import check_kv_cache
from asynct.ops.paged_ref import asynci_decode_ref

# Keys a tile. benchmarks/decode_sweep.py found no tile / warps / split rule that wins on every
# batch (32 keys: 10-15 % faster at batches of 1-8, 4-10 % slower at 128-256; RESULTS.md). One
# KV head a program: two or four side by side (one tile of 2-4 x 128 columns, each query row zero
# outside its own head's) saved pool and gate work a byte but ran at 0.34-1.04x one head's speed
# (one win in 46 shapes and launches), whole steps 0.88-0.93x (H100, branch exp-decode-heads,
# RESULTS.md)
BLOCK_N = 64
# Every variant (a shared prefix's partials, the rows in an order, bf16 or FP8 cache) takes
# 111-125 registers a thread at the compiler's will (sm_90): four programs an SM, which a program
# an SM fewer would cost 8-25 % (H200). Caps of 128 held them there while the halo tile sat
# before the loop (156-162 uncapped); they now change nothing (steps of 1-256 sequences
# 0.99-1.00x). At 96 (five an SM) the plain variant ran batch-8 steps 3 % slower
# (benchmarks/RESULTS.md).


@_jit
def _decode_row(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, sigma_ptr, out_ptr, plen_ptr, b, kvh, split, scale,
                sqb, sqh, sbt, sob, soh, sos, s_blk, s_tok, s_head, G, ks_ptr, vs_ptr, fin_ptr, sfb, sfh,
                D: tl.constexpr, BS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr, CASCADE: tl.constexpr,
                FP8: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr, ACCUMULATE: tl.constexpr):
    """One split of row b's own keys (past a shared prefix: CASCADE), all G query heads of KV head
    kvh, into out's (b, heads, split) partial."""
    # read while the kernel before finishes: the lengths are not that kernel's output (the
    # caller's contract, asynci_decode_triton). sigma may be cast by the kernel just before: after.
    lo, hi, used, _ = split_range(seq_ptr, plen_ptr, b, split, tl.num_programs(2), BLOCK_N, CASCADE)
    direct = False
    if CASCADE:
        direct = cascade_direct(plen_ptr, tl.num_programs(2))
    wait_for_prior(PDL)
    # the tile's second half of rows repeats the first's heads for the gates' remainder (gate_dot)
    g = tl.arange(0, M) % (M // 2)
    head = kvh * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + head[:, None] * sqh + d[None, :],
                mask=(g < G)[:, None], other=0.0)
    q = fold_k_scale(q, ks_ptr, kvh, D, FP8)
    sigma = tl.load(sigma_ptr + head, mask=g < G, other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * sbt
    acc = attend_keys(q, sigma, k_ptr, v_ptr, bt_row, vs_ptr, kvh, lo, hi, scale, s_blk, s_tok, s_head,
                      D, BS, BLOCK_N, P, RELU, PREC, FP8, PTX, True)
    acc = unstack_rows(acc, M, D)
    g = tl.arange(0, M // 2)
    gmask = g < G
    head = kvh * G + g
    dst = out_ptr + b.to(tl.int64) * sob + head[:, None] * soh + split * sos + d[None, :]
    # splits past the last key load and add nothing (lo >= hi) and leave no partial to sum
    mask = gmask[:, None] & (split < used)
    if ACCUMULATE:  # into the caller's zeroed fp32 sums, in whatever order the splits finish
        tl.atomic_add(dst, acc, mask=mask, sem="relaxed")
    elif direct:    # as the sum would: 0.0 + acc (a -0.0 becomes +0.0), rounded once
        fin = fin_ptr + b.to(tl.int64) * sfb + head[:, None] * sfh + d[None, :]
        tl.store(fin, (acc + 0.0).to(fin_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _prefix_rows(p, kvh, B, G, S_PRE, M: tl.constexpr, N: tl.constexpr):
    """Batch rows, heads and mask of prefix tile p's M / 2 query rows: N = M holds them twice
    over (the gates' remainder, as _decode_row's), N = M / 2 once."""
    rows = (p // S_PRE) * (M // 2) + tl.arange(0, N) % (M // 2)
    b = rows // G
    return b, kvh * G + rows % G, b < B


@_jit
def _prefix_tile(q_ptr, k_ptr, v_ptr, bt_ptr, plen_ptr, sigma_ptr, pre_ptr, p, kvh, B, HKV, scale, sqb, sqh,
                 s_blk, s_tok, s_head, G, S_PRE, ks_ptr, vs_ptr,
                 D: tl.constexpr, BS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                 P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr,
                 PTX: tl.constexpr, PDL: tl.constexpr):
    """Split p % S_PRE of the keys [0, prefix_len) that every row shares (row 0's blocks), for
    M / 2 query rows (row, head) of KV head kvh, from M / 2G rows of the batch: each prefix key
    is loaded once per M / 2 query rows instead of once per row. Every prefix key precedes every
    query: no causal mask. Writes pre[row, head, split]; nothing where no prefix is shared."""
    split = p % S_PRE
    lo, hi, _, _ = split_range(plen_ptr, plen_ptr, 0, split, S_PRE, BLOCK_N, False)
    if hi > 0:      # hi is 0 exactly when no prefix is shared: a graph's empty pass exits here
        wait_for_prior(PDL)
        b, head, rmask = _prefix_rows(p, kvh, B, G, S_PRE, M, M)
        d = tl.arange(0, D)
        # int32 offsets: a decode batch's q is far below 2**31 elements, and int64 ones held 33
        # more registers a thread through the key loop (148: three programs an SM; sm_90)
        q = tl.load(q_ptr + (b * sqb + head * sqh)[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
        q = fold_k_scale(q, ks_ptr, kvh, D, FP8)
        sigma = tl.load(sigma_ptr + head, mask=rmask, other=0.0)
        acc = attend_keys(q, sigma, k_ptr, v_ptr, bt_ptr, vs_ptr, kvh, lo, hi, scale, s_blk, s_tok, s_head,
                          D, BS, BLOCK_N, P, RELU, PREC, FP8, PTX, True)
        acc = unstack_rows(acc, M, D)
        b, head, rmask = _prefix_rows(p, kvh, B, G, S_PRE, M, M // 2)
        dst = pre_ptr + ((b * HKV * G + head) * S_PRE + split)[:, None] * D + d[None, :]
        tl.store(dst, acc, mask=rmask[:, None])


@_jit(do_not_specialize=["sbt", "sob", "soh", "sos", "N_PRE", "S_PRE", "sfb", "sfh"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, sigma_ptr, out_ptr, plen_ptr, pre_ptr, order_ptr, scale,
                   sqb, sqh, sbt, sob, soh, sos, s_blk, s_tok, s_head, G, N_PRE, S_PRE, ks_ptr, vs_ptr,
                   fin_ptr, sfb, sfh,
                   D: tl.constexpr, BS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                   P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr, CASCADE: tl.constexpr,
                   FP8: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr, ACCUMULATE: tl.constexpr,
                   ORDERED: tl.constexpr):
    """Grid (rows, KV heads, splits), or (KV heads, rows, splits) ORDERED. CASCADE: the first
    N_PRE programs along the rows take the shared prefix's tiles (_prefix_tile, at split 0
    only), the others the rows' own keys: one launch, so no kernel boundary sits between the
    prefix and the rows (a pass of its own before the decode cost graphs of 16+ rows 4-6 us a
    layer when nothing was shared; H200, benchmarks/RESULTS.md)."""
    r = tl.program_id(1) if ORDERED else tl.program_id(0)
    kvh = tl.program_id(0) if ORDERED else tl.program_id(1)
    split = tl.program_id(2)
    prefix_tile = False
    if CASCADE:     # a constexpr: the other variants compile no prefix tile
        prefix_tile = r < N_PRE
    if prefix_tile:
        if split == 0:
            n_rows = tl.num_programs(1 if ORDERED else 0) - N_PRE
            _prefix_tile(q_ptr, k_ptr, v_ptr, bt_ptr, plen_ptr, sigma_ptr, pre_ptr, r, kvh, n_rows,
                         tl.num_programs(0 if ORDERED else 1), scale, sqb, sqh, s_blk, s_tok, s_head, G, S_PRE,
                         ks_ptr, vs_ptr, D, BS, M, BLOCK_N, P, RELU, PREC, FP8, PTX, PDL)
    else:
        i = r - N_PRE   # N_PRE is 0 without CASCADE
        # ORDERED: the caller's order of the rows (a host-written step input), a row's KV heads side by side
        b = tl.load(order_ptr + i) if ORDERED else i
        _decode_row(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, sigma_ptr, out_ptr, plen_ptr, b, kvh, split, scale,
                    sqb, sqh, sbt, sob, soh, sos, s_blk, s_tok, s_head, G, ks_ptr, vs_ptr, fin_ptr, sfb, sfh,
                    D, BS, M, BLOCK_N, P, RELU, PREC, CASCADE, FP8, PTX, PDL, ACCUMULATE)


def num_splits(batch, num_kv_heads, max_seq_len, sms=132):
    """Enough programs for ~3 waves of the SMs, each split at least a tile long."""
    want = cdiv(3 * sms, max(1, batch * num_kv_heads))
    return max(1, min(want, cdiv(max_seq_len, BLOCK_N), 64))


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


def num_prefix_splits(batch, num_kv_heads, group, prefix_len, rows=16, sms=132, splits=1):
    """Key splits of the shared prefix: about one wave of prefix tiles (`rows` query rows each),
    a key tile each at least, 8 at most (the split sum adds every split's partials); one where
    the rows' own programs (`splits` a row) fill 1.5 waves of four an SM, whose time the
    unsplit prefix tiles, launched first, then span. H200, rows of 880-1,010 keys with 688
    shared, us a layer by prefix splits 1/2/4/8: 224 rows 48.1/53.2/53.6/55.4 (this rule's 1),
    128 rows 35.0/35.3/31.5/33.7 (3), 64 rows 24.7/19.0/20.1/19.5 (5), 32 rows 22.0/16.0/
    13.1/13.4 (8), 16 rows 20.3/14.3/11.2/10.2 (8; benchmarks/RESULTS.md)."""
    if batch * num_kv_heads * splits >= 6 * sms:
        return 1
    tiles = cdiv(batch * group, rows)
    want = cdiv(sms, tiles * num_kv_heads)
    return max(1, min(want, cdiv(max(prefix_len, 1), BLOCK_N), MAX_PREFIX_SPLITS))


class DecodeLaunch:
    """A decode planned once for a step's rows, launched by every layer: the argument checks,
    split counts, grid and split partials follow the rows, not the layer (a mixed step's eager
    attention recomputed them 35 times: benchmarks/RESULTS.md). A layer's call names only its
    own tensors, which must be shaped as the plan's (`check_layer`). The partials serve every
    layer in turn: a layer's sum has read them before the next layer's decode writes (stream
    order; with programmatic dependent launch, the decode writes only after its wait)."""

    def __init__(self, q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                 max_seq_len=None, splits=None, prefix_len=None, prefix_splits=None, block_n=BLOCK_N,
                 num_warps=4, num_stages=2, accumulate=False, order=None):
        check_decode_args(q, kv_cache, block_table, seq_lens, sigma, out, order)
        if prefix_splits is not None and not 1 <= prefix_splits <= MAX_PREFIX_SPLITS:
            raise ValueError(f"prefix_splits must be 1-{MAX_PREFIX_SPLITS}, got {prefix_splits}")
        if accumulate and out.dtype != torch.float32:
            raise ValueError(f"an accumulating decode adds into fp32 sums, got out of {out.dtype}")
        self.layout = layer_layout(q, kv_cache, out)
        b, hq, d = q.shape
        _, _, bs, hkv, _ = kv_cache.shape
        self.rows = b
        if b == 0:
            return
        sms = sm_count(q)
        hint = max_seq_len or block_table.shape[1] * bs  # a host upper bound: graph-safe
        splits = splits or num_splits(b, hkv, hint, sms)
        g = hq // hkv
        # a pool window reaches back into one previous tile only (pool_gate), so P - 1 <= BLOCK_N
        block_n = max(block_n, next_power_of_2(int(pool_size)))
        m = max(16, next_power_of_2(2 * g))    # the rows twice over (_decode_row)
        cascade = prefix_len is not None and not accumulate   # a hint: an accumulating decode reads every key
        s_pre = n_pre = 0
        if cascade:     # the prefix tiles' programs first, then the rows'; their partials for the sum
            s_pre = prefix_splits or num_prefix_splits(b, hkv, g, hint, m // 2, sms, splits)
            n_pre = cdiv(b * g, m // 2) * s_pre
        pre = split_output(q, s_pre, partials=True)[0] if cascade else None
        # accumulating: straight into out; cascade: partials even for one split, for the sum to add pre
        self.splits = 1 if accumulate else splits
        self.partials = None
        if self.splits > 1 or cascade:
            self.partials, self.partial_strides = split_output(out, self.splits, partials=cascade)
        plen = prefix_len if cascade else seq_lens
        ordered = order is not None
        self.grid = (hkv, n_pre + b, splits) if ordered else (n_pre + b, hkv, splits)
        self.rows_args = (block_table, seq_lens)
        self.after = (plen, pre, order if ordered else seq_lens, float(scale))
        self.ints = (block_table.stride(0), g, n_pre, s_pre)
        on = pdl(q)
        self.consts = dict(M=m, CASCADE=cascade, D=d, BS=bs, BLOCK_N=block_n, P=int(pool_size),
                           RELU=bool(relu_pre), PREC="ieee" if q.dtype == torch.float32 else "tf32",
                           ACCUMULATE=accumulate, ORDERED=ordered, PDL=on)
        self.decode = KernelLaunch(_decode_kernel, self.grid, num_warps=num_warps, num_stages=num_stages,
                                   launch_pdl=on)
        self.lens = (seq_lens, plen, block_n, cascade)
        self.sum = None if self.partials is None else sum_splits_launch(out)

    def __call__(self, q, kv_cache, sigma, out, k_scale=None, v_scale=None):
        """This layer's decode into `out` (added, if the plan accumulates); returns `out`."""
        if self.rows == 0:
            return out
        check_layer(self.layout, q, kv_cache, out)
        sigma = sigma.float().contiguous()
        ks, vs, fp8 = scale_args(kv_cache, k_scale, v_scale, sigma)
        k_cache, v_cache, kv_strides, ptx = kv_operands(kv_cache, fp8)
        dst, strides = (out, (out.stride(0), out.stride(1), 0)) if self.partials is None else \
            (self.partials, self.partial_strides)
        plen, pre, order, scale = self.after
        sbt, g, n_pre, s_pre = self.ints
        self.decode(
            q, k_cache, v_cache, *self.rows_args, sigma, dst, plen,
            dst if pre is None else pre, order, scale, q.stride(0), q.stride(1), sbt, *strides, *kv_strides,
            g, n_pre, s_pre, ks, vs, out, out.stride(0), out.stride(1), FP8=fp8, PTX=ptx, **self.consts)
        return out if self.partials is None else sum_splits(dst, out, self.splits, self.lens, pre, self.sum)


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
    and sum kernels read them before waiting for that kernel.
    One call plans and launches; a caller with many layers of the same rows keeps the plan
    (DecodeLaunch) and launches it a layer."""
    plan = DecodeLaunch(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                        max_seq_len, splits, prefix_len, prefix_splits, block_n, num_warps, num_stages,
                        accumulate, order)
    return plan(q, kv_cache, sigma, out, k_scale, v_scale)


def decode_launch(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                  max_seq_len=None, prefix_len=None, splits=None, accumulate=False, order=None):
    """A step's decode as a layer's launch, `launch(q, kv_cache, sigma, out, k_scale, v_scale)`:
    planned once (DecodeLaunch) where the Triton kernel serves; elsewhere the kernel or the
    reference, called a layer with the step's rows. The arguments as asynci_decode's, the layer's
    own (q, cache, sigma, out) the first layer's."""
    fn = asynci_decode_ref
    if q.is_cuda:
        from asynct.ops import cuda_ext  # lazy: building the extension is only worth it on CUDA
        fn = cuda_ext.pick_decode(q, kv_cache, pool_size)
    if fn is asynci_decode_triton:
        return DecodeLaunch(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                            max_seq_len=max_seq_len, splits=splits, prefix_len=prefix_len, accumulate=accumulate,
                            order=order)
    return functools.partial(_unplanned, fn, (block_table, seq_lens), (scale, pool_size, relu_pre),
                             dict(max_seq_len=max_seq_len, splits=splits), accumulate)


def _unplanned(fn, rows, consts, options, accumulate, q, kv_cache, sigma, out, k_scale=None, v_scale=None):
    """The reference's or the CUDA kernel's decode of one layer. They write: their output is added
    where the step accumulates (the reference's in fp32, the CUDA kernel's in q's dtype). The
    CUDA kernel reads no FP8 cache (cuda_ext.cuda_decode_supported): the scales go to the
    reference only; it takes no split count."""
    dst = torch.empty_like(out if fn is asynci_decode_ref else q) if accumulate else out
    if fn is asynci_decode_ref:
        fn(q, kv_cache, *rows, sigma, *consts, dst, k_scale=k_scale, v_scale=v_scale)
    else:
        fn(q, kv_cache, *rows, sigma, *consts, dst, **options)
    return out.add_(dst) if accumulate else out


def asynci_decode(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                  max_seq_len=None, prefix_len=None, k_scale=None, v_scale=None, splits=None,
                  accumulate=False, order=None):
    """Writes AsyncI of each sequence's last token into `out` [B, Hq, D] and returns it; with
    `accumulate`, adds it into `out` (fp32 sums, see asynci_decode_triton).
    `prefix_len` and `order` are hints (shared leading blocks, the rows' order: see
    asynci_decode_triton): ignoring them is always correct, so the references and the CUDA
    kernel do."""
    launch = decode_launch(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                           max_seq_len, prefix_len, splits, accumulate, order)
    return launch(q, kv_cache, sigma, out, k_scale, v_scale)
