"""Paged AsyncI prefill over variable-length query chunks (Triton).

A program owns BLOCK_Q query tokens x the G query heads of one KV head (M = BLOCK_Q*G rows,
so one K/V tile load serves the whole GQA group) and walks the key tiles left to right up to
its last query's position: the tiles wholly above the causal diagonal are never visited. The
pool's left halo comes from the previous tile's scores, as their product with the band, still in
registers; at key 0 it is zero. A chunk's queries are the last q_len of its sequence's keys, so
cached prefixes (prefix hits, earlier chunks) are just keys left of the chunk. An FP8 cache is
dequantised by folding its scales into q and the accumulator, as in asynci_decode.

Short prompts give few programs (one 512-token prompt: 32 for 132 SMs), so the launch plan
(`plan_prefill`) takes smaller query tiles and, if that is still too few, splits each query
tile's key range over programs: AsyncI has no normalisation, so the partials of disjoint key
ranges add (fp32, summed by asynci_common.sum_all_splits). A split recomputes the pool's halo,
the P-1 scores left of its first key, as the decode kernel does."""
import torch

from asynct.ops._triton import KernelLaunch, jit as _jit, cdiv, next_power_of_2, pow2, tl, triton
from asynct.ops.asynci_common import (apply_v_scale, check_layer, fold_k_scale, gate_dot, kv_row_offsets,
                                      layer_layout, load_kv_rows, load_rows, scale_args, sm_count, split_output,
                                      split16, sum_all_splits, sum_all_splits_launch)
# the plan, re-exported where benchmarks and tests have always found it
from asynct.ops.asynci_prefill_plan import (MAX_SPLITS, PREFILL_CONFIGS, _block_m,  # noqa: F401
                                            _slice_keys, key_config, plan_prefill, seqs_per_group)
from asynct.ops.kv_cache import check_kv_cache
from asynct.ops.paged_ref import asynci_prefill_ref


@_jit
def _band(BLOCK_N: tl.constexpr, P: tl.constexpr, PREV: tl.constexpr, dtype: tl.constexpr):
    """0/1 matrix F with (r @ F)[j] = sum of r over the pool window of key j: F[i, j] = 1 when
    key i of this tile (PREV: of the tile before) lies in j-P+1..j."""
    i = tl.arange(0, BLOCK_N)[:, None]
    j = tl.arange(0, BLOCK_N)[None, :]
    if PREV:
        band = i - BLOCK_N >= j - (P - 1)
    else:
        band = (j - i >= 0) & (j - i <= P - 1)
    return tl.where(band, 1.0, 0.0).to(dtype)


@_jit
def _pool_operand(r, dtype: tl.constexpr):
    """r as the band products' operand, a (hi, lo) pair: for fp32 inputs r itself (its products
    "tf32x3", ~22 bits on the tensor cores) and zeros, else its fp16 rounding and what that
    rounding left out. One fp16 rounding put up to 5.6x the output's own bf16 rounding on the
    kernel's error where scores reach ~20 with relu off (the pool is then of raw scores, and
    sigma * pool cancels against s to leave a gate in 0..1). Scores past 2^15 are not real ones."""
    return split16(tl.minimum(tl.maximum(r, -32768.0), 32768.0), dtype)


@_jit
def _band_dot(hi, lo, f, lp):
    """lp + (hi + lo) @ f for a pool operand pair and a 0/1 band f: exact products, fp32 sums."""
    lp = tl.dot(hi, f, lp, input_precision="tf32x3")
    if f.dtype != tl.float32:
        lp = tl.dot(lo, f, lp)
    return lp


