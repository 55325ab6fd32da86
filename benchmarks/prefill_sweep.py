"""Prefill tile configs and key splits against SDPA flash (causal, bf16), on the GPU. Shape of
bench-0.6b's attention: 8 query / 4 KV heads of 128, P=3, relu_pre, block size 16.

    PYTHONPATH=. python3 benchmarks/prefill_sweep.py        # ~2 min on an H200
    ... prefill_sweep.py --cases 1x4096,16x1024 --splits 1,2 --no-extra   # a shorter grid

Cases: one sequence of 512, 2K and 8K tokens, and 8 sequences of 512. Per case: SDPA flash
(K/V expanded to the 8 query heads: flash wants equal heads), the launch plan's own choice
(`plan`), every config of PREFILL_CONFIGS and a few others at 1-8 key splits (EXTRA).
Timing as benchmarks/kernel_bench.py (CUDA-graph replay over input sets larger than L2). `err` is the relative
error against the unsplit first config on the first input set: a broken variant shows there.
The table printed last gives each variant's speed as SDPA time / its time (>= 1: faster)."""
import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention as sdpa  # noqa: E402

from asynct.ops.asynci_common import _sm_count  # noqa: E402
from asynct.ops.asynci_prefill import (PREFILL_CONFIGS, asynci_prefill_triton,  # noqa: E402
                                       plan_prefill)
from kernel_bench import BF, D, HKV, HQ, bench, n_sets, paged  # noqa: E402

CASES = ((1, 512), (1, 2048), (1, 8192), (8, 512))
# (128, 64, 8, 3): the plan's 128-query config until the pool's exact pair made it slower than
# the 64 x 32 one at long walks (benchmarks/RESULTS.md, forty-eighth session)
EXTRA = ((64, 32, 4, 2), (64, 64, 4, 3), (64, 32, 4, 4), (128, 64, 8, 3), (128, 32, 8, 3))
SPLITS = (1, 2, 3, 4, 6, 8)


def make_sets(b, t, gen):
    nbytes = 4 * b * t * HQ * D * 2
    sets = []
    for _ in range(n_sets(nbytes)):
        cache, table = paged(b, t, gen)
        q = torch.randn(b * t, HQ, D, device="cuda", dtype=BF)
        kd = torch.randn(b, HQ, t, D, device="cuda", dtype=BF)
        qd = q.view(b, t, HQ, D).transpose(1, 2).contiguous()
        sets.append((q, cache, table, torch.empty_like(q), qd, kd, torch.randn_like(kd)))
    return sets


def variants(b, t, args):
    """[(name, kwargs of asynci_prefill_triton)]: the plan first, then explicit configs."""
    cfg, splits = plan_prefill(b, t, t, HKV, HQ // HKV, _sm_count(0))
    out = [(f"plan {cfg.block_m}x{cfg.block_n} w{cfg.num_warps}s{cfg.num_stages} S{splits}", {})]
    for bm, bn, w, st in (*PREFILL_CONFIGS, *(() if args.no_extra else EXTRA)):
        for s in args.splits:
            kw = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st, splits=s)
            out.append((f"{bm}x{bn} w{w}s{st} S{s}", kw))
    return out


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(f"{b}x{t}" for b, t in CASES),
                   help="sequences x tokens, comma-separated")
    p.add_argument("--splits", default=",".join(map(str, SPLITS)), help="key splits per config")
    p.add_argument("--no-extra", action="store_true", help="only the configs the plan can pick")
    args = p.parse_args()
    args.cases = [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    args.splits = [int(s) for s in args.splits.split(",")]
    return args


def main():
    args = parse_args()
    gen = torch.Generator("cuda").manual_seed(1)
    sigma = torch.randn(HQ, device="cuda")
    table = []   # (case, variant, us, sdpa us)
    for b, t in args.cases:
        case = f"{b}x{t}"
        sets = make_sets(b, t, gen)
        qsl = torch.arange(0, b * t + 1, t, dtype=torch.int32, device="cuda")
        seq = torch.full((b,), t, dtype=torch.int32, device="cuda")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t_sdpa = bench([lambda s=s: sdpa(s[4], s[5], s[6], is_causal=True) for s in sets])
        print(f"{case:8s} sdpa-flash {t_sdpa * 1e6:9.1f} us", flush=True)

        def run(s, kw):
            return asynci_prefill_triton(s[0], s[1], s[2], qsl, seq, sigma, 0.03, 3, True, s[3],
                                         t, t, **kw)
        base = PREFILL_CONFIGS[0]
        ref = run(sets[0], dict(zip(base._fields, base), splits=1)).clone()
        for name, kw in variants(b, t, args):
            try:
                err = rel_err(run(sets[0], kw), ref)
                tm = bench([lambda s=s, kw=kw: run(s, kw) for s in sets])
            except Exception as e:  # a config that does not fit is a result, not a crash
                print(f"{case:8s} {name:24s} {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            table.append((case, name, tm * 1e6, t_sdpa * 1e6))
            print(f"{case:8s} {name:24s} {tm * 1e6:9.1f} us  x{t_sdpa / tm:5.2f} sdpa  "
                  f"err {err:.1e}", flush=True)
        del sets
    print_table(table, args.cases)


def print_table(table, cases):
    """table: [(case, variant, us, sdpa us)] -> the ratio grid, variants down, cases across."""
    print("\nprefill: SDPA flash time / variant time (>= 1: at least flash speed), bf16, "
          f"{HQ}q/{HKV}kv x {D}")
    cases = [f"{b}x{t}" for b, t in cases]
    key = lambda name: "plan" if name.startswith("plan") else name  # noqa: E731
    names = list(dict.fromkeys(key(r[1]) for r in table))
    print(f"{'variant':26s}" + "".join(f"{c:>10s}" for c in cases))
    for n in names:
        hit = {r[0]: r[3] / r[2] for r in table if key(r[1]) == n}
        print(f"{n:26s}" + "".join(f"{hit[c]:10.2f}" if c in hit else f"{'-':>10s}" for c in cases))
    print("plan choices: " + "; ".join(f"{r[0]}: {r[1][5:]}" for r in table
                                       if r[1].startswith("plan")))

if __name__ == "__main__":
    main()
