"""`asynct bench`: end-to-end workloads, the roofline of a decode step, and HF eager as the peer.

Every run measures the device's copy bandwidth first, so the roofline ratio is from one run."""
import argparse
import contextlib
import json
import random
import tempfile
import time
from pathlib import Path

from asynct.engine.sampling_params import SamplingParams
from asynct.entrypoints.breakdown import breakdown, print_breakdown

WORKLOADS = ("throughput", "gsm8k", "latency")


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a large device copy (median of 10)."""
    import torch
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        t0 = _now(device)
        dst.copy_(src)
        times.append(_now(device) - t0)
    return 2 * n / sorted(times[2:])[len(times[2:]) // 2]


def _now(device) -> float:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def workload(name: str, vocab: int, scale: float, seed: int = 0):
    """(prompt token ids, SamplingParams) per request, as the issue defines each workload."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    s = lambda x: max(1, int(x * scale))  # noqa: E731
    if name == "throughput":   # nano-vllm's: 256 seqs, input and output uniform in [100, 1024]
        return [(tok(rng.randint(s(100), s(1024))),
                 SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randint(s(100), s(1024))))
                for _ in range(s(256))]
    if name == "gsm8k":        # one shared ~700-token 5-shot prefix, a 50-150 token question, <= 256 new
        prefix = tok(s(700))
        return [(prefix + tok(rng.randint(s(50), s(150))),
                 SamplingParams(temperature=0, ignore_eos=True, max_tokens=s(256))) for _ in range(s(1319))]
    if name == "latency":
        return [(tok(s(128)), SamplingParams(temperature=0, ignore_eos=True, max_tokens=s(512)))]
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


def weight_bytes(model) -> int:
    """Bytes one step reads: every weight once (the token embedding only as a tied head)."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters())
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def run_engine(llm, requests, progress: bool = False) -> dict:
    engine = llm.llm_engine
    engine.step_log = []
    before = dict(engine.stats)
    t0 = _now(engine.device)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [sp for _, sp in requests],
                        use_tqdm=progress)
    wall = _now(engine.device) - t0
    _refuse_failed(outs)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prefill = engine.stats["prompt_tokens"] - before["prompt_tokens"]
    log, engine.step_log = engine.step_log, None
    return {"wall_s": wall, "requests": len(requests), "output_tokens": out_tokens,
            "output_tok_s": out_tokens / wall, "prefill_tokens": prefill, "prefill_tok_s": prefill / wall,
            "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs), "step_log": log}


def _refuse_failed(outs):
    """A request the engine refused (a prompt past max_model_len) comes back as an error output:
    its row reported the workload's request count and a rate over what was left of it."""
    failed = [o.error for o in outs if o.error]
    if failed:
        raise ValueError(f"{len(failed)} of {len(outs)} requests failed, first: {failed[0]} (the workloads' "
                         "lengths scale with --scale: lower it, or raise --max-model-len)")


def decode_roofline(result, llm, bandwidth, batch=None) -> dict:
    """Mean decode-step time (at `batch` running sequences, or all decode steps) against
    (weights + KV actually read) / copy bandwidth."""
    eng = llm.llm_engine
    steps = [r for r in result["step_log"] if r.kind in ("graph", "decode")
             and (batch is None or r.num_seqs == batch)]
    if not steps:
        return {}
    kv_per_token = eng.runner.block_bytes // eng.args.block_size
    wb = weight_bytes(eng.runner.model)
    mean = sum(r.wall_s for r in steps) / len(steps)
    roof = sum(wb + r.kv_tokens * kv_per_token for r in steps) / len(steps) / bandwidth
    return {"decode_steps": len(steps), "decode_batch": batch or round(sum(r.num_seqs for r in steps) / len(steps)),
            "step_ms": mean * 1e3, "roofline_ms": roof * 1e3, "step_over_roofline": mean / roof}


def run_hf(model_dir, requests, device, dtype, max_requests) -> dict:
    """The reference model's left-padded batched generate at the largest batch that fits."""
    import torch
    from asynct.model.reference import AsyncTForCausalLM
    model = AsyncTForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    sub = requests[:max_requests]
    batch = _largest_batch(model, sub, device)
    sub = sub[:batch]                      # one full batch at the size lm-eval's "auto" would pick
    t0, out_tokens = _now(device), 0
    for i in range(0, len(sub), batch):
        out_tokens += _hf_generate(model, sub[i:i + batch], device)
    wall = _now(device) - t0
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"wall_s": wall, "requests": len(sub), "batch": batch, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / wall}


def _hf_generate(model, reqs, device) -> int:
    import torch
    width = max(len(p) for p, _ in reqs)
    new = max(sp.max_tokens for _, sp in reqs)
    ids = torch.zeros(len(reqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(reqs):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    assert out.shape[1] - width == new
    return sum(sp.max_tokens for _, sp in reqs)   # the tokens asked for; the rest is padding work


def _largest_batch(model, reqs, device) -> int:
    """lm-eval's --batch_size auto: the largest power of two whose longest case runs."""
    import torch
    if device.type != "cuda":
        return min(len(reqs), 64)
    longest = max(reqs, key=lambda r: len(r[0]) + r[1].max_tokens)
    b = 1 << (len(reqs) - 1).bit_length()
    while b > 1:
        try:
            ids = torch.zeros(b, len(longest[0]) + longest[1].max_tokens, dtype=torch.long, device=device)
            with torch.inference_mode():
                model(ids)
            return b
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            b //= 2
    return 1


def _compiles(device):
    """Counts Triton compiles on CUDA (the interpreter compiles nothing)."""
    from asynct.ops._triton import CompileCounter, triton
    return CompileCounter() if device.type == "cuda" and triton is not None else contextlib.nullcontext()


def _compiled(counter) -> str:
    return f" ({len(counter.compiles)} Triton compiles, {counter.seconds:.1f} s)" if counter else ""


def print_table(rows):
    cols = ["workload", "wall_s", "requests", "output_tok_s", "prefill_tok_s", "decode_batch", "step_ms",
            "roofline_ms", "step_over_roofline", "compiles", "hf_output_tok_s", "speedup_vs_hf"]
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
    p.add_argument("--workloads", default=",".join(WORKLOADS), type=workload_names,
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
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
    bw = copy_bandwidth(device)
    print(f"device {device}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    with _compiles(device) as startup:
        t0 = time.perf_counter()
        llm = LLM(str(model), **engine_kwargs(a))
    from asynct.engine.llm_engine import startup_text
    parts = startup_text(llm.llm_engine.startup_seconds)
    print(f"engine start {time.perf_counter() - t0:.1f} s ({parts})" + _compiled(startup), flush=True)
    rows = []
    for name in a.workloads:
        reqs = workload(name, llm.llm_engine.config.vocab_size, a.scale)
        if not a.no_warmup:
            run_engine(llm, reqs[: min(len(reqs), 8)])                  # warm-up, same shapes
        print(f"workload {name}: {len(reqs)} requests", flush=True)
        with _compiles(device) as during:
            res = run_engine(llm, reqs, progress=True)
        batch = min(len(reqs), a.max_num_seqs) if name == "throughput" else None
        roof = decode_roofline(res, llm, bw, batch)
        if a.breakdown:
            print_breakdown(name, breakdown(res["step_log"]), during)
        res.pop("step_log")
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
