"""A lead for the FP8 decode, not yet measured on a GPU: its K/V read as int32 words.

The engine's FP8 decode (asynci_decode, FP8=True) reads each K/V tile from shared memory one byte
at a time: Triton converts the tile's layout (to the dot's operand layout) before the e4m3 ->
fp16 conversion, whatever the load path (cp.async or registers), so a tile costs 64
`ld.shared.b8` a thread and its loop ~760 instructions against bf16's ~475; it runs at 0.31-0.49
of copy bandwidth (benchmarks/RESULTS.md). Here the cache is viewed as int32 words (4 e4m3 each,
16-byte loads), each word converted in registers by two `cvt.rn.f16x2.e4m3x2` (inline PTX; the
interpreter, which runs no PTX, takes shifts and casts instead) and the four fp16 halves joined
back along D; the layout conversion then moves fp16 (ldmatrix). sm_90 compile (CPU): ~465
instructions a tile, no byte loads, no spill. Otherwise the engine's plain decode (no shared
prefix), its halo, pool and split sum.

    PYTHONPATH=. python3 benchmarks/fp8_decode_words.py --compile   # CPU: sm_90 loop instructions, both
    PYTHONPATH=. python3 benchmarks/fp8_decode_words.py             # GPU: outputs and times, both
"""
import argparse
import os
import re
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402

from asynct.ops._triton import jit as _jit, tl, triton  # noqa: E402
from asynct.ops.asynci_common import (apply_v_scale, fold_k_scale, kv_row_offsets, pool_gate, split_output,  # noqa: E402
                                      split_range, sum_splits)
from asynct.ops.asynci_decode import BLOCK_N, MAX_REGISTERS, num_splits  # noqa: E402

CVT = tl.constexpr("{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
                   "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")


