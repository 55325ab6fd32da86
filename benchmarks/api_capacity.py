"""What the server's API process can deliver when the engine costs next to nothing: `asynct serve`
as it runs (CLI, FastAPI app, uvicorn, AsyncEngine, CoreClient, the engine-core process and its
pipe), with the model replaced by `InstantEngine`, loaded by serve_load.py's streaming clients.
Prints output tokens/s, SSE events/s, tokens per event and the CPU of each side at each
concurrency; --profile adds a run sampled by py-spy (or cProfile) with the API process's hot
functions in microseconds per token; --baseline runs another tree's server in turn with this one.

    PYTHONPATH=. python benchmarks/api_capacity.py                              # 64 and 256 clients
    PYTHONPATH=. python benchmarks/api_capacity.py --profile py-spy --py-spy /tmp/pyspy/bin/py-spy
    git archive HEAD~1 | tar -x -C /tmp/base   # then, old and new in turn:
    PYTHONPATH=. python benchmarks/api_capacity.py --baseline /tmp/base --repeat 2

Only the model is bypassed: the engine-core loop (core_proc.EngineCore: deltas, snapshots, the
pipe) runs unchanged around `InstantEngine`, which steps up to --max-num-seqs sequences at once,
one new token (and its text) each per step, and returns the outputs of streaming requests every
step, as LLMEngine does. A step takes --step-ms: the default 2 ms (128k tokens/s at 256 sequences)
outruns the API process, so the front end is the ceiling and a slow client's tokens pile up into
fewer events; 5 ms is about one token an event. With 0 the engine finishes a request in a few ms,
before the loaded front end admits the next, and steps run a handful of sequences: not a regime a
real engine reaches. With several cores the API process gets CPU 0 to itself (its engine and the
clients share the rest; --no-pin: the scheduler decides), so its CPU is a core's at most.
"""
import argparse
import contextlib
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
SERVER_ROOT_ENV = "ASYNCT_API_CAPACITY_ROOT"     # --baseline's server (and its engine) import asynct there
sys.path.insert(0, os.environ.get(SERVER_ROOT_ENV) or str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from asynct.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402

STEP_MS_ENV, PROFILE_ENV = "ASYNCT_INSTANT_STEP_MS", "ASYNCT_API_PROFILE"
# what a tokenizer might decode: a few words, so that every chunk carries text as a real one does
WORDS = [" the", " of", " and", " to", " in", " model", " token", " server", ",", ".", " is", " a", " it",
         " stream", " fast", " data"]


class InstantEngine:
    """LLMEngine's surface as core_proc.EngineCore uses it, without a model: every running
    sequence gets one token a step; a request ends at its max_tokens (the load sets ignore_eos)."""

    def __init__(self, args):
        self.args = args
        config = json.loads((Path(args.model) / "config.json").read_text())
        self.vocab_size = config["vocab_size"]
        self.max_model_len = args.max_model_len or config.get("max_position_embeddings", 4096)
        self.startup_seconds = {}
        self.requests: dict[str, RequestOutput] = {}
        self.waiting, self.running = deque(), []
        self.max_tokens: dict[str, int] = {}
        self.stream: dict[str, bool] = {}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.scheduler = SimpleNamespace(running=self.running, waiting=self.waiting, num_preemptions=0)
        self.block_manager = SimpleNamespace(num_blocks=1 << 16, num_free_blocks=1 << 16, prefix_cache_hit_rate=0.0,
                                             num_queries=0, num_hits=0)
        self.step_s = float(os.environ.get(STEP_MS_ENV, "0")) / 1e3
        self.last_step = time.perf_counter()

    def summary(self) -> dict:
        return {}      # no start-up line

    def add_request(self, rid, ids, params, stream=False):
        if params.n != 1:
            raise ValueError("InstantEngine runs n=1 only")
        out = RequestOutput(rid, None, ids, None, [CompletionOutput(0, "", [], None, None)], False)
        self.requests[rid], self.max_tokens[rid], self.stream[rid] = out, params.max_tokens or 16, stream
        self.waiting.append(out)
        self.stats["prompt_tokens"] += len(ids)

    def abort_request(self, rid):
        out = self.requests.pop(rid, None)
        if out is not None:       # by identity: outputs are dataclasses, == compares their fields
            self.running[:] = [o for o in self.running if o is not out]
            kept = [o for o in self.waiting if o is not out]
            self.waiting.clear()
            self.waiting.extend(kept)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[RequestOutput]:
        self._pace()
        while self.waiting and len(self.running) < self.args.max_num_seqs:
            self.running.append(self.waiting.popleft())
        outputs, still = [], []
        for out in self.running:
            c = out.outputs[0]
            token = (len(out.prompt_token_ids) + len(c.token_ids)) % self.vocab_size
            c.token_ids.append(token)
            c.text += WORDS[token % len(WORDS)]
            if len(c.token_ids) >= self.max_tokens[out.request_id]:
                c.finish_reason, out.finished = "length", True
                del self.requests[out.request_id]
            else:
                still.append(out)
            if out.finished or self.stream[out.request_id]:
                outputs.append(out)
        self.stats["generation_tokens"] += len(self.running)
        self.stats["steps"] += 1
        self.running[:] = still
        return outputs

    def _pace(self):
        """--step-ms: a step no sooner than that after the last one (an engine of that speed)."""
        wait = self.last_step + self.step_s - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        self.last_step = time.perf_counter()


# ---- the server process ----------------------------------------------------------------------
def serve_instant(argv: list[str]) -> int:
    """`asynct serve ARGV` with InstantEngine in the engine process (the CLI's own path)."""
    import functools

    from asynct.entrypoints import cli
    from asynct.entrypoints.serve import api_server
    api_server.make_app = functools.partial(api_server.make_app, make_engine=InstantEngine)
    profile_on_signals(os.environ[PROFILE_ENV])
    return cli.main(["serve", *argv])


def profile_on_signals(path: str):
    """cProfile of the main thread (the event loop) from SIGUSR1 to SIGUSR2, written to `path`."""
    prof = cProfile.Profile()

    def stop(*_):
        prof.disable()
        prof.dump_stats(path)
    signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
    signal.signal(signal.SIGUSR2, stop)


# ---- the load --------------------------------------------------------------------------------
class CountingJson:
    """Stands in for the json module in serve_load's clients: one `loads` per SSE data event."""

    def __init__(self):
        self.events = 0

    def loads(self, s):
        self.events += 1
        return json.loads(s)


def client_proc(args):
    import asyncio

    import serve_load
    serve_load.json = counter = CountingJson()
    results, cpu = asyncio.run(serve_load.client_share(*args))
    return results, cpu, counter.events


def engine_counters(url) -> tuple[int, int]:
    """(steps, generated tokens) so far, from /metrics: the pace the engine kept."""
    import httpx
    text = httpx.get(url + "/metrics").text
    get = lambda name: int(float(re.search(rf"^asynct_{name}{{.*}} (\S+)$", text, re.M).group(1)))  # noqa: E731
    return get("engine_steps_total"), get("generation_tokens_total")


def loop_cpu_seconds(proc) -> float:
    """CPU seconds of a process's main thread: the API process's event loop (the others are the
    engine client's sender and receiver, and the tokenising workers)."""
    return sum(t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid)


def run_level(url, prompts, output_len, concurrency, procs, api, engine, name, sampler=None) -> dict:
    """serve_load.run_level's load, with the API process's CPU apart from the engine process's."""
    import serve_load
    procs = max(1, min(procs, concurrency))
    shares = [(url, prompts[i::procs], output_len, concurrency // procs + (i < concurrency % procs))
              for i in range(procs)]
    steps0 = engine_counters(url)
    with mp.get_context("fork").Pool(procs) as pool:
        start_at = time.perf_counter() + 0.5
        api0, loop0, engine0 = serve_load.cpu_seconds([api]), loop_cpu_seconds(api), serve_load.cpu_seconds([engine])
        job = pool.map_async(client_proc, [share + (start_at,) for share in shares])
        if sampler:
            sampler.start(start_at)
        parts = job.get()
        if sampler:
            sampler.stop()
    api_cpu, loop_cpu = serve_load.cpu_seconds([api]) - api0, loop_cpu_seconds(api) - loop0
    engine_cpu = serve_load.cpu_seconds([engine]) - engine0
    steps, generated = (b - a for a, b in zip(steps0, engine_counters(url)))
    results = [r for rs, _, _ in parts for r in rs]
    wall = max(r.get("end", start_at) for r in results) - start_at
    row = serve_load.summarize(name, results, wall)
    tokens, events = row["out_tok_s"] * wall, sum(e for _, _, e in parts)
    row.update(steps_s=steps / wall, batch=generated / max(1, steps), events_s=events / wall,
               tok_per_event=tokens / max(1, events), api_cpu=api_cpu / wall, loop_cpu=loop_cpu / wall,
               api_us_per_tok=1e6 * api_cpu / max(1.0, tokens), engine_cpu=engine_cpu / wall,
               client_cpu=sum(cpu for _, cpu, _ in parts) / wall)
    return row


# ---- profiles of the API process ---------------------------------------------------------------
class PySpy:
    """py-spy sampling the API process (every thread, idle excluded) while a level runs."""

    def __init__(self, exe, pid, out: Path, flags=(), rate=250):
        self.exe, self.pid, self.out, self.rate, self.proc = exe, pid, out, rate, None
        # native stacks need the process stopped for each sample; Python's do not
        self.flags = list(flags) + ([] if "--native" in flags else ["--nonblocking"])

    def start(self, start_at):
        time.sleep(max(0.0, start_at - time.perf_counter()))
        self.proc = subprocess.Popen([self.exe, "record", "-p", str(self.pid), "-f", "raw", "-o", str(self.out),
                                      "-r", str(self.rate), "--threads", "-d", "3600", *self.flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(self):
        self.proc.send_signal(signal.SIGINT)      # py-spy writes what it has on Ctrl-C
        _, err = self.proc.communicate(timeout=60)
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err.strip()[-500:]}")

    def report(self, tokens: int, top: int) -> str:
        """Self time and inclusive time per function, as microseconds per delivered token."""
        own, incl, threads, total = Counter(), Counter(), Counter(), 0
        for line in self.out.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames, n = stack.split(";"), int(n)
            total += n
            threads[frames[0]] += n
            own[_short(frames[-1])] += n
            for f in set(map(_short, frames[1:])):
                incl[f] += n
        us = 1e6 / self.rate / max(1, tokens)     # one sample's share of a token
        lines = [f"py-spy: {total} samples at {self.rate} Hz over {tokens} tokens: "
                 f"{total * us:.2f} us of API-process CPU per token"]
        lines += [f"  thread {t}: {n * us:.2f} us/token" for t, n in threads.most_common()]
        for title, table in (("self", own), ("inclusive", incl)):
            lines.append(f"top {top} by {title} time (us per token, share of samples):")
            lines += [f"  {n * us:7.2f}  {100 * n / max(1, total):5.1f}%  {f}" for f, n in table.most_common(top)]
        return "\n".join(lines)


def _short(frame: str) -> str:
    """'fn (path/to/file.py:123)' -> 'fn (file.py)': one entry per function, not per line."""
    m = re.match(r"(.*) \((.*?):\d+\)$", frame)
    return f"{m.group(1)} ({Path(m.group(2)).name})" if m else frame


class CProfile:
    """cProfile in the API process's event loop thread (see profile_on_signals) while a level runs;
    it slows what it watches: read it for where the time goes, not for how much there is."""

    def __init__(self, pid, out: Path):
        self.pid, self.out = pid, out

    def start(self, start_at):
        time.sleep(max(0.0, start_at - time.perf_counter()))
        os.kill(self.pid, signal.SIGUSR1)

    def stop(self):
        os.kill(self.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not self.out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)       # written, not only created

    def report(self, tokens: int, top: int) -> str:
        st = pstats.Stats(str(self.out))
        rows = [(tt, ct, nc, f"{fn} ({Path(file).name}:{line})") for (file, line, fn), (_, nc, tt, ct, _)
                in st.stats.items()]
        total = sum(r[0] for r in rows)
        lines = [f"cProfile (loop thread): {1e6 * total / max(1, tokens):.2f} us per token profiled"]
        for title, key in (("self", 0), ("inclusive", 1)):
            lines.append(f"top {top} by {title} time (us per token, calls per token):")
            lines += [f"  {1e6 * r[key] / tokens:7.2f}  {r[2] / tokens:6.2f}  {r[3]}"
                      for r in sorted(rows, key=lambda r: -r[key])[:top]]
        return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------
def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir for the config and tokenizer (default: tiny)")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--concurrency", default="64,256", help="comma-separated client counts")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens, up to (U[len/2, len])")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences an engine step carries at most")
    p.add_argument("--step-ms", type=float, default=2.0, help="an engine step's time (0: none)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each level (in turn: 64, 256, 64, ...)")
    p.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    p.add_argument("--baseline", default=None,
                   help="a tree with another asynct (e.g. `git archive` of an older commit): its server takes "
                        "the same runs, in turn with this tree's")
    p.add_argument("--no-pin", action="store_true", help="leave CPU placement to the scheduler")
    p.add_argument("--profile", choices=["none", "py-spy", "cprofile"], default="none",
                   help="one more run at the highest concurrency, profiled")
    p.add_argument("--py-spy", default=shutil.which("py-spy"), help="the py-spy executable")
    p.add_argument("--py-spy-flags", default="--gil",
                   help="more py-spy record flags (default --gil: a thread blocked in a read is not busy)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json-out", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class InstantServer:
    """`asynct serve` with InstantEngine as a subprocess (serve_load's ServerProcess, other command)."""

    def __init__(self, a, model, env):
        from asynct.entrypoints.serve.launch import ServerProcess
        self.server = ServerProcess(model, "--served-model-name", "bench", "--max-num-seqs", str(a.max_num_seqs),
                                    "--device", "cpu", env=env, timeout=120)
        cmd = self.server.cmd      # python -m asynct.entrypoints.cli serve MODEL ...: this file's serve
        self.server.cmd = [sys.executable, __file__, "--serve-instant", *cmd[cmd.index("serve") + 1:]]

    def __enter__(self):
        import psutil
        url = self.server.__enter__()
        self.api = psutil.Process(self.server.proc.pid)
        kids = [c for c in self.api.children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())]
        self.engine = max(kids, key=lambda c: c.memory_info().rss)      # the engine core, not a tracker
        return url

    def __exit__(self, *exc):
        self.server.__exit__(*exc)

    def pin(self):
        """The API process (every thread) on CPU 0; its engine and this process (so the clients
        it forks) on the others."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return False
        for t in self.api.threads():
            os.sched_setaffinity(t.id, cpus[:1])
        for t in self.engine.threads():
            os.sched_setaffinity(t.id, cpus[1:])
        os.sched_setaffinity(0, cpus[1:])
        return True

    def level(self, a, concurrency, prompts, name, sampler=None) -> dict:
        return run_level(self.server.url, prompts, a.output_len, concurrency, a.client_procs, self.api, self.engine,
                         name, sampler)


COLS = ["requests", "failed", "wall_s", "out_tok_s", "steps_s", "batch", "events_s", "tok_per_event", "api_cpu", "loop_cpu",
        "api_us_per_tok", "engine_cpu", "client_cpu", "ttft_p50_ms", "itl_p50_ms"]


def main():
    a = parse_args()
    import serve_load
    model = Path(a.model) if a.model else serve_load.default_model(False)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    levels = [int(c) for c in a.concurrency.split(",")]
    runs = [c for _ in range(a.repeat) for c in levels]
    if a.profile == "py-spy" and not a.py_spy:
        sys.exit("--profile py-spy: no py-spy found (--py-spy PATH)")
    tmp = Path(tempfile.mkdtemp(prefix="api-capacity-"))
    env = {STEP_MS_ENV: str(a.step_ms), "TOKENIZERS_PARALLELISM": "false"}
    servers = {"": InstantServer(a, model, {**env, PROFILE_ENV: str(tmp / "loop.prof")})}
    if a.baseline:      # the same load on another tree's asynct, run by run in turn
        servers["base, "] = InstantServer(a, model, {**env, PROFILE_ENV: str(tmp / "base-loop.prof"),
                                                    SERVER_ROOT_ENV: str(Path(a.baseline).resolve())})
    prompts = [serve_load.make_prompts(a.num_prompts, a.input_len, vocab, a.seed + i) for i in range(len(runs) + 1)]
    print(f"InstantEngine, {a.num_prompts} prompts of <= {a.input_len} tokens, {a.output_len} out, step "
          f"{a.step_ms:g} ms, max {a.max_num_seqs} seqs, {a.client_procs} client procs, {os.cpu_count()} CPUs",
          flush=True)
    rows, reports = [], []
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            stack.enter_context(server)
        pinned = not a.no_pin and all([s.pin() for s in servers.values()])
        print(f"API process on a CPU of its own: {pinned}", flush=True)
        for server in servers.values():
            server.level(a, max(levels), prompts[0], "warm-up")
        for i, c in enumerate(runs):
            order = list(servers.items())
            for tag, server in order if i % 2 == 0 else order[::-1]:   # neither always goes first
                rows.append(server.level(a, c, prompts[i + 1], f"{tag}{c} clients"))
                print(_row(rows[-1]), flush=True)
        if a.profile != "none":
            c = max(levels)
            for tag, server in servers.items():
                name = f"{tag}{c} clients, {a.profile}"
                sampler = PySpy(a.py_spy, server.api.pid, tmp / f"{tag[:4]}pyspy.txt", a.py_spy_flags.split()) \
                    if a.profile == "py-spy" else CProfile(server.api.pid, Path(server.server.env[PROFILE_ENV]))
                rows.append(server.level(a, c, prompts[-1], name, sampler))
                print(_row(rows[-1]), flush=True)
                reports.append(f"{name}: " + sampler.report(int(rows[-1]["out_tok_s"] * rows[-1]["wall_s"]), a.top))
    print("\n| run | " + " | ".join(COLS) + " |")
    print("|---" * (len(COLS) + 1) + "|")
    for r in rows:
        print(_row(r))
    for report in reports:
        print("\n" + report)
    print(f"\nprofiles: {tmp}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"args": vars(a), "rows": rows, "profiles": reports}, indent=1))
    return 1 if any(r["failed"] for r in rows) else 0


def _fmt(v):
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _row(r) -> str:
    return "| " + " | ".join([r["name"]] + [_fmt(r.get(c, "-")) for c in COLS]) + " |"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-instant"]:
        sys.exit(serve_instant(sys.argv[2:]))
    sys.exit(main())
