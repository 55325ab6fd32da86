"""Stream-K paged AsyncI decode, a prototype timed against the engine's decode (asynci_decode.py).

The engine's decode launches a program per (row, KV head, split): at 99+ rows one split each, so
256 rows of 600-1,024 keys are two waves of programs of equal length, each wave paying its
programs' block-table and first K/V round trips together and ending in a tail (600-key rows ran
at 0.81 of copy bandwidth, 1,024-key ones 0.93, 4,096-key ones 1.01; H200). Here one wave of
programs (3-5 an SM) deals out the batch's (row, KV head, key tile) items evenly: program p
takes the items [p * chunk, (p + 1) * chunk) in row-major order, crossing rows where its range
does. AsyncI has no normalisation, so a (row, head) split between programs is the sum of their
partials: each stores its fp32 partial in its own slot (slot 1 for the segment that reaches the
end of its range, 0 for the one it starts with), and the last of them to arrive (a counter)
adds them in program order and stores the row: deterministic, no sum kernel. With a shared
prefix (cascade) the launch's first programs take the prefix's tiles as the engine's do, the
others the rows' own keys (as many fewer of them as there are prefix programs, so that the
launch stays one wave), and the engine's sum kernel adds the two.

The table compares, per shape, the engine's decode as its graphs launch it (16+ rows: the
cascade variant, the prefix or none, its sum, rows longest first from 64) and plainly, the
stream-K variants, and SDPA's cuDNN and flash backends on dense K/V of equal lengths.

    PYTHONPATH=. python3 benchmarks/decode_streamk.py            # GPU: check, then time
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/decode_streamk.py --check   # CPU check
"""
import argparse
import math
import os
import statistics
import sys
from pathlib import Path

import torch

from asynct.ops._triton import jit as _jit, pdl_args, tl, triton, wait_for_prior
from asynct.ops.asynci_common import attend_keys, fold_k_scale, kv_operands, scale_args, sm_count
from asynct.ops.asynci_common import split_output, sum_splits
from asynct.ops.asynci_decode import BLOCK_N, _prefix_tile, check_decode_args, num_prefix_splits
from asynct.ops.paged_ref import asynci_decode_ref


