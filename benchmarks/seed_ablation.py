"""The optimisation log of the original vLLM adaptation that asynct grew from ("the seed"),
reproduced: the gsm8k-shaped workload through each of its stages on one engine, each as a ratio
to HF eager measured in the same run (benchmarks/RESULTS.md has the table and the history).

    python benchmarks/seed_ablation.py [--requests 64] [--new-tokens 64] [--model DIR]
"""
import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import seed_backends  # noqa: E402,F401  (registers seed-loop / seed-padded / seed-bucketed)

from asynct import LLM, ops  # noqa: E402
from asynct.entrypoints.bench import run_hf, workload  # noqa: E402
from asynct.model.checkpoint import make_checkpoint  # noqa: E402

# stage, backend, fused ops, CUDA decode kernel, CUDA graphs, the original adaptation's seconds (HF: 771 s)
STAGES = [
    ("per-request Python loop", "seed-loop", False, False, False, 2131),
    ("padded batch", "seed-padded", False, False, False, None),       # the original adaptation's OOMed
    ("length-bucketed", "seed-bucketed", False, False, False, 928),
    ("vectorised gather", "torch", False, False, False, 457),
    ("Triton kernels", "triton", False, False, False, 362),
    ("CUDA decode, mixed-batch dispatch", "triton", False, True, False, None),
    # from here the engine's defaults: Triton decode (the CUDA kernel measured slower, RESULTS.md)
    ("fused DyHT/ReGLU/RoPE", "triton", True, False, False, 277),
    ("CUDA graphs", "triton", True, False, True, None),
]
SEED_HF = 771


@contextlib.contextmanager
def unfused_ops(fused: bool, cuda_decode: bool):
    """Swaps the fused kernels for their torch references, and the decode kernel choice."""
    from asynct.ops import cuda_ext
    saved = {n: getattr(ops, n) for n in ("dyht", "dyht_add", "qk_norm_rope", "reglu")}
    saved_cuda = cuda_ext.CUDA_DEFAULT
    if not fused:
        for n in saved:
            setattr(ops, n, getattr(ops, f"{n}_ref"))
    cuda_ext.CUDA_DEFAULT = cuda_decode
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(ops, n, fn)
        cuda_ext.CUDA_DEFAULT = saved_cuda


def use_backend(llm, name: str, graphs: bool):
    """Swaps the attention backend of a live engine (same cache layout), so every stage shares
    one loaded model and KV cache; graphs are captured only for the last stage."""
    from asynct.attention import get_backend_cls
    from asynct.engine.cuda_graph import CudaGraphRunner
    runner = llm.llm_engine.runner
    runner.backend = get_backend_cls(name)()
    runner.builder = runner.backend.get_builder_cls()(runner.block_size, runner.device)
    impl_cls = runner.backend.get_impl_cls()
    for layer in runner.model.layers:
        old = layer.attn.impl
        layer.attn.impl = impl_cls(old.num_heads, old.head_dim, old.num_kv_heads, old.scale, old.sigma,
                                   old.pool_size, old.relu_pre)
    runner.graphs = CudaGraphRunner(runner, llm.llm_engine.args.max_num_seqs) if graphs else None


def timed_generate(llm, reqs) -> float:
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:4]], [sp for _, sp in reqs[:4]], use_tqdm=False)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--stages", default=None, help="comma-separated stage indices")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    model = a.model or make_checkpoint("bench-0.6b" if cuda else "tiny", Path(tempfile.mkdtemp()) / "m",
                                       tokenizer=False)
    reqs = [r for r in workload("gsm8k", 151936 if cuda else 259, 1.0)][: a.requests]
    for _, sp in reqs:
        sp.max_tokens = a.new_tokens
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = run_hf(model, reqs, device, dtype, len(reqs))["wall_s"]
    rows = [("HF eager (reference generate)", hf, SEED_HF)]
    picked = [STAGES[int(i)] for i in a.stages.split(",")] if a.stages else STAGES
    llm = LLM(str(model), enforce_eager=True, gpu_memory_utilization=0.6, max_num_seqs=256)
    for name, backend, fused, cuda_dec, graphs, seed_s in picked:
        if not cuda and backend == "triton" and (cuda_dec or graphs):
            continue
        with unfused_ops(fused, cuda_dec):
            use_backend(llm, backend, graphs)
            rows.append((name, timed_generate(llm, reqs), seed_s))
        print(f"{name}: {rows[-1][1]:.2f} s", flush=True)
    print(f"\nworkload: {len(reqs)} gsm8k-shaped requests, {a.new_tokens} new tokens, {device}")
    print(f"{'stage':38s} {'time s':>8s} {'x HF':>7s} {'seed x HF':>10s}")
    for name, t, seed_s in rows:
        seed = f"{seed_s / SEED_HF:.2f}" if seed_s else "-"
        print(f"{name:38s} {t:8.2f} {t / hf:7.3f} {seed:>10s}")


if __name__ == "__main__":
    main()
