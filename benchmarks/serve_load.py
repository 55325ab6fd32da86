"""Load on `asynct serve`: request throughput, output tokens/s, p50/p99 time to first token and
inter-token latency at each concurrency, then `LLM.generate` on a like-drawn prompt set in the same
run. `overhead` = offline output tok/s / served output tok/s: what HTTP, SSE and the asyncio bridge
cost (1.0: nothing; 1.25: the server delivers 80 % of offline throughput); `server_cpu` and
`client_cpu`: cores busy in the server and in the load generator; `server_threads`: the server's
threads busy above a tenth of a core (4 or so: more is a pool spinning, as torch's intra-op
threads once did in the engine process, 15 of them at 0.6 core each). Prints a table last.

    PYTHONPATH=. python3 benchmarks/serve_load.py                        # GPU: bench-0.6b preset
    PYTHONPATH=. python3 benchmarks/serve_load.py --num-prompts 32       # CPU smoke run: tiny preset

Prompts are random token ids (the bench preset has no tokenizer) with `ignore_eos`, so every
request produces exactly --output-len tokens. The server runs as a subprocess (the load generator
must not share its GIL); it is stopped before the offline run so both get the whole GPU.
"""
import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from asynct.entrypoints.cli import add_engine_args, engine_kwargs  # noqa: E402
from asynct.entrypoints.serve.launch import ServerProcess  # noqa: E402


def parse_args():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: a bench-0.6b checkpoint on CUDA, tiny else)")
    p.add_argument("--num-prompts", type=int, default=1024 if cuda else 32)
    p.add_argument("--concurrency", default="64,256", help="comma-separated client counts")
    p.add_argument("--input-len", type=int, default=512 if cuda else 32, help="prompt tokens, up to (U[len/2, len])")
    p.add_argument("--output-len", type=int, default=128 if cuda else 16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="load-generator processes")
    add_engine_args(p)
    return p.parse_args()


def default_model(cuda: bool) -> Path:
    from asynct.model.checkpoint import make_checkpoint
    preset = "bench-0.6b" if cuda else "tiny"
    out = Path(tempfile.gettempdir()) / f"asynct-serve-bench-{preset}"
    if not (out / "config.json").exists():   # made once, reused by later runs
        make_checkpoint(preset, out, seed=0)
    return out