@_jit
def _segment(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, plen_ptr, sigma_ptr, out_ptr, part_ptr, cnt_ptr, scale, rows,
             ends, w, p, p_end, chunk, total, sqb, sqh, sbt, sob, soh, s_blk, s_tok, s_head, G, HKV, ks_ptr, vs_ptr,
             D: tl.constexpr, BS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
             RELU: tl.constexpr, PREC: tl.constexpr, CASCADE: tl.constexpr, FP8: tl.constexpr, PTX: tl.constexpr):
    """Program p's items from w to the end of their (row, KV head) or of its range, whichever
    comes first, into out (or, split between programs, into p's partial slot, the last to
    arrive adding them all); returns where it stopped. Only a program's first segment can start
    inside a row, but a loop with a first segment of its own took 216 registers, not 168 (sm_90)."""
    g = tl.arange(0, M)
    gmask = g < G
    d = tl.arange(0, D)
    b = tl.sum((ends <= w).to(tl.int32))
    n_b, start = own_keys(seq_ptr, plen_ptr, b, CASCADE)
    t_b = tl.maximum(tl.cdiv(n_b - start, BLOCK_N), 1)
    row_w = tl.sum(tl.where(rows == b, ends, 0)) - t_b * HKV
    kvh = (w - row_w) // t_b
    head_w = row_w + kvh * t_b        # this (row, head)'s first item
    seg_end = tl.minimum(p_end, head_w + t_b)
    head = kvh * G + g
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + head[:, None] * sqh + d[None, :], mask=gmask[:, None], other=0.0)
    q = fold_k_scale(q, ks_ptr, kvh, D, FP8)
    sigma = tl.load(sigma_ptr + head, mask=gmask, other=0.0)
    acc = attend_keys(q, sigma, k_ptr, v_ptr, bt_ptr + b.to(tl.int64) * sbt, vs_ptr, kvh,
                      start + (w - head_w) * BLOCK_N, tl.minimum(start + (seg_end - head_w) * BLOCK_N, n_b), scale,
                      s_blk, s_tok, s_head, D, BS, BLOCK_N, P, RELU, PREC, FP8, PTX, False)
    dst = out_ptr + b.to(tl.int64) * sob + head[:, None] * soh + d[None, :]
    first_p = head_w // chunk
    last_p = (head_w + t_b - 1) // chunk
    if first_p == last_p:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        slot = (seg_end == p_end).to(tl.int32)
        tl.store(part_ptr + ((p * 2 + slot) * M + g[:, None]) * D + d[None, :], acc, mask=gmask[:, None])
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + b * HKV + kvh, 1, sem="acq_rel") == last_p - first_p:
            sum_acc = tl.zeros([M, D], dtype=tl.float32)
            for c in range(first_p, last_p + 1):
                c_slot = ((c < last_p) | (head_w + t_b >= tl.minimum((c + 1) * chunk, total))).to(tl.int32)
                sum_acc += tl.load(part_ptr + ((c * 2 + c_slot) * M + g[:, None]) * D + d[None, :],
                                   mask=gmask[:, None], other=0.0, cache_modifier=".cg")
            tl.store(dst, sum_acc.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
            tl.atomic_xchg(cnt_ptr + b * HKV + kvh, 0, sem="relaxed")
    return seg_end


@_jit
def own_keys(seq_ptr, plen_ptr, rows, CASCADE: tl.constexpr, mask=True):
    """Rows' lengths and where their own keys start: past the shared prefix (CASCADE), else 0."""
    n = tl.load(seq_ptr + rows, mask=mask, other=0)
    start = n * 0
    if CASCADE:
        start = tl.minimum(tl.load(plen_ptr), n)
    return n, start


@_jit
def dealers(plen_ptr, n_prog, n_prefix_prog, CASCADE: tl.constexpr):
    """The programs that deal out the rows' keys: all n_prog, or, where a prefix is shared, as
    many fewer as the prefix tiles take (at most half), so that the launch stays one wave; the
    others exit. A graph's launch is sized once for both cases."""
    n = n_prog
    if CASCADE:
        if tl.load(plen_ptr) > 0:
            n = tl.maximum(n_prog - n_prefix_prog, n_prog // 2)
    return n


@_jit(do_not_specialize=["B", "sbt", "sob", "soh", "N_PRE", "S_PRE"])
def _streamk_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, plen_ptr, pre_ptr, sigma_ptr, out_ptr, part_ptr, cnt_ptr,
                    scale, B, sqb, sqh, sbt, sob, soh, s_blk, s_tok, s_head, G, HKV, N_PRE, S_PRE, ks_ptr, vs_ptr,
                    BP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, M: tl.constexpr,
                    BLOCK_N: tl.constexpr, P: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr,
                    CASCADE: tl.constexpr, FP8: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    """The first N_PRE * HKV programs take the shared prefix's tiles (CASCADE: asynci_decode's
    _prefix_tile, whose partials the sum kernel adds), the others deal out the rows' own keys."""
    p = tl.program_id(0) - N_PRE * HKV
    if p < 0:
        _prefix_tile(q_ptr, k_ptr, v_ptr, bt_ptr, plen_ptr, sigma_ptr, pre_ptr, tl.program_id(0) // HKV,
                     tl.program_id(0) % HKV, B, HKV, scale, sqb, sqh, s_blk, s_tok, s_head, G, S_PRE, ks_ptr, vs_ptr,
                     D, BS, M, BLOCK_N, P, RELU, PREC, FP8, PTX, PDL)
    else:
        rows = tl.arange(0, BP)
        n_keys, start = own_keys(seq_ptr, plen_ptr, rows, CASCADE, rows < B)
        tiles = tl.where(rows < B, tl.maximum(tl.cdiv(n_keys - start, BLOCK_N), 1), 0)  # an empty row stores zeros
        ends = tl.cumsum(tiles * HKV, 0)     # the work items up to each row's end, row-major
        total = tl.max(ends, 0)
        chunk = tl.cdiv(total, dealers(plen_ptr, tl.num_programs(0) - N_PRE * HKV, N_PRE * HKV, CASCADE))
        w = p * chunk
        p_end = tl.minimum(w + chunk, total)
        wait_for_prior(PDL)
        while w < p_end:
            w = _segment(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, plen_ptr, sigma_ptr, out_ptr, part_ptr, cnt_ptr, scale,
                         rows, ends, w, p, p_end, chunk, total, sqb, sqh, sbt, sob, soh, s_blk, s_tok, s_head, G, HKV,
                         ks_ptr, vs_ptr, D, BS, M, BLOCK_N, P, RELU, PREC, CASCADE, FP8, PTX)


_scratch: dict = {}


def scratch(device, n_prog, m, d, n_counters):
    key = (device, n_prog, m, d)
    if key not in _scratch or _scratch[key][1].numel() < n_counters:
        _scratch[key] = (torch.empty(n_prog, 2, m, d, dtype=torch.float32, device=device),
                         torch.zeros(max(n_counters, 1024), dtype=torch.int32, device=device))
    return _scratch[key]


def decode_streamk(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out, prefix_len=None,
                   max_seq_len=None, programs_per_sm=3, programs=None, num_warps=4, num_stages=2, maxnreg=None,
                   k_scale=None, v_scale=None, **_):
    """asynci_decode_triton's contract (`prefix_len`: cascade, the prefix's tiles in the same
    launch and the sum kernel after), its rows dealt out over one wave of programs."""
    check_decode_args(q, kv_cache, block_table, seq_lens, sigma, out)
    b, hq, d = q.shape
    _, _, bs, hkv, _ = kv_cache.shape
    g = hq // hkv
    m = max(16, triton.next_power_of_2(g))
    sms = sm_count(q)
    n_prog = programs or programs_per_sm * sms
    part, cnt = scratch(q.device, n_prog, m, d, b * hkv)
    sigma = sigma.float().contiguous()
    ks, vs, fp8 = scale_args(kv_cache, k_scale, v_scale, sigma)
    k_cache, v_cache, kv_strides, ptx = kv_operands(kv_cache, fp8)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    block_n = max(BLOCK_N, triton.next_power_of_2(int(pool_size)))
    cascade = prefix_len is not None
    s_pre = n_pre = 0
    if cascade:
        s_pre = num_prefix_splits(b, hkv, g, max_seq_len or block_table.shape[1] * bs, m, sms, 1)
        n_pre = triton.cdiv(b * g, m) * s_pre
    pre = split_output(q, s_pre, partials=True)[0] if cascade else None
    dst, strides = split_output(out, 1, partials=cascade)
    plen = prefix_len if cascade else seq_lens
    _streamk_kernel[(n_pre * hkv + n_prog,)](
        q, k_cache, v_cache, block_table, seq_lens, plen, dst if pre is None else pre, sigma, dst, part, cnt,
        float(scale), b, q.stride(0), q.stride(1), block_table.stride(0), strides[0], strides[1], *kv_strides, g, hkv,
        n_pre, s_pre, ks, vs, BP=max(16, triton.next_power_of_2(b)), D=d, BS=bs, M=m, BLOCK_N=block_n,
        P=int(pool_size), RELU=bool(relu_pre), PREC=prec, CASCADE=cascade, FP8=fp8, PTX=ptx, num_warps=num_warps,
        num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}), **pdl_args(q))
    return sum_splits(dst, out, 1, (seq_lens, plen, block_n, True), pre) if cascade else out


