"""Evaluation speed: `asynct eval` next to `lm_eval --model hf` on the same gsm8k-shaped task.

The task is the shipped `tiny_gsm_bench`: 1,319 problems (gsm8k test's size), one shared 5-shot
prefix, greedy, max_gen_toks 256; `--task tiny_gsm_mc` times a multiple-choice task instead (200
questions x 4 choices, loglikelihood: arc_easy's shape). The model is a random-weight preset
with the byte tokenizer: random weights rarely emit a stop string, so nearly every request
decodes all 256 tokens, the worst case of gsm8k's workload. Each backend runs as its own process (start-up, model load and
CUDA graph capture count, as a user would see them), timed by wall clock.

    PYTHONPATH=. python3 benchmarks/eval_bench.py                          # GPU: bench-0.6b
    PYTHONPATH=. python3 benchmarks/eval_bench.py --preset tiny --limit 4  # CPU smoke test
    ... --hf-limit 200   # time hf on the first 200 problems only; its evaluation time (start-up
                         # excluded) is extrapolated to the whole task (marked "~")
    ... --task tiny_gsm_mc --skip-hf   # the multiple-choice task, asynct only
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = {"tiny_gsm_bench": ("exact_match,strict-match", 1319, "5-shot, max_gen_toks 256"),
         "tiny_gsm_mc": ("acc,none", 200, "4 choices, loglikelihood")}   # metric, problems, what
GENERATE_TASKS = {"tiny_gsm_bench"}

# Times the evaluation apart from start-up, so a run on part of the task extrapolates only the part
# that grows with the number of problems.
HF_SNIPPET = """
import sys, json, time, asynct, lm_eval
from lm_eval.models.huggingface import HFLM
from asynct.integrations.lm_eval_cli import task_manager
model_dir, limit, batch, device, dtype, out, task = sys.argv[1:8]
lm = HFLM(pretrained=model_dir, dtype=dtype, batch_size=int(batch), device=device)
t0 = time.perf_counter()
r = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=int(limit) if limit != "None" else None,
                            task_manager=task_manager())
json.dump({"results": r["results"], "eval_s": time.perf_counter() - t0}, open(out, "w"), default=str)
"""


def make_model(preset: str, out: Path) -> Path:
    from asynct.model.checkpoint import make_checkpoint
    if not (out / "config.json").exists():
        make_checkpoint(preset, out, seed=0, tokenizer=True)  # byte tokenizer: no hub needed
    return out


def timed(cmd: list[str], env: dict) -> tuple[float, int, str]:
    """Wall seconds, exit code and stdout."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if p.returncode:
        print(f"FAILED ({p.returncode}): {' '.join(cmd)}\n{(p.stdout + p.stderr)[-3000:]}", file=sys.stderr)
    return secs, p.returncode, p.stdout


def score(results_file: Path | None, task: str) -> float | None:
    try:
        res = json.loads(results_file.read_text())
        res = res.get("results", res)[task]
        return float(res[TASKS[task][0]])
    except (AttributeError, OSError, KeyError, ValueError):
        return None


def run_asynct(model, task, limit, work, env, extra):
    out = work / "asynct"
    cmd = [sys.executable, "-m", "asynct.entrypoints.cli", "eval", "--model", str(model), "--tasks", task,
           "--output_path", str(out)] + (["--limit", str(limit)] if limit else []) + extra
    secs, rc, tail = timed(cmd, env)
    return secs, rc, score(max(out.rglob("results_*.json"), default=None), task), tail  # lm-eval's layout


def hf_scale(limit: int, n: int, batch: int, generate: bool) -> float:
    """The whole task's evaluation time over the timed part's. hf's generate_until runs
    batches of `batch` requests, each as long as its longest generation (random weights:
    max_gen_toks in every row), so a partial batch costs a whole one: scaled by batches.
    Loglikelihood requests cost their tokens: scaled by problems."""
    if generate:
        return math.ceil(n / batch) / math.ceil(limit / batch)
    return n / limit


def run_hf(model, limit, n, work, env, args):
    """Wall time of `lm_eval --model hf`, extrapolated to n problems when it ran on fewer."""
    out = work / "hf.json"
    cmd = [sys.executable, "-c", HF_SNIPPET, str(model), str(limit), str(args.hf_batch_size),
           args.device, args.hf_dtype, str(out), args.task]
    secs, rc, tail = timed(cmd, env)
    if rc == 0 and limit < n:
        eval_s = json.loads(out.read_text())["eval_s"]
        secs += eval_s * (hf_scale(limit, n, args.hf_batch_size, args.task in GENERATE_TASKS) - 1)
    return secs, rc, score(out, args.task), tail


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench-0.6b")
    ap.add_argument("--model", type=Path, default=None, help="an existing checkpoint instead of a preset")
    ap.add_argument("--task", default="tiny_gsm_bench", choices=sorted(TASKS))
    ap.add_argument("--limit", type=int, default=None, help="problems for both backends (default: all)")
    ap.add_argument("--hf-limit", type=int, default=None, help="problems for hf only; its time is extrapolated")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-dtype", default="auto")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--asynct-args", default="", help="extra `asynct eval` options, e.g. '--model_args max_num_seqs=512'")
    args = ap.parse_args(argv)
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = args.work or Path(tempfile.mkdtemp(prefix="eval_bench_"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    model = args.model or make_model(args.preset, work / args.preset)
    _, n_docs, what = TASKS[args.task]
    n = min(args.limit or n_docs, n_docs)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"model {model} ({args.preset if not args.model else 'given'}), {args.task}: {n} problems, {what}, "
          f"{gpu}", flush=True)

    rows = []
    secs, rc, em, out = run_asynct(model, args.task, args.limit, work, env, args.asynct_args.split())
    line = next((line for line in out.splitlines() if line.startswith("asynct eval:")), "")
    print(f"{line}; the process: {secs:.1f} s (interpreter and imports: the difference)", flush=True)
    rows.append(("asynct eval", n, secs, em, rc, False))
    if not args.skip_hf:
        hn = min(args.hf_limit or n, n)
        secs_h, rc_h, em_h, _ = run_hf(model, hn, n, work, env, args)
        rows.append(("lm_eval --model hf", n, secs_h, em_h, rc_h, hn < n))
    print_table(rows, TASKS[args.task][0])
    return 0 if all(r[4] == 0 for r in rows) else 1


def print_table(rows, metric):
    print(f"\n| backend | problems | wall s | problems/s | {metric} | vs hf |")
    print("|---|---:|---:|---:|---:|---:|")
    hf = next((r for r in rows if "hf" in r[0] and r[4] == 0), None)
    for name, n, secs, em, rc, extrapolated in rows:
        mark = "~" if extrapolated else ""
        ratio = f"{hf[2] / secs:.1f}x" if hf and rc == 0 else "-"
        status = "" if rc == 0 else f" (exit {rc})"
        em_s = f"{em:.4f}" if em is not None else "-"
        print(f"| {name}{status} | {n} | {mark}{secs:.1f} | {mark}{n / secs:.2f} | {em_s} | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
