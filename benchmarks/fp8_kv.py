"""FP8 KV cache on the GPU (issue 14, docs/fp8_kv.md): one run, three parts, a table last.

  1. kernel: AsyncI decode at B=256, T=1024 (bench-0.6b heads: 8 query / 4 KV of 128) over a bf16
     and an FP8 cache, CUDA-graph timed, KV bandwidth against a measured copy bandwidth;
  2. correctness: the FP8 kernels (decode, cascade, prefill, KV write) against the FP8 torch
     reference, bf16 queries;
  3. engine: `asynct bench`'s gsm8k-shaped and throughput workloads with kv_cache_dtype auto vs
     fp8: mean decode step, wall time, KV blocks.

    PYTHONPATH=. python3 benchmarks/fp8_kv.py /tmp/bench-0.6b    # H200: ~3 minutes
    PYTHONPATH=. python3 benchmarks/fp8_kv.py --smoke            # CPU, tiny model, tiny shapes
"""
import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():   # --smoke: the Triton kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]   # the tests' FP8 case builders

from asynct import LLM  # noqa: E402
from asynct.entrypoints.bench import copy_bandwidth, decode_roofline, run_engine, workload  # noqa: E402
from asynct.ops import asynci_decode_triton, write_kv_cache_ref, write_kv_cache_triton  # noqa: E402
from asynct.ops.kv_cache import quantize_fp8  # noqa: E402

HQ, HKV, D, BS = 8, 4, 128, 16


def timed(fns, device, reps=20):
    """Seconds per call: on CUDA a replayed graph of all fns (benchmarks/kernel_bench.py), else a
    plain loop (the smoke run only checks that everything runs)."""
    if device.type == "cuda":
        from kernel_bench import bench
        return bench(fns, reps)
    t0 = time.perf_counter()
    for f in fns:
        f()
    return (time.perf_counter() - t0) / len(fns)


def interpret_loop_bounds():
    """--smoke: Triton 3.6's interpreter needs scalars' __index__ under NumPy >= 2.4 (as the
    tests' _interpreter_scalars fixture does)."""
    import triton.runtime.interpreter as interp
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    interp._patch_lang_tensor = patched


