"""GEMM + epilogue kernels (asynct/ops/fused_gemm.py) against cuBLAS + the elementwise kernel
they replace, at bench-0.6b's projections (hidden 1024, MLP 3072) and prefill-chunk / large
decode row counts. Each timing replays a CUDA graph over enough weight copies that every call
reads its weights from HBM (kernel_bench.bench); the fused kernels' launch configs are swept.

    PYTHONPATH=. python3 benchmarks/fused_gemm.py [--rows 128,256,...]

Columns: us of cuBLAS alone, of cuBLAS + the elementwise kernel (the engine's path past
fused_linear.SMALL_M rows, the peer), of the best fused config, and peer / fused."""
import argparse
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_bench import bench, n_sets  # noqa: E402

from asynct.ops import dyht_add, reglu  # noqa: E402
from asynct.ops.fused_gemm import gemm_dyht_add, gemm_reglu  # noqa: E402

HIDDEN, INTER, BF = 1024, 3072, torch.bfloat16
CONFIGS = [(128, 64, 64, 8, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3),
           (64, 128, 64, 4, 4), (128, 64, 32, 4, 5), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
           (64, 64, 128, 4, 3)]
OPS = {  # name: (K, weight rows, epilogue)
    "gate_up+reglu": (HIDDEN, 2 * INTER, "reglu"),
    "down+dyht_add": (INTER, HIDDEN, "dyht_add"),
    "o_proj+post+dyht_add": (HIDDEN, HIDDEN, "post"),
}


def case(m, k, n, kind):
    """One input set per weight copy: (x, weight, residual, DyHT parameters)."""
    sets = []
    for _ in range(n_sets(2 * n * k)):
        sets.append(dict(x=torch.randn(m, k, device="cuda", dtype=BF),
                         w=torch.randn(n, k, device="cuda", dtype=BF) * k ** -0.5,
                         res=torch.randn(m, n, device="cuda", dtype=BF)))
    post = kind == "post"
    p = (torch.rand(n, device="cuda"), torch.randn(n, device="cuda", dtype=BF),   # alpha, weight, post's
         torch.rand(n, device="cuda") if post else None, torch.randn(n, device="cuda", dtype=BF) if post else None)
    return sets, p


def unfused(s, kind, p):
    y = F.linear(s["x"], s["w"])
    if kind == "reglu":
        return reglu(y)
    return dyht_add(y, s["res"], *p)


def fused(s, kind, p, cfg):
    if kind == "reglu":
        return gemm_reglu(s["x"], s["w"], config=cfg)
    return gemm_dyht_add(s["x"], s["w"], s["res"], *p, config=cfg)


def rel_err(a, b):
    a, b = (a, b) if isinstance(a, torch.Tensor) else (a[1], b[1])   # dyht_add: the normed output
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="96,128,256,512,2048,8192")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "| op | rows | cuBLAS us | cuBLAS + elementwise us | best fused us (config) "
          "| peer / fused | rel err")
    for m in map(int, a.rows.split(",")):
        for name, (k, n, kind) in OPS.items():
            sets, p = case(m, k, n, kind)
            t_mm = bench([lambda s=s: F.linear(s["x"], s["w"]) for s in sets])
            t_peer = bench([lambda s=s: unfused(s, kind, p) for s in sets])
            best = None
            for cfg in CONFIGS:
                try:
                    t = bench([lambda s=s, cfg=cfg: fused(s, kind, p, cfg) for s in sets])
                except Exception as e:  # noqa: BLE001  (shared memory a config does not fit)
                    print(f"  {name} {m} {cfg}: {type(e).__name__}", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            err = rel_err(fused(sets[0], kind, p, best[1]), unfused(sets[0], kind, p))
            print(f"| {name} | {m} | {t_mm * 1e6:.1f} | {t_peer * 1e6:.1f} | {best[0] * 1e6:.1f} {best[1]} | "
                  f"{t_peer / best[0]:.2f} | {err:.1e} |", flush=True)
            del sets


if __name__ == "__main__":
    main()
