"""The H200's view of asynct's kernels, compiled on any machine (no GPU): registers, spills,
shared memory, how deep the pipeliner buffers each K/V load, and the programs an SM holds by
registers and shared memory. A copy of the decode kernel ran 8-10 % slower on the H200 than the
kernel: here it took 28 registers a thread more (one program an SM fewer), and both kernels' K/V
loads were single-buffered whatever num_stages said (benchmarks/RESULTS.md, nineteenth session).

    PYTHONPATH=. python3 benchmarks/compile_report.py [--skip-linears]

First the attention kernels at bench-0.6b's attention (8 query / 4 KV heads of 128, blocks of 16,
pool 3, bf16), then its four fused linears at 1-32 rows as fused_linear plans them, their grids in
waves of the H200's 132 SMs: gate/up's one-row grid ran in two (10 programs an SM at 48
registers) until a register cap put it in one. Each compile takes the launch's specialisation:
16-byte aligned pointers, integers divisible by 16 marked so unless the kernel's
`do_not_specialize` lists them, integers equal to 1 constant."""
import argparse
import importlib
import os
import re
import subprocess
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import torch  # noqa: E402

from asynct.ops import fused_linear as fl, fused_linear_kernels as flk  # noqa: E402
from asynct.attention.triton_backend import DECODE_SUMS_MAX_ROWS  # noqa: E402

dec = importlib.import_module("asynct.ops.asynci_decode")    # the modules, not the functions
pre = importlib.import_module("asynct.ops.asynci_prefill")

SM90 = GPUTarget("cuda", 90, 32)
REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED, WARPS_PER_SM, PROGRAMS_PER_SM = 65536, 228 << 10, 1 << 10, 64, 32