@_jit
def _tile(q, k_ptr, v_ptr, bt_row, rows, j0, hi, pos, sigma, acc, lp_next, f_cur, f_prev, kvh,
          s_blk, s_tok, s_head, scale, BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
          P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
    """One key tile at j0, whose cache rows the tile before found (`rows`), whose first pool
    sums the tile before began (`lp_next`); returns the new acc, what this tile's keys add to
    the next tile's pool sums and the next tile's rows. Found in the same iteration, the K/V
    loads waited on a block-table load of their own, and the pipeliner kept two buffers at most
    whatever num_stages said (sm_90 compiles: three and four with the rows carried)."""
    keys = j0 + tl.arange(0, BLOCK_N)
    kmask = keys < hi
    k = load_rows(k_ptr, rows, kmask, D).to(q.dtype)
    v = load_rows(v_ptr, rows, kmask, D).to(q.dtype)
    rows = kv_row_offsets(bt_row, keys + BLOCK_N, keys + BLOCK_N < hi, kvh, s_blk, s_tok, s_head, BS)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    r = tl.maximum(s, 0.0) if RELU else s
    if MASKED:  # keys past a query's position pool as zeros (only later keys read them)
        valid = kmask[None, :] & (keys[None, :] <= pos[:, None])
        r = tl.where(valid, r, 0.0)
    # The pool as products with 0/1 bands on the tensor cores: 1.7x faster at 8K tokens than
    # shifting r through tl.gather (shared-memory round trips). r goes in as an fp16 hi + lo pair.
    r, r_lo = _pool_operand(r, f_cur.dtype)
    lp = _band_dot(r, r_lo, f_cur, lp_next)
    if P > 1:
        lp_next = _band_dot(r, r_lo, f_prev, tl.zeros_like(s))
    a = tl.minimum(tl.maximum(s - sigma[:, None] * (lp / P), 0.0), 1.0)
    if MASKED:
        a = tl.where(valid, a, 0.0)
    return gate_dot(a, v, acc, PREC, False), lp_next, rows


@_jit
def _halo(q, k_ptr, bt_row, lo, kvh, s_blk, s_tok, s_head, scale, BS: tl.constexpr, D: tl.constexpr,
          BLOCK_N: tl.constexpr, P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr,
          POOL_T: tl.constexpr):
    """r of the P-1 keys left of `lo` as the previous tile's pool operand pair; the rest of
    that tile is zero. Queries before those keys never use them (their gates are masked)."""
    keys = lo - BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = (keys >= 0) & (keys >= lo - (P - 1))
    k = load_kv_rows(k_ptr, bt_row, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    r = tl.where(kmask[None, :], tl.maximum(s, 0.0) if RELU else s, 0.0)
    return _pool_operand(r, POOL_T)


@_jit(do_not_specialize=["sbt", "S", "B", "QT"], do_not_specialize_on_alignment=["bt_ptr", "seq_ptr"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_ptr, sigma_ptr, out_ptr, scale,
                    sqt, sqh, sot, soh, sos, sbt, s_blk, s_tok, s_head, G, S, B, QT, ks_ptr, vs_ptr,
                    D: tl.constexpr, BS: tl.constexpr, G_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                    RELU: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr):
    # groups of num_programs(0) sequences (whose K/V fits in L2) one after another; in a group
    # the query tiles (QT) on the slowest axis, longest walks first: the group's long tiles of
    # every sequence and head start before its short ones, which fill the last wave
    qt = QT - 1 - tl.program_id(2) % QT
    b = tl.program_id(2) // QT * tl.num_programs(0) + tl.program_id(0)
    kvh = tl.program_id(1) // S
    split = tl.program_id(1) % S   # S > 1: this program's share of the keys, out_ptr fp32 partials
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    seq = b < B        # the last group may be short: its other programs walk nothing
    b = tl.minimum(b, B - 1)
    q0 = tl.load(qsl_ptr + b)
    q_len = tl.where(seq, tl.load(qsl_ptr + b + 1) - q0, 0)
    n_keys = tl.load(seq_ptr + b)
    ctx = n_keys - q_len  # keys before this chunk

    rows = tl.arange(0, BLOCK_M)
    tok = qt * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    rmask = (tok < q_len) & (g < G)
    head = kvh * G + g
    pos = ctx + tok
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (q0 + tok).to(tl.int64)[:, None] * sqt + head[:, None] * sqh + d[None, :],
                mask=rmask[:, None], other=0.0)
    q = fold_k_scale(q, ks_ptr, kvh, D, FP8)
    sigma = tl.load(sigma_ptr + head, mask=rmask, other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * sbt
    # this tile's last query sees keys up to ctx + its last token; empty tiles loop zero times
    live = qt * BLOCK_Q < q_len
    hi = tl.where(live, ctx + tl.minimum(qt * BLOCK_Q + BLOCK_Q, q_len), 0)
    # tiles wholly at or below the first query's position need no causal mask
    full = tl.where(live, (ctx + qt * BLOCK_Q + 1) // BLOCK_N * BLOCK_N, 0)
    # splits are equal whole-tile slices of the sequence's keys, so that no program of any
    # query tile walks more than one slice; slices past a tile's last key just store zeros
    per = tl.cdiv(tl.cdiv(n_keys, S), BLOCK_N) * BLOCK_N
    lo = split * per
    end = tl.minimum(lo + per, hi)

    POOL_T: tl.constexpr = tl.float32 if q.dtype == tl.float32 else tl.float16
    f_cur = _band(BLOCK_N, P, False, POOL_T)
    f_prev = _band(BLOCK_N, P, True, POOL_T)
    # what the tile before adds to this tile's first P-1 pool sums, carried as that product rather
    # than as the tile's operand pair: 172 registers against 206 (sm_90, 64x32 tiles)
    lp_next = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if P > 1:
        if (lo > 0) & (lo < end):
            h, h_lo = _halo(q, k_ptr, bt_row, lo, kvh, s_blk, s_tok, s_head, scale, BS, D,
                            BLOCK_N, P, RELU, PREC, POOL_T)
            lp_next = _band_dot(h, h_lo, f_prev, lp_next)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    # the two loops' tiles are consecutive (lo and full are whole tiles): the rows carry over
    keys = lo + tl.arange(0, BLOCK_N)
    rows = kv_row_offsets(bt_row, keys, keys < hi, kvh, s_blk, s_tok, s_head, BS)
    for j0 in range(lo, tl.minimum(full, end), BLOCK_N):
        acc, lp_next, rows = _tile(
            q, k_ptr, v_ptr, bt_row, rows, j0, hi, pos, sigma, acc, lp_next, f_cur, f_prev, kvh,
            s_blk, s_tok, s_head, scale, BS, D, BLOCK_N, P, RELU, PREC, False)
    for j0 in range(tl.maximum(full, lo), end, BLOCK_N):
        acc, lp_next, rows = _tile(
            q, k_ptr, v_ptr, bt_row, rows, j0, hi, pos, sigma, acc, lp_next, f_cur, f_prev, kvh,
            s_blk, s_tok, s_head, scale, BS, D, BLOCK_N, P, RELU, PREC, True)
    acc = apply_v_scale(acc, vs_ptr, kvh, D, FP8)   # per split: the partials of scaled sums add
    dst = out_ptr + (q0 + tok).to(tl.int64)[:, None] * sot + head[:, None] * soh + split * sos + d[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def _check(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, out):
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, Hq, D] with unit last stride, got {tuple(q.shape)}")
    check_kv_cache(kv_cache)
    t, hq, d = q.shape
    if kv_cache.shape[4] != d or hq % kv_cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(kv_cache.shape)}")
    if not pow2(d) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    b = seq_lens.shape[0]
    if query_start_loc.shape != (b + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError("query_start_loc must be int32 [B+1]")
    if seq_lens.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise ValueError("seq_lens and block_table must be int32")
    if block_table.dim() != 2 or block_table.shape[0] < b or sigma.shape != (hq,):
        raise ValueError("block_table must be [B, max_blocks] and sigma [Hq]")
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with unit last stride")


class PrefillLaunch:
    """A prefill planned once for a step's chunks, launched by every layer (DecodeLaunch's
    counterpart): checks, tile config, splits, grid and split partials follow the chunks, not
    the layer. Tile sizes, warps, stages and splits default to `plan_prefill`'s (benchmarks and
    tests pass their own; an explicit block_m means no splits unless `splits` says so)."""

    def __init__(self, q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale, pool_size, relu_pre,
                 out, max_query_len, max_seq_len=None, block_m=None, block_n=None, num_warps=None,
                 num_stages=None, splits=None):
        _check(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, out)
        self.layout = layer_layout(q, kv_cache, out)
        hq, d = q.shape[1:]
        _, _, bs, hkv, _ = kv_cache.shape
        b = seq_lens.shape[0]
        self.empty = q.shape[0] == 0 or b == 0 or max_query_len <= 0
        if self.empty:
            return
        g = hq // hkv
        g_pad = next_power_of_2(g)
        cfg, plan_splits = plan_prefill(b, max_query_len, max_seq_len, hkv, g, sm_count(q), pool_size)
        splits = splits or (plan_splits if block_m is None else 1)
        if splits > MAX_SPLITS:
            raise ValueError(f"{splits} key splits, more than the {MAX_SPLITS} the split sum is compiled for")
        block_m, block_n = _block_m(block_m or cfg.block_m, g_pad), block_n or cfg.block_n
        if pool_size - 1 > block_n:   # the band products reach back one key tile only
            raise ValueError(f"pool_size {pool_size} is above what the prefill kernel supports ({block_n + 1})")
        self.splits = splits
        self.partials = split_output(out, splits) if splits > 1 else None
        q_tiles = cdiv(max_query_len, block_m // g_pad)
        group = seqs_per_group(b, q_tiles, max(max_seq_len or 0, max_query_len) * hkv * d * 2 * kv_cache.element_size())
        self.grid = (group, hkv * splits, cdiv(b, group) * q_tiles)
        self.rows_args = (block_table, query_start_loc, seq_lens)
        self.ints = (float(scale), block_table.stride(0), g, splits, b, q_tiles)
        self.consts = dict(D=d, BS=bs, G_PAD=g_pad, BLOCK_M=block_m, BLOCK_N=block_n, P=int(pool_size),
                           RELU=bool(relu_pre), PREC="ieee" if q.dtype == torch.float32 else "tf32")
        self.prefill = KernelLaunch(_prefill_kernel, self.grid, num_warps=num_warps or cfg.num_warps,
                                    num_stages=num_stages or cfg.num_stages)
        self.sum = sum_all_splits_launch(out) if splits > 1 else None

    def __call__(self, q, kv_cache, sigma, out, k_scale=None, v_scale=None):
        """This layer's prefill into `out`; returns `out`."""
        if self.empty:
            return out
        check_layer(self.layout, q, kv_cache, out)
        dst, strides = self.partials or (out, (out.stride(0), out.stride(1), 0))
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        sigma = sigma.float().contiguous()
        ks, vs, fp8 = scale_args(kv_cache, k_scale, v_scale, sigma)
        scale, sbt, g, splits, b, q_tiles = self.ints
        block_table, query_start_loc, seq_lens = self.rows_args
        self.prefill(
            q, k_cache, v_cache, block_table, query_start_loc, seq_lens, sigma, dst, scale, q.stride(0), q.stride(1),
            *strides, sbt, *k_cache.stride()[:3], g, splits, b, q_tiles, ks, vs, FP8=fp8, **self.consts)
        # launched plainly: with programmatic dependent launch the split sum's programs came in
        # early and the split plans ran 1.07-1.14x slower (2K tokens: 74.3 against 65.4 us)
        return sum_all_splits(dst, out, splits, MAX_SPLITS, query_start_loc, self.sum)


def asynci_prefill_triton(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale,
                          pool_size, relu_pre, out, max_query_len, max_seq_len=None,
                          block_m=None, block_n=None, num_warps=None, num_stages=None, splits=None,
                          k_scale=None, v_scale=None):
    """Plans (PrefillLaunch) and launches one layer's prefill."""
    plan = PrefillLaunch(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale, pool_size, relu_pre,
                         out, max_query_len, max_seq_len, block_m, block_n, num_warps, num_stages, splits)
    return plan(q, kv_cache, sigma, out, k_scale, v_scale)


def prefill_variants(pool_size=1):
    """Every compiled variant `plan_prefill` can pick for a pool: its 64-query config unsplit and
    split (any split count > 1 shares one compile)."""
    cfg = key_config(pool_size)
    return [(cfg, 1), (cfg, 2)]


def warmup_prefill(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale, pool_size,
                   relu_pre, out, max_query_len, max_seq_len, k_scale=None, v_scale=None):
    """Runs (so compiles) every prefill variant: the engine's start-up warm-up. CUDA only."""
    if not (q.is_cuda and triton is not None):
        return out
    for cfg, splits in prefill_variants(pool_size):
        asynci_prefill_triton(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale,
                              pool_size, relu_pre, out, max_query_len, max_seq_len,
                              **cfg._asdict(), splits=splits, k_scale=k_scale, v_scale=v_scale)
    return out


def prefill_launch(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale, pool_size, relu_pre,
                   out, max_query_len, max_seq_len):
    """A step's prefill as a layer's launch (decode_launch's counterpart): planned once where
    the Triton kernel serves, else the reference called a layer with the step's chunks."""
    if q.is_cuda and triton is not None:
        return PrefillLaunch(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale, pool_size,
                             relu_pre, out, max_query_len, max_seq_len)
    return lambda q, kv_cache, sigma, out, k_scale=None, v_scale=None: asynci_prefill_ref(
        q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale, pool_size, relu_pre, out,
        max_query_len, max_seq_len, k_scale=k_scale, v_scale=v_scale)


def asynci_prefill(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale, pool_size,
                   relu_pre, out, max_query_len, max_seq_len, k_scale=None, v_scale=None):
    """Writes AsyncI of every query token of the chunks into `out` [T, Hq, D] and returns it."""
    launch = prefill_launch(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale, pool_size,
                            relu_pre, out, max_query_len, max_seq_len)
    return launch(q, kv_cache, sigma, out, k_scale, v_scale)