def make_batch(b, lo, hi, hq, hkv, d, dtype, device, gen, bs=16, shared=0):
    """q, a paged cache, a block table (the first `shared` keys in the same blocks for every
    row: a prefix cache hit) and lengths of lo-hi keys."""
    lens = torch.randint(lo, hi + 1, (b,), generator=gen)
    width = (hi + bs - 1) // bs
    n_shared = shared // bs
    blocks = n_shared + b * (width - n_shared)
    cache = (torch.randn(2, blocks, bs, hkv, d, generator=gen) * 0.5).to(dtype).to(device)
    table = torch.empty(b, width, dtype=torch.int32)
    table[:, :n_shared] = torch.arange(n_shared, dtype=torch.int32)
    table[:, n_shared:] = n_shared + torch.randperm(b * (width - n_shared), generator=gen).view(b, -1).int()
    q = (torch.randn(b, hq, d, generator=gen) * 0.5).to(dtype).to(device)
    return q, cache, table.to(device), lens.int().to(device)


def check(device, dtype):
    """Against the reference: GQA, pools 1-5, negative sigma, empty and one-key rows, rows split
    over programs and programs over rows, a shared prefix (cascade) or none in a cascade launch."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    cases = [(3, 0, 200, 4, 2, 32, 3, 5, None), (5, 1, 130, 8, 2, 16, 5, 7, None), (7, 60, 70, 2, 2, 32, 2, 3, None),
             (2, 300, 400, 6, 3, 32, 1, 4, None), (9, 1, 33, 4, 1, 16, 3, 64, None), (4, 100, 300, 4, 2, 32, 3, 1, None),
             # cascade: a shared prefix (96 keys: not a whole tile), none shared in a cascade launch, pool 4
             (20, 100, 180, 4, 2, 32, 3, 7, 96), (17, 130, 200, 8, 2, 16, 4, 5, 128), (18, 40, 90, 4, 2, 32, 3, 6, 0)]
    for b, lo, hi, hq, hkv, d, pool, n_prog, shared in cases:
        q, cache, table, lens = make_batch(b, lo, hi, hq, hkv, d, dtype, device, gen, shared=shared or 0)
        if b > 2 and not shared:
            lens[1] = 0
            lens[2] = 1
        sigma = torch.randn(hq, generator=gen).to(device) * 1.5
        want = asynci_decode_ref(q.float(), cache.float(), table, lens, sigma, 0.3, pool, True,
                                 torch.empty(q.shape, device=device))
        plen = None if shared is None else torch.tensor([shared], dtype=torch.int32, device=device)
        got = decode_streamk(q, cache, table, lens, sigma, 0.3, pool, True, torch.empty_like(q), prefix_len=plen,
                             programs=n_prog)
        err = ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        worst = max(worst, err)
        print(f"check b={b} lens {lo}-{hi} hq/hkv {hq}/{hkv} d {d} pool {pool} programs {n_prog} shared {shared}: "
              f"rel err {err:.2e}", flush=True)
    return worst


# 168 registers a thread at the compiler's will (3 programs an SM); capped, the spills (16 bytes at
# 128, 56 at 96) sit outside the key loop: 4 and 5 programs an SM (sm_90 compiles); 8 warps: 128
STREAMK_VARIANTS = {"streamk 3/SM": dict(programs_per_sm=3), "streamk 4/SM cap": dict(programs_per_sm=4, maxnreg=128),
                    "streamk 5/SM cap": dict(programs_per_sm=5, maxnreg=96),
                    "streamk 8w 2/SM": dict(programs_per_sm=2, num_warps=8)}
CASCADE_VARIANTS = {k: STREAMK_VARIANTS[k] for k in ("streamk 3/SM", "streamk 4/SM cap")}
SHAPES = [   # rows, min keys, max keys, shared prefix keys (gsm8k-shaped: 688 of 880-1,010)
    (256, 1024, 1024, 0), (256, 600, 600, 0), (256, 100, 2048, 0), (144, 200, 2048, 0), (224, 880, 1010, 688),
    (128, 1024, 1024, 0), (64, 1024, 1024, 0), (32, 1024, 1024, 0), (32, 600, 600, 0), (8, 1024, 1024, 0),
    (1, 640, 640, 0), (256, 4096, 4096, 0)]


def timing():
    from kernel_bench import bench, copy_bandwidth   # a graph of the calls over input sets; the copy peer

    from asynct.attention.graph_inputs import longest_first
    from asynct.ops.asynci_decode import asynci_decode_triton
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.2f} TB/s (read + write)", flush=True)
    gen = torch.Generator().manual_seed(1)
    sigma = torch.randn(8, device="cuda")
    table_rows = []
    for b, lo, hi, shared in SHAPES:
        one = 2 * b * (lo + hi) / 2 * 4 * 128 * 2
        sets = [make_batch(b, lo, hi, 8, 4, 128, torch.bfloat16, "cuda", gen, shared=shared)
                for _ in range(max(1, min(16, math.ceil(256e6 / one))))]
        keys = [shared + (s[3] - shared).sum().item() for s in sets]
        nbytes = statistics.mean(2 * k * 4 * 128 * 2 for k in keys)
        orders = [torch.from_numpy(longest_first(s[3].tolist(), b)).cuda() for s in sets]
        outs = [torch.empty_like(s[0]) for s in sets]
        # what the engine's graphs of 16+ rows launch: the cascade variant (the prefix, or none) and its sum
        plen = torch.tensor([shared], dtype=torch.int32, device="cuda") if b >= 16 else None
        t = {}
        engine = dict(max_seq_len=hi, prefix_len=plen)
        if not shared:
            t["engine plain"] = time_variant(asynci_decode_triton, sets, outs, sigma, dict(max_seq_len=hi))
        ref = [o.clone() for o in outs]
        if b >= 16:
            t["engine graph"] = time_variant(asynci_decode_triton, sets, outs, sigma,
                                             dict(engine, order=None) if b < 64 else engine, orders)
            ref = ref if not shared else [o.clone() for o in outs]
        variants = dict(STREAMK_VARIANTS) if not shared else {}
        if b >= 16:
            variants |= {f"{k} cascade": dict(v, prefix_len=plen, max_seq_len=hi) for k, v in CASCADE_VARIANTS.items()}
        for name, kw in variants.items():
            t[name] = time_variant(decode_streamk, sets, outs, sigma, kw)
            err = max(((o.float() - r.float()).abs().max() / r.float().abs().max()).item() for o, r in zip(outs, ref))
            print(f"  {b}x{lo}-{hi} shared {shared} {name} vs engine: rel diff {err:.2e}", flush=True)
        if lo == hi:
            t |= sdpa_peers(sets, b, lo)
        base = min(v for k, v in t.items() if k.startswith("engine"))
        shape = f"{b} x {lo}-{hi}" + (f", {shared} shared" if shared else "")
        for name, sec in t.items():
            table_rows.append((shape, name, sec * 1e6, nbytes / sec / 1e12 / bw, base / sec))
            print(f"  {shape} {name:22s} {sec * 1e6:8.1f} us  {nbytes / sec / 1e12 / bw:5.3f} of copy BW  "
                  f"engine / it {base / sec:5.3f}", flush=True)
        del sets, outs
    print("\n| rows x keys | kernel | us | of copy BW | engine's best / it |\n|---|---|---|---|---|")
    for shape, name, us, frac, ratio in table_rows:
        print(f"| {shape} | {name} | {us:.1f} | {frac:.3f} | {ratio:.3f} |")


def time_variant(fn, sets, outs, sigma, kw, orders=None):
    """Seconds a call of fn over the sets (its outputs in outs); `order` from orders where kw has one."""
    def call(s, o, r):
        extra = {"order": r} if orders is not None and "order" not in kw else {}
        return fn(s[0], s[1], s[2], s[3], sigma, 0.03, 3, True, o, **kw, **extra)
    rs = orders if orders is not None else [None] * len(sets)
    from kernel_bench import bench
    return bench([lambda s=s, o=o, r=r: call(s, o, r) for s, o, r in zip(sets, outs, rs)])


def sdpa_peers(sets, b, t):
    """SDPA's cuDNN and flash backends on dense K/V of the same shape: seconds a call by backend."""
    from kernel_bench import bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    times = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        dense = [(s[0].view(b, 8, 1, 128), *torch.randn(2, b, 4, t, 128, device="cuda", dtype=torch.bfloat16))
                 for s in sets]
        try:
            with sdpa_kernel(backend):
                times[f"sdpa {name}"] = bench([lambda x=x: sdpa(x[0], x[1], x[2], enable_gqa=True) for x in dense])
        except RuntimeError as e:
            print(f"  sdpa {name}: {str(e)[:100]}")
    return times


def main():
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_ops_attention import patch_interpreter_scalars
        patch_interpreter_scalars()
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="only the correctness check")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    worst = check(device, torch.float32)
    if device == "cuda":
        worst = max(worst, check(device, torch.bfloat16) / 10)   # bf16: scaled to the fp32 bound below
    print(f"worst rel err {worst:.2e}")
    if worst > 2e-2:
        sys.exit("stream-K decode disagrees with the reference")
    if not a.check and device == "cuda":
        timing()


if __name__ == "__main__":
    main()