def kernel_timing(device, b, t, copy_bw):
    """Decode over a bf16 and an FP8 cache: several input sets so that HBM, not L2, serves."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    sigma = torch.randn(HQ, device=device)
    nblk = b * -(-t // BS)
    n_sets = max(1, min(16, int(2e9 // (2 * nblk * BS * HKV * D * 2)))) if device.type == "cuda" else 1
    rows = []
    for kind in ("auto", "fp8"):
        fns = []
        for _ in range(n_sets):
            cache = torch.randn(2, nblk, BS, HKV, D, device=device, generator=gen).to(dt)
            scales = {}
            if kind == "fp8":
                ks = vs = torch.full((HKV, D), 4.5 / 448, device=device)
                cache = torch.stack([quantize_fp8(cache[0], ks), quantize_fp8(cache[1], vs)])
                scales = dict(k_scale=ks, v_scale=vs)
            table = torch.randperm(nblk, device=device, generator=gen).int().view(b, -1)
            q = torch.randn(b, HQ, D, device=device, dtype=dt)
            seq = torch.full((b,), t, dtype=torch.int32, device=device)
            fns.append(lambda q=q, c=cache, tb=table, s=seq, o=torch.empty_like(q), kw=scales:
                       asynci_decode_triton(q, c, tb, s, sigma, D ** -0.5, 3, True, o, max_seq_len=t, **kw))
        sec = timed(fns, device)
        kv_bytes = 2 * b * t * HKV * D * cache.element_size()
        rows.append(dict(part="kernel", kv=kind, shape=f"B={b} T={t}", us=sec * 1e6,
                         kv_tb_s=kv_bytes / sec / 1e12, x_copy=kv_bytes / sec / copy_bw))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def correctness(device):
    """Relative errors of the FP8 kernels against the FP8 torch reference (bf16 on a GPU)."""
    import test_fp8_kv as t
    dt, big = (torch.bfloat16, True) if device.type == "cuda" else (torch.float32, False)
    dev = device.type
    lens = [1, 17, 1000, 4097] if big else [1, 17, 70]
    shared = [700 + 37 * i for i in range(200)] if big else [40, 45, 50]
    prefix_blocks = 640 // BS if big else 2
    q_lens, ctx = ([300, 1, 77, 1024], [0, 500, 1000, 31]) if big else ([5, 20], [9, 0])
    d = D if big else 16
    extra = {} if big else dict(block_m=16, block_n=16)
    errs = {
        "decode": t.run_decode(asynci_decode_triton, lens, HQ, HKV, d, BS, 3, True, dt, dev)[0],
        "cascade": t.run_decode(asynci_decode_triton, shared, HQ, HKV, d, BS, 3, True, dt, dev,
                                prefix_blocks=prefix_blocks)[0],
        "prefill": t.run_prefill(q_lens, ctx, HQ, HKV, d, BS, 3, True, dt, dev, **extra),
    }
    got = t.write_case(write_kv_cache_triton, dev, dt)[4].float()
    errs["write_mismatch"] = (got != t.write_case(write_kv_cache_ref, dev, dt)[4].float()).float().mean().item()
    row = dict(part="correctness", **errs, ok=max(errs.values()) < 1e-2)
    print(json.dumps(row), flush=True)
    return [row]


def engine_runs(model, workloads, scale, copy_bw, engine_kw):
    rows = []
    for kv in ("auto", "fp8"):
        llm = LLM(str(model), kv_cache_dtype=kv, **engine_kw)
        eng = llm.llm_engine
        for name in workloads:
            reqs = workload(name, eng.config.vocab_size, scale)
            run_engine(llm, reqs[:8])                                       # warm-up, same shapes
            res = run_engine(llm, reqs)
            batch = min(len(reqs), eng.args.max_num_seqs) if name == "throughput" else None
            roof = decode_roofline(res, llm, copy_bw, batch, reqs)
            rows.append(dict(part="engine", kv=kv, workload=name, wall_s=res["wall_s"],
                             step_ms=roof.get("step_ms", float("nan")),
                             roofline_ms=roof.get("roofline_ms", float("nan")),
                             decode_batch=roof.get("decode_batch"), num_blocks=eng.block_manager.num_blocks))
            print(json.dumps(rows[-1]), flush=True)
        del llm, eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def summary(rows):
    """fp8 / auto ratios: the numbers the issue's targets are stated in."""
    print("\n| measure | auto | fp8 | fp8 / auto | target |\n|---|---:|---:|---:|---|")
    pick = lambda **kw: [r for r in rows if all(r.get(k) == v for k, v in kw.items())]  # noqa: E731
    for a, f in zip(pick(part="kernel", kv="auto"), pick(part="kernel", kv="fp8")):
        print(f"| decode kernel {a['shape']} (us; {f['x_copy']:.2f} of copy bw) | {a['us']:.1f} | "
              f"{f['us']:.1f} | {f['us'] / a['us']:.3f} | ~0.5 |")
    targets = {("gsm8k", "step_ms"): "<= 0.65", ("throughput", "wall_s"): "<= 0.75"}
    for a in pick(part="engine", kv="auto"):
        f = pick(part="engine", kv="fp8", workload=a["workload"])[0]
        for key in ("step_ms", "wall_s", "num_blocks"):
            target = targets.get((a["workload"], key), "2.0" if key == "num_blocks" else "")
            print(f"| {a['workload']} {key} | {a[key]:.4g} | {f[key]:.4g} | {f[key] / a[key]:.3f} | {target} |")
    for r in pick(part="correctness"):
        print(f"| FP8 kernels vs FP8 reference (rel err) | | {', '.join(f'{k} {v:.1e}' for k, v in r.items() if k not in ('part', 'ok'))} | | "
              f"{'PASS' if r['ok'] else 'FAIL'} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="checkpoint dir (bench-0.6b)")
    p.add_argument("--smoke", action="store_true", help="CPU: a random tiny model and tiny shapes")
    p.add_argument("--workloads", default="gsm8k,throughput")
    p.add_argument("--scale", type=float, default=None, help="workload scale (default 1, smoke 0.05)")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if device.type != "cuda" and not a.smoke:
        p.error("no CUDA device: run with --smoke to check the script on the CPU")
    model = a.model
    if a.smoke and model is None:
        from asynct.model.checkpoint import make_checkpoint
        model = make_checkpoint("tiny", Path(tempfile.mkdtemp()) / "tiny", tokenizer=False)
    if model is None:
        p.error("give the bench-0.6b checkpoint dir (asynct make-checkpoint DIR --preset bench-0.6b)")
    if device.type != "cuda":
        interpret_loop_bounds()
    copy_bw = copy_bandwidth(device)
    print(f"device {device}: copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    b, t = (256, 1024) if device.type == "cuda" else (4, 64)
    rows = kernel_timing(device, b, t, copy_bw)
    rows += correctness(device)
    engine_kw = dict(device=str(device)) if device.type == "cuda" else dict(device="cpu", num_kv_blocks=256,
                                                                            max_num_seqs=16)
    rows += engine_runs(model, a.workloads.split(","), a.scale or (1.0 if device.type == "cuda" else 0.05),
                        copy_bw, engine_kw)
    summary(rows)


if __name__ == "__main__":
    main()