@_jit
def _byte(x, i: tl.constexpr):
    return ((x >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@_jit
def _unpack(x, ASM: tl.constexpr):
    """int32 words [N, W], 4 e4m3 each (little-endian) -> fp16 [N, 4W], exactly."""
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(CVT, "=h,=h,=h,=h,r", [x], dtype=(tl.float16,) * 4,
                                                   is_pure=True, pack=1)
    else:
        c0, c1, c2, c3 = _byte(x, 0), _byte(x, 1), _byte(x, 2), _byte(x, 3)
    pairs = tl.join(tl.join(c0, c1), tl.join(c2, c3))      # [N, W, within a pair, which pair]
    return tl.reshape(pairs.permute(0, 1, 3, 2), [x.shape[0], 4 * x.shape[1]])


@_jit
def _tile(cache_ptr, bt_row, keys, mask, kvh, s_blk, s_tok, s_head, BS: tl.constexpr, D: tl.constexpr,
          ASM: tl.constexpr):
    rows = kv_row_offsets(bt_row, keys, mask, kvh, s_blk, s_tok, s_head, BS)    # in words
    w = tl.arange(0, D // 4)
    return _unpack(tl.load(cache_ptr + rows[:, None] + w[None, :], mask=mask[:, None], other=0), ASM)


@_jit(do_not_specialize=["sbt", "sob", "soh", "sos"])
def _decode_words_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, sigma_ptr, out_ptr, scale, sqb, sqh, sbt,
                         sob, soh, sos, s_blk, s_tok, s_head, G, ks_ptr, vs_ptr, D: tl.constexpr,
                         BS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                         RELU: tl.constexpr, ASM: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo, hi, used, _ = split_range(seq_ptr, seq_ptr, b, split, tl.num_programs(2), BLOCK_N, False)
    g = tl.arange(0, M)
    gmask = g < G
    head = kvh * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + head[:, None] * sqh + d[None, :], mask=gmask[:, None], other=0.0)
    q = fold_k_scale(q, ks_ptr, kvh, D, True)
    sigma = tl.load(sigma_ptr + head, mask=gmask, other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * sbt
    n = tl.arange(0, BLOCK_N)
    keys = lo - BLOCK_N + n          # the halo: the P-1 keys left of the split
    kmask = (keys >= 0) & (keys >= lo - (P - 1)) & (lo < hi)
    k = _tile(k_ptr, bt_row, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D, ASM).to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * scale
    r_prev = tl.where(kmask[None, :], tl.maximum(s, 0.0) if RELU else s, 0.0)
    acc = tl.zeros([M, D], dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        keys = j0 + n
        kmask = keys < hi
        k = _tile(k_ptr, bt_row, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D, ASM).to(q.dtype)
        v = _tile(v_ptr, bt_row, keys, kmask, kvh, s_blk, s_tok, s_head, BS, D, ASM).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale
        r = tl.where(kmask[None, :], tl.maximum(s, 0.0) if RELU else s, 0.0)
        a = tl.where(kmask[None, :], pool_gate(s, r, r_prev, sigma, P, BLOCK_N), 0.0)
        acc += tl.dot(a.to(v.dtype), v)
        r_prev = r
    acc = apply_v_scale(acc, vs_ptr, kvh, D, True)
    dst = out_ptr + b.to(tl.int64) * sob + head[:, None] * soh + split * sos + d[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (split < used))


def decode_words(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                 max_seq_len=None, splits=None, k_scale=None, v_scale=None):
    """asynci_decode_triton's FP8 plain decode (no shared prefix), the cache read as words."""
    b, hq, d = q.shape
    _, _, bs, hkv, _ = kv_cache.shape
    splits = splits or num_splits(b, hkv, max_seq_len or block_table.shape[1] * bs)
    k32, v32 = kv_cache[0].view(torch.int32), kv_cache[1].view(torch.int32)
    dst, strides = split_output(out, splits)
    asm = q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    cap = MAX_REGISTERS[False, True]
    _decode_words_kernel[(b, hkv, splits)](
        q, k32, v32, block_table, seq_lens, sigma.float().contiguous(), dst, float(scale), q.stride(0),
        q.stride(1), block_table.stride(0), *strides, *k32.stride()[:3], hq // hkv, k_scale, v_scale, D=d, BS=bs,
        M=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_N=BLOCK_N, P=int(pool_size), RELU=bool(relu_pre),
        ASM=asm, num_warps=4, num_stages=2, **({"maxnreg": cap} if asm and cap else {}))
    return sum_splits(dst, out, splits, (seq_lens, seq_lens, BLOCK_N, False))


def loop_instructions(ptx):
    """Instruction lines of the kernel's main loop (the last backward branch's body)."""
    lines = ptx.splitlines()
    labels = {x.strip().split(":")[0]: i for i, x in enumerate(lines) if re.match(r"\$L__BB\w+:", x.strip())}
    body = []
    for i, x in enumerate(lines):
        m = re.search(r"bra(\.uni)?\s+(\$L__BB\w+);", x)
        if m and labels.get(m.group(2), i) < i:
            body = lines[labels[m.group(2)]:i + 1]
    body = [x for x in body if x.strip() and not x.strip().startswith(("//", "$", ".loc", "{", "}"))]
    count = lambda p: sum(p in x for x in body)  # noqa: E731
    return f"{len(body)} instructions, {count('ld.shared.b8')} ld.shared.b8, {count('ldmatrix')} ldmatrix"


def compile_both():
    """sm_90 compiles on any machine (compile_report.py's method) of the engine's FP8 decode
    and this one, at bench-0.6b's shapes."""
    import importlib

    from triton.compiler import ASTSource
    import compile_report as cr
    dec = importlib.import_module("asynct.ops.asynci_decode")      # the module, not the function
    base = dict(cr.ATTN, out_ptr="*fp32", sqb=1024, sqh=128, sbt=64, sob=1024 * 8, soh=128 * 8, sos=128)
    consts = dict(cr.COMMON, M=16, BLOCK_N=BLOCK_N)
    engine = (dec._decode_kernel, dict(base, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv", plen_ptr="*i32",
                                       pre_ptr="*fp32", S_PRE=5), dict(consts, CASCADE=False, FP8=True, PDL=True))
    words = (_decode_words_kernel, dict(base, k_ptr="*i32", v_ptr="*i32", s_blk=16 * 4 * 32, s_tok=128, s_head=32),
             dict({k: v for k, v in consts.items() if k not in ("PREC", "FP8")}, ASM=True))
    for name, (kernel, args, c) in (("engine FP8 decode", engine), ("words", words)):
        sig, cs, attrs = cr._signature(kernel, args, c)
        k = triton.compile(ASTSource(kernel, sig, cs, attrs), target=cr.SM90,
                           options=dict(num_warps=4, num_stages=2, maxnreg=MAX_REGISTERS[False, True]))
        print(f"{name}: {cr.compile_sm90(kernel, args, c, 4, 2, MAX_REGISTERS[False, True])}, loop "
              f"{loop_instructions(k.asm['ptx'])}", flush=True)


def gpu_table():
    from kernels import BF, BS, D, HKV, HQ, bench, copy_bandwidth, n_sets
    from asynct.ops.asynci_decode import asynci_decode_triton
    from asynct.ops.kv_cache import quantize_fp8
    bw = copy_bandwidth()
    sigma = torch.randn(HQ, device="cuda")
    ks, vs = torch.rand(HKV, D, device="cuda") / 100 + 0.01, torch.rand(HKV, D, device="cuda") / 100 + 0.01
    print(f"copy {bw:.2f} TB/s\nshape | engine us (x copy) | words us (x copy) | engine / words | max |diff|")
    for b, t in ((1, 1024), (32, 1024), (128, 1024), (256, 1024), (32, 4096), (128, 4096)):
        nbytes, sets = 2 * b * t * HKV * D, []
        for _ in range(n_sets(nbytes)):
            nblk = b * triton.cdiv(t, BS)
            cache = torch.randn(2, nblk, BS, HKV, D, device="cuda")
            cache = torch.stack([quantize_fp8(cache[0], ks), quantize_fp8(cache[1], vs)])
            table = torch.randperm(nblk, device="cuda").int().view(b, -1)
            q = torch.randn(b, HQ, D, device="cuda", dtype=BF)
            sets.append((q, cache, table, torch.full((b,), t, dtype=torch.int32, device="cuda"), torch.empty_like(q)))
        times, outs = [], []
        for fn in (asynci_decode_triton, decode_words):
            run = lambda s, fn=fn: fn(s[0], s[1], s[2], s[3], sigma, 0.03, 3, True, s[4], max_seq_len=t,  # noqa: E731
                                      k_scale=ks, v_scale=vs)
            outs.append(run(sets[0]).float().clone())
            times.append(bench([lambda s=s, run=run: run(s) for s in sets]))
        diff = (outs[0] - outs[1]).abs().max().item()
        print(f"B={b} T={t} | {times[0] * 1e6:.1f} ({nbytes / times[0] / 1e12 / bw:.2f}) | {times[1] * 1e6:.1f} "
              f"({nbytes / times[1] / 1e12 / bw:.2f}) | {times[0] / times[1]:.2f} | {diff:.2e}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile", action="store_true", help="sm_90 compiles only (no GPU needed)")
    if p.parse_args().compile:
        compile_both()
    else:
        gpu_table()
