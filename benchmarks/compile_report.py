"""The attention kernels as the H200 gets them, compiled on any machine (no GPU): registers,
spills, shared memory, how deep the pipeliner buffers each K/V load, and the programs an SM
holds by registers and shared memory. A copy of the decode kernel that ran 8-10 % slower on the
H200 differed from it in 28 registers a thread (one program an SM fewer), and the K/V loads of
both kernels turned out single-buffered whatever num_stages said: both were found here, before
any device time (benchmarks/RESULTS.md, nineteenth session).

    PYTHONPATH=. python3 benchmarks/compile_report.py

Shapes: bench-0.6b's attention (8 query / 4 KV heads of 128, blocks of 16, pool 3, bf16). Each
compile takes the launch's specialisation: 16-byte aligned pointers, integers divisible by 16
marked so unless the kernel's `do_not_specialize` lists them, integers equal to 1 constant."""
import importlib
import os
import re
import subprocess
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

dec = importlib.import_module("asynct.ops.asynci_decode")    # the modules, not the functions
pre = importlib.import_module("asynct.ops.asynci_prefill")

SM90 = GPUTarget("cuda", 90, 32)
REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED = 65536, 228 << 10, 1 << 10


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


def compile_sm90(kernel, args, constexprs, num_warps, num_stages):
    """{regs, spill, smem, buffers, programs}: one compile for sm_90a, ptxas for the registers."""
    sig, consts, attrs = _signature(kernel, args, constexprs)
    k = triton.compile(ASTSource(kernel, sig, consts, attrs), target=SM90,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
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
    programs = min(REGS_PER_SM // (regs * 32 * num_warps), SMEM_PER_SM // (smem + SMEM_RESERVED), 32)
    return dict(regs=regs, spill=spill, smem=smem, buffers=buffers, programs=programs)


ATTN = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", bt_ptr="*i32", seq_ptr="*i32", sigma_ptr="*fp32",
            ks_ptr="*fp32", vs_ptr="*fp32", scale=0.03, s_blk=16 * 4 * 128, s_tok=512, s_head=128, G=2)
COMMON = dict(D=128, BS=16, P=3, RELU=True, PREC="tf32", FP8=False)


def decode_reports():
    args = dict(ATTN, out_ptr="*fp32", plen_ptr="*i32", pre_ptr="*fp32", sqb=1024, sqh=128, sbt=64,
                sob=1024 * 8, soh=128 * 8, sos=128, S_PRE=5)
    n, w, st = dec.BLOCK_N, 4, 2    # asynci_decode_triton's launch
    for cascade in (False, True):
        consts = dict(COMMON, M=16, BLOCK_N=n, CASCADE=cascade, PDL=True)
        yield f"decode {n} keys, {w} warps, {st} stages, cascade {cascade}", \
            compile_sm90(dec._decode_kernel, args, consts, w, st)


def prefill_reports():
    args = dict(ATTN, qsl_ptr="*i32", out_ptr="*fp32", sqt=1024, sqh=128, sot=1024 * 8, soh=128 * 8,
                sos=128, sbt=128, S=2)
    for cfg in pre.PREFILL_CONFIGS:
        consts = dict(COMMON, G_PAD=2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        yield f"prefill {cfg.block_m}x{cfg.block_n}, {cfg.num_warps} warps, {cfg.num_stages} stages", \
            compile_sm90(pre._prefill_kernel, args, consts, cfg.num_warps, cfg.num_stages)


def main():
    print("kernel | registers | spill bytes | shared KB | K/V buffers | programs an SM")
    for name, r in [*decode_reports(), *prefill_reports()]:
        print(f"{name} | {r['regs']} | {r['spill']} | {r['smem'] / 1024:.1f} | "
              f"{'/'.join(map(str, r['buffers']))} | {r['programs']}", flush=True)


if __name__ == "__main__":
    main()