def _signature(kernel, args, constexprs):
    """ASTSource's signature, constants and attributes for a launch with `args` (pointer type
    strings, floats, ints)."""
    sig, consts, attrs = {}, dict(constexprs), {}
    skip = set(kernel.do_not_specialize) | set(kernel.do_not_specialize_on_alignment)
    for i, name in enumerate(kernel.arg_names):
        v = args.get(name)
        if name in consts:
            sig[name] = "constexpr"
        elif isinstance(v, str):
            sig[name] = v
            attrs[(i,)] = [] if name in skip else [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1 and name not in skip:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if v % 16 == 0 and name not in skip:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def compile_sm90(kernel, args, constexprs, num_warps, num_stages, maxnreg=None):
    """{regs, spill, smem, buffers, programs}: one compile for sm_90a, ptxas for the registers."""
    sig, consts, attrs = _signature(kernel, args, constexprs)
    options = dict(num_warps=num_warps, num_stages=num_stages) | ({"maxnreg": maxnreg} if maxnreg else {})
    k = triton.compile(ASTSource(kernel, sig, consts, attrs), target=SM90, options=options)
    ptxas = triton.backends.nvidia.compiler.get_ptxas(90).path
    ptx = f"/tmp/compile_report_{os.getpid()}.ptx"
    with open(ptx, "w") as f:
        f.write(k.asm["ptx"])
    log = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", ptx + ".cubin"], capture_output=True,
                         text=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    smem = k.metadata.shared
    buffers = sorted({int(n) for n in re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", k.asm["ttgir"])})
    programs = min(REGS_PER_SM // (regs * 32 * num_warps), SMEM_PER_SM // (smem + SMEM_RESERVED),
                   WARPS_PER_SM // num_warps, PROGRAMS_PER_SM)
    return dict(regs=regs, spill=spill, smem=smem, buffers=buffers, programs=programs)


ATTN = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", bt_ptr="*i32", seq_ptr="*i32", sigma_ptr="*fp32",
            ks_ptr="*fp32", vs_ptr="*fp32", scale=0.03, s_blk=16 * 4 * 128, s_tok=512, s_head=128, G=2)
COMMON = dict(D=128, BS=16, P=3, RELU=True, PREC="tf32", FP8=False)


def decode_reports():
    args = dict(ATTN, out_ptr="*fp32", plen_ptr="*i32", pre_ptr="*fp32", order_ptr="*i32", sqb=1024, sqh=128, sbt=64,
                sob=1024 * 8, soh=128 * 8, sos=128, N_PRE=56, S_PRE=2, fin_ptr="*bf16", sfb=1024, sfh=128)
    n, w, st = dec.BLOCK_N, 4, 2    # asynci_decode_triton's launch
    for fp8 in (False, True):
        # an FP8 cache is read as int32 words (asynci_common.kv_operands): strides in words
        kv = dict(k_ptr="*i32", v_ptr="*i32", s_blk=16 * 4 * 32, s_tok=128, s_head=32) if fp8 else {}
        for cascade, accumulate, ordered in ((False, False, False), (True, False, False), (False, True, False),
                                             (False, False, True), (True, False, True)):
            consts = dict(COMMON, M=16, BLOCK_N=n, CASCADE=cascade, FP8=fp8, PTX=fp8, PDL=True, ACCUMULATE=accumulate,
                          ORDERED=ordered)
            yield (f"decode {n} keys, {w} warps, {st} stages, cascade {cascade}, accumulate {accumulate}, "
                   f"ordered {ordered}, fp8 {fp8}"), compile_sm90(dec._decode_kernel, dict(args, **kv), consts, w, st)


def prefill_reports():
    args = dict(ATTN, qsl_ptr="*i32", out_ptr="*fp32", sqt=1024, sqh=128, sot=1024 * 8, soh=128 * 8,
                sos=128, sbt=128, S=2, B=4, QT=64)
    for cfg in pre.PREFILL_CONFIGS:
        consts = dict(COMMON, G_PAD=2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        yield f"prefill {cfg.block_m}x{cfg.block_n}, {cfg.num_warps} warps, {cfg.num_stages} stages", \
            compile_sm90(pre._prefill_kernel, args, consts, cfg.num_warps, cfg.num_stages)


HIDDEN, INTER, HQ, HKV, D, SMS = 1024, 3072, 8, 4, 128, 132


def _linear_launch(op, m, k, grid_of):
    """(programs, constexprs + launch options) of a fused linear as fused_linear plans it for m
    rows on an H200 (132 SMs, programmatic dependent launch on); grid_of(weight rows a program)."""
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    real = fl.pdl_args
    fl.pdl_args = lambda t, wanted=True: dict(PDL=wanted, launch_pdl=wanted)
    try:
        rows, plan = fl._plan(x, k, op)
        programs = grid_of(rows, plan)
        plan = plan or fl._tiles(x, k, programs)
    finally:
        fl.pdl_args = real
    plan = {n: v for n, v in plan.items() if n != "launch_pdl"}
    return rows, programs, plan


def _linear(kernel, args, consts, plan):
    opts = {n: plan.pop(n) for n in ("num_warps", "num_stages", "maxnreg") if n in plan}
    return compile_sm90(kernel, args, dict(consts, **plan), opts["num_warps"], opts["num_stages"],
                        opts.get("maxnreg"))


def linear_reports(batches=(1, 2, 3, 4, 8, 16, 32, 64)):
    """bench-0.6b's four fused linears at each batch, with their grids: a grid past one wave
    (programs > SMs x programs an SM) starts its last programs' weight loads only as the first
    ones finish."""
    x = dict(x_ptr="*bf16", sx=HIDDEN, w_ptr="*bf16")
    for m in batches:
        rows, n, plan = _linear_launch("qkv", m, HIDDEN, lambda r, p: (HQ + 2 * HKV) * D // (2 * fl._half(r, p)))
        args = dict(x, q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64", cs_ptr="*fp32", M=m, HQ=HQ,
                    HKV=HKV, qa_ptr="*fp32", qw_ptr="*bf16", ka_ptr="*fp32", kw_ptr="*bf16", sqa=0, sqw=1, ska=0,
                    skw=1, kc_ptr="*bf16", vc_ptr="*bf16", slot_ptr="*i64", ks_ptr="*fp32", vs_ptr="*fp32",
                    s_blk=16 * HKV * D, s_tok=HKV * D, s_head=D, sums_ptr="*fp32")
        hb = fl._half(rows, plan.get("GEMV") or None)
        # decode steps of up to DECODE_SUMS_MAX_ROWS sequences: QKV zeroes the sums o_proj reads in fp32
        sums = m <= DECODE_SUMS_MAX_ROWS
        yield f"qkv, {m} rows", n, _linear(flk.qkv_rope_kernel, args, dict(K=HIDDEN, HALF=D // 2, HB=hb, WRITE_KV=True,
                                                                           BS=16, FP8=False, ZERO_SUMS=sums), plan)
        rows, n, plan = _linear_launch("reglu", m, HIDDEN, lambda r, p: -(-INTER // fl._half(r, p)))
        hb = fl._half(rows, plan.get("GEMV") or None)
        yield f"gate/up, {m} rows", n, _linear(flk.gate_up_reglu_kernel, dict(x, out_ptr="*bf16", M=m, I=INTER),
                                               dict(K=HIDDEN, HB=hb), plan)
        for name, k, post in (("o_proj", HQ * D, True), ("down", INTER, False)):
            rows, n, plan = _linear_launch("dyht_add", m, k, lambda r, p: -(-HIDDEN // r))
            x_type = "*fp32" if sums and name == "o_proj" else "*bf16"     # o_proj reads the decode's sums
            args = dict(x, x_ptr=x_type, sx=k, res_ptr="*bf16", hid_ptr="*bf16", out_ptr="*bf16", a_ptr="*fp32",
                        dw_ptr="*bf16", pa_ptr="*fp32", pw_ptr="*bf16", M=m, N=HIDDEN, sa=0, sw=1, spa=0, spw=1)
            yield f"{name}, {m} rows", n, _linear(flk.linear_dyht_add_kernel, args,
                                                  dict(K=k, HAS_POST=post, BLOCK_N=rows), plan)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-linears", action="store_true", help="the attention kernels only")
    a = ap.parse_args()
    print("kernel | registers | spill bytes | shared KB | K/V buffers | programs an SM")
    for name, r in [*decode_reports(), *prefill_reports()]:
        print(f"{name} | {r['regs']} | {r['spill']} | {r['smem'] / 1024:.1f} | "
              f"{'/'.join(map(str, r['buffers']))} | {r['programs']}", flush=True)
    if a.skip_linears:
        return
    print("\nfused linear | programs | registers | spill bytes | shared KB | programs an SM | waves")
    for name, n, r in linear_reports():
        print(f"{name} | {n} | {r['regs']} | {r['spill']} | {r['smem'] / 1024:.1f} | {r['programs']} | "
              f"{n / (SMS * r['programs']):.2f}", flush=True)


if __name__ == "__main__":
    main()
