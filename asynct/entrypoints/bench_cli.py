"""`asynct bench`: its options, the loop over workloads, and the table, JSON and plot it writes.
The measurements are bench.py's.

Every run measures the device's copy bandwidth first, so the roofline ratio is from one run."""
import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

from asynct.entrypoints.bench import (DEFAULT_WORKLOADS, WORKLOADS, copy_bandwidth, decode_roofline, matmul_flops,
                                     prefill_roofline, run_engine, run_hf, workload)
from asynct.entrypoints.breakdown import breakdown, print_breakdown


def _compiles(device):
    """Counts Triton compiles on CUDA (the interpreter compiles nothing)."""
    from asynct.ops._triton import triton
    from asynct.ops.compile_pass import CompileCounter
    return CompileCounter() if device.type == "cuda" and triton is not None else contextlib.nullcontext()


def _compiled(counter) -> str:
    return f" ({len(counter.compiles)} Triton compiles, {counter.seconds:.1f} s)" if counter else ""


def print_table(rows):
    cols = ["workload", "wall_s", "requests", "output_tok_s", "prefill_tok_s", "prefill_over_roofline", "decode_batch",
            "step_ms", "roofline_ms", "step_over_roofline", "compiles", "hf_output_tok_s", "speedup_vs_hf"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c, "")) for c in cols))


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["workload"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["output_tok_s"] for r in rows], 0.4, label="asynct")
    ax.bar([x + 0.2 for x in xs], [r.get("hf_output_tok_s", 0) for r in rows], 0.4, label="HF eager")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("output tokens/s")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_parser(sub):
    from asynct.entrypoints.cli import HelpFormatter, add_engine_args
    from asynct.presets import PRESETS
    p = sub.add_parser("bench", help="end-to-end benchmark against the roofline and HF eager",
                       formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: a temporary --preset checkpoint, "
                   "removed afterwards)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default: bench-0.6b on CUDA, tiny elsewhere")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), type=workload_names,
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (prefill: 512 prompts scored, "
                   "against a matmul's FLOP rate measured in the run)")
    p.add_argument("--scale", type=float, default=1.0, help="scales request counts and lengths")
    p.add_argument("--compare", choices=["hf"], default=None, help="also time the reference model's generate")
    p.add_argument("--hf-requests", type=int, default=None,
                   help="most requests in the HF run (default 512): one batch of the largest size that fits")
    p.add_argument("--breakdown", action="store_true",
                   help="per step kind: steps, wall, device and host time, Triton compiles")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the 8-request warm-up before each workload (what a new user meets)")
    p.add_argument("--plot", default=None, help="write a bar chart (PNG) here")
    p.add_argument("--json-out", default=None, help="write every row as JSON here")
    add_engine_args(p)
    p.set_defaults(fn=cmd_bench)


def workload_names(s: str) -> list[str]:
    names = s.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    return names


def cmd_bench(a):
    if a.data_parallel_size != 1:   # its step log and roofline read one in-process engine
        raise SystemExit("asynct bench times one engine; for data parallel run benchmarks/dp_bench.py")
    _refuse_ignored(a)
    from asynct.engine.engine_args import resolve_device
    device = resolve_device(a.device)
    if a.model:
        return bench(a, a.model, device)
    preset = a.preset or ("bench-0.6b" if device.type == "cuda" else "tiny")
    from asynct.model.checkpoint import make_checkpoint
    with tempfile.TemporaryDirectory(prefix="asynct-bench-") as tmp:  # 1.2 GB for bench-0.6b
        return bench(a, make_checkpoint(preset, Path(tmp) / preset, tokenizer=False), device)


def _refuse_ignored(a):
    """Options that only mean something with another: each was taken and did nothing."""
    if a.model and a.preset:
        raise ValueError("--preset makes a temporary checkpoint and --model names one: give one of them")
    if a.compare is None and a.hf_requests is not None:
        raise ValueError("--hf-requests sizes the HF run: it needs --compare hf")


def bench(a, model, device):
    from asynct import LLM
    from asynct.entrypoints.cli import engine_kwargs
    import asynct
    # which tree ran: `python -m` puts the working directory ahead of PYTHONPATH, so a peer tree
    # named only in PYTHONPATH and run from a checkout's root silently ran the checkout
    print(f"asynct {asynct.__version__} from {Path(asynct.__file__).parent}", flush=True)
    bw = copy_bandwidth(device)
    print(f"device {device}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    with _compiles(device) as startup:
        t0 = time.perf_counter()
        llm = LLM(str(model), **engine_kwargs(a))
    from asynct.engine.llm_engine import startup_text
    parts = startup_text(llm.llm_engine.startup_seconds)
    print(f"engine start {time.perf_counter() - t0:.1f} s ({parts})" + _compiled(startup), flush=True)
    if "prefill" in a.workloads:
        flops = matmul_flops(device, llm.llm_engine.dtype)
        print(f"matmul {flops / 1e12:.3g} TFLOP/s ({llm.llm_engine.dtype}): the prefill workload's roof", flush=True)
    rows = []
    for name in a.workloads:
        reqs = workload(name, llm.llm_engine.config.vocab_size, a.scale)
        if not a.no_warmup:
            run_engine(llm, reqs[: min(len(reqs), 8)])                  # warm-up, same shapes
        print(f"workload {name}: {len(reqs)} requests", flush=True)
        with _compiles(device) as during:
            res = run_engine(llm, reqs, progress=True)
        batch = min(len(reqs), a.max_num_seqs) if name == "throughput" else None
        if name == "prefill":
            roof = prefill_roofline(res, llm, reqs, flops)
        else:
            roof = decode_roofline(res, llm, bw, batch, reqs)
        if a.breakdown:
            print_breakdown(name, breakdown(res["step_log"]), during)
        res.pop("step_log")
        res.pop("cached_per_request")
        row = {"workload": name, **res, **roof, "compiles": len(during.compiles) if during else None}
        if a.compare == "hf":
            most = 512 if a.hf_requests is None else a.hf_requests
            print(f"workload {name}: the reference model's generate, up to {most} requests", flush=True)
            hf = run_hf(model, reqs, device, llm.llm_engine.dtype, most)
            row.update(hf_output_tok_s=hf["output_tok_s"], hf_batch=hf["batch"],
                       speedup_vs_hf=row["output_tok_s"] / hf["output_tok_s"])
        rows.append(row)
        print(json.dumps(row))
    if a.plot:
        plot(rows, a.plot)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"copy_bandwidth": bw, "rows": rows}, indent=1))
    print_table(rows)