def make_prompts(n, input_len, vocab, seed) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(max(1, input_len // 2), input_len))] for _ in range(n)]


def engine_flags(a) -> list[str]:
    """The engine options given on our command line, as `asynct serve` flags."""
    defaults = vars(_engine_defaults())
    flags = []
    for key, value in engine_kwargs(a).items():
        if value == defaults[key]:
            continue
        name = "--" + key.replace("_", "-")
        if key == "enable_prefix_caching":
            flags.append("--no-prefix-caching")
        elif isinstance(value, bool):
            flags.append(name)
        else:
            flags += [name, str(value)]
    return flags


def _engine_defaults():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args([])


# ---- the HTTP side ---------------------------------------------------------------------------
# One Python process cannot parse 30k SSE events/s: the load comes from several client processes,
# each an asyncio loop with its share of the clients, so the figures measure the server.
async def one_request(session, url, prompt, output_len) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft, last, itl, tokens = None, t0, [], 0
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return {"ok": False, "error": f"HTTP {r.status}"}
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                k = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                if not k:
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:   # a chunk carries several tokens when the client fell behind: split its gap
                    itl += [(now - last) / k] * k
                last, tokens = now, tokens + k
    except aiohttp.ClientError as e:
        return {"ok": False, "error": repr(e)}
    tpot = (last - t0 - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return {"ok": tokens == output_len, "ttft": ttft, "itl": itl, "tpot": tpot, "tokens": tokens, "end": last,
            "error": None if tokens == output_len else f"{tokens} tokens"}


async def client_share(url, prompts, output_len, clients, start_at) -> tuple[list[dict], float]:
    """`clients` closed-loop clients working through `prompts`, starting at perf_counter `start_at`
    (CLOCK_MONOTONIC: the same clock in every process)."""
    sem = asyncio.Semaphore(clients)
    conn = aiohttp.TCPConnector(limit=clients + 8)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def bounded(p):
            async with sem:
                return await one_request(session, url, p, output_len)
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        cpu0 = time.process_time()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
    return results, time.process_time() - cpu0


def _client_proc(args):
    return asyncio.run(client_share(*args))


def cpu_seconds(procs) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def thread_seconds(procs) -> dict:
    """(pid, thread id) -> CPU seconds, for every thread of `procs`."""
    return {(p.pid, t.id): t.user_time + t.system_time for p in procs for t in p.threads()}


def run_level(url, prompts, output_len, concurrency, procs, server_pid) -> dict:
    procs = max(1, min(procs, concurrency))
    shares = [(url, prompts[i::procs], output_len, concurrency // procs + (i < concurrency % procs))
              for i in range(procs)]
    server = psutil.Process(server_pid)
    server = [server] + server.children(recursive=True)      # the engine process too
    with mp.get_context("fork").Pool(procs) as pool:
        start_at = time.perf_counter() + 0.5          # every process connects and waits for this
        server_cpu0, threads0 = cpu_seconds(server), thread_seconds(server)
        parts = pool.map(_client_proc, [share + (start_at,) for share in shares])
    results = [r for rs, _ in parts for r in rs]
    wall = max(r.get("end", start_at) for r in results) - start_at
    server_cpu = cpu_seconds(server) - server_cpu0
    busy = [k for k, t in thread_seconds(server).items() if t - threads0.get(k, 0.0) > 0.1 * wall]
    row = summarize(f"server, {concurrency} clients", results, wall)
    row["server_cpu"], row["client_cpu"] = server_cpu / wall, sum(cpu for _, cpu in parts) / wall
    row["server_threads"] = len(busy)
    return row


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(name, results, wall) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    errors = [r["error"] for r in results if not r["ok"]]
    if errors:
        print(f"{name}: {len(errors)} failed, e.g. {errors[:3]}", file=sys.stderr)
    return {"name": name, "requests": len(results), "failed": len(errors), "wall_s": wall,
            "req_s": len(ok) / wall, "out_tok_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "tpot_p50_ms": 1e3 * pct(tpot, 50)}


def serve_levels(a, model, prompt_sets, levels) -> list[dict]:
    rows = []
    server = ServerProcess(model, "--served-model-name", "bench", *engine_flags(a))
    with server as url:
        # warm-up on a like-drawn set (graphs, allocator, CPU kernels per shape): both sides get one
        run_level(url, prompt_sets[0], a.output_len, max(levels), a.client_procs, server.proc.pid)
        for c, prompts in zip(levels, prompt_sets[1:]):
            rows.append(run_level(url, prompts, a.output_len, c, a.client_procs, server.proc.pid))
            print(_row(rows[-1]), flush=True)
    return rows


def offline(a, model, warmup, prompts) -> dict:
    from asynct import LLM, SamplingParams
    llm = LLM(str(model), **engine_kwargs(a))
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate(warmup, params, use_tqdm=False)                         # the same warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"name": "LLM.generate (offline)", "requests": len(prompts), "failed": 0, "wall_s": wall,
            "req_s": len(prompts) / wall, "out_tok_s": tokens / wall}


COLS = ["requests", "failed", "wall_s", "req_s", "out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
        "itl_p99_ms", "tpot_p50_ms", "server_cpu", "server_threads", "client_cpu", "overhead"]


def _fmt(v):
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _row(r) -> str:
    return "| " + " | ".join([r["name"]] + [_fmt(r.get(c)) for c in COLS]) + " |"


def main():
    a = parse_args()
    cuda = torch.cuda.is_available()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = Path(a.model) if a.model else default_model(cuda)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    levels = [int(c) for c in a.concurrency.split(",")]
    # a fresh prompt set per run: a repeated one would be served from the prefix cache; the sets are
    # drawn alike, so the offline run on the last set is the same workload as every level
    prompt_sets = [make_prompts(a.num_prompts, a.input_len, vocab, a.seed + 1000 * i) for i in range(len(levels) + 1)]
    print(f"model {model}, {a.num_prompts} prompts of <= {a.input_len} tokens, {a.output_len} out, "
          f"device {torch.cuda.get_device_name() if cuda else 'cpu'}", flush=True)
    rows = serve_levels(a, model, prompt_sets, levels)
    if not a.skip_offline:
        base = offline(a, model, prompt_sets[0], prompt_sets[-1])
        for r in rows:      # how much throughput HTTP, SSE and the asyncio bridge cost
            r["overhead"] = base["out_tok_s"] / r["out_tok_s"] if r["out_tok_s"] else None
        rows.append(base)
    print("\n| run | " + " | ".join(COLS) + " |")
    print("|---" * (len(COLS) + 1) + "|")
    for r in rows:
        print(_row(r))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
