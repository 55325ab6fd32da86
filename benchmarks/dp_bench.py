"""Data-parallel scaling: the gsm8k-shaped workload of `asynct bench` (one shared ~700-token 5-shot
prefix, a 50-150 token question, 256 greedy tokens each, 1,319 requests) through
`LLM(data_parallel_size=N)` for N = 1, 2, ... up to the GPUs there are, each after a warm-up of
the same shapes; prints output tokens/s and the scaling against N=1 (the issue asks >= 1.9x at 2).

    PYTHONPATH=. python3 benchmarks/dp_bench.py                    # GPU: bench-0.6b, N = 1, 2, 4, 8 as GPUs allow
    PYTHONPATH=. python3 benchmarks/dp_bench.py --sizes 1,2 --model DIR
    PYTHONPATH=. python3 benchmarks/dp_bench.py --smoke            # CPU: tiny, a small scale, N = 1, 2

`asynct eval` on the same workload shape (the shipped tiny_gsm_bench task) with two engines:

    PYTHONPATH=. python3 benchmarks/eval_bench.py --skip-hf --asynct-args '--model_args data_parallel_size=2'

Every engine process runs with NVLink multicast off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1); this script sets both for itself too.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def run(model: str, size: int, scale: float, engine_kwargs: dict) -> dict:
    from asynct import LLM
    from asynct.entrypoints.bench import workload
    t0 = time.perf_counter()
    llm = LLM(model, data_parallel_size=size, **engine_kwargs)
    start = time.perf_counter() - t0
    reqs = workload("gsm8k", llm.llm_engine.vocab_size, scale)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    llm.generate(prompts[:8 * size], [sp for _, sp in reqs[:8 * size]], use_tqdm=False)   # warm-up, same shapes
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [sp for _, sp in reqs], use_tqdm=False)
    wall = time.perf_counter() - t0
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed at N={size}; first: {failed[0]}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if size > 1:
        llm.llm_engine.shutdown()
    del llm
    return {"data_parallel_size": size, "requests": len(reqs), "start_s": start, "wall_s": wall,
            "output_tokens": tokens, "output_tok_s": tokens / wall}


def default_sizes() -> list[int]:
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [n for n in (1, 2, 4, 8) if n <= max(gpus, 2)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a temporary --preset checkpoint)")
    ap.add_argument("--preset", default="bench-0.6b")
    ap.add_argument("--sizes", default=None, help="comma-separated N (default: 1, 2, 4, 8 as GPUs allow)")
    ap.add_argument("--scale", type=float, default=1.0, help="scales request counts and lengths")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny preset, scale 0.02, N = 1, 2")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    kwargs = {"max_num_seqs": a.max_num_seqs}
    if a.smoke:
        a.preset, a.scale, a.sizes = "tiny", min(a.scale, 0.02), a.sizes or "1,2"
        kwargs.update(max_num_seqs=8, num_kv_blocks=256, device="cpu")
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else default_sizes()
    with tempfile.TemporaryDirectory(prefix="dp_bench-") as tmp:
        model = a.model
        if model is None:
            from asynct.model.checkpoint import make_checkpoint
            model = str(make_checkpoint(a.preset, Path(tmp) / a.preset, tokenizer=False))
        rows = []
        for n in sizes:
            rows.append(run(model, n, a.scale, kwargs))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["output_tok_s"] if rows[0]["data_parallel_size"] == 1 else None
    print("\n| N | requests | wall s | output tok/s | vs N=1 |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['output_tok_s'] / base:.2f}x" if base else "-"
        print(f"| {r['data_parallel_size']} | {r['requests']} | {r['wall_s']:.1f} | {r['output_tok_s']:.0f} | {ratio} |")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
