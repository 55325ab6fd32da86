"""/metrics in Prometheus' text format, from the last snapshot each engine process sent and the
front end's own latency histograms; the periodic throughput log line."""
import asyncio
import bisect
import logging
import time

from asynct.entrypoints.serve.async_engine import AsyncEngine

log = logging.getLogger("asynct.serve")

GAUGES = [
    ("num_requests_running", "sequences in the running batch", lambda s, e: s["running"]),
    ("num_requests_waiting", "sequences waiting to be scheduled", lambda s, e: s["waiting"]),
    ("num_requests_in_flight", "requests the server has queued and not yet answered", lambda s, e: e.num_in_flight),
    ("kv_blocks_total", "KV-cache blocks", lambda s, e: s["blocks_total"]),
    ("kv_blocks_free", "KV-cache blocks free", lambda s, e: s["blocks_free"]),
    ("kv_blocks_used", "KV-cache blocks in use", lambda s, e: s["blocks_total"] - s["blocks_free"]),
    ("kv_cache_usage_perc", "fraction of KV-cache blocks in use",
     lambda s, e: 1 - s["blocks_free"] / s["blocks_total"] if s["blocks_total"] else 0.0),
    ("prefix_cache_hit_rate", "prefix-cache hits over queried prompt blocks", lambda s, e: s["prefix_cache_hit_rate"]),
    ("generation_tokens_per_second", "generated tokens per second over the last 10 s",
     lambda s, e: e.generation_tokens_per_s()),
]
COUNTERS = [
    ("prompt_tokens_total", "prompt tokens computed", lambda s, e: s["prompt_tokens"]),
    ("generation_tokens_total", "tokens generated", lambda s, e: s["generation_tokens"]),
    ("engine_steps_total", "engine steps", lambda s, e: s["steps"]),
    # in blocks, not tokens as vLLM's prefix_cache_queries / _hits: other names
    ("prefix_cache_queried_blocks_total", "prompt blocks looked up in the prefix cache",
     lambda s, e: s["prefix_queries"]),
    ("prefix_cache_hit_blocks_total", "prompt blocks the prefix cache served", lambda s, e: s["prefix_hits"]),
    ("num_preemptions_total", "sequences preempted for lack of KV blocks", lambda s, e: s["preemptions"]),
    ("requests_aborted_total", "requests aborted because their client left", lambda s, e: e.num_aborted),
]


# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards built for vLLM fit
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, name: str, help_: str, buckets):
        self.name, self.help, self.buckets = name, help_, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)     # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1):
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self, label: str) -> list[str]:
        inner = label[1:-1]
        lines, total = [f"# HELP asynct_{self.name} {self.help}", f"# TYPE asynct_{self.name} histogram"], 0
        for bound, n in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            total += n
            lines.append(f'asynct_{self.name}_bucket{{{inner},le="{bound}"}} {total}')
        return lines + [f"asynct_{self.name}_sum{label} {self.sum!r}", f"asynct_{self.name}_count{label} {total}"]


class LatencyStats:
    """vLLM's request latencies, measured where the engine's outputs reach the front end's event
    loop (before any HTTP write), from the moment the request is queued for the engine (after
    tokenising): time to first token, the time between a sequence's successive tokens (a gap in
    which k tokens arrived counts as k gaps of 1/k of it), and a request's end-to-end time.
    The engine sends a non-streaming request's output only when it finishes, so its first-token
    and inter-token times are unseen here: those two histograms count streaming requests, and
    requests whose first token is also their last (max_tokens=1, as lm-eval's loglikelihood)."""

    def __init__(self):
        self.ttft = Histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             E2E_BUCKETS)

    def histograms(self) -> list[Histogram]:
        return [self.ttft, self.itl, self.e2e]

    def track(self, handle, stream: bool):
        """Observes the outputs put in a just-submitted RequestHandle (none can have come yet:
        outputs are put on the event loop, which runs this call)."""
        handle.observe = RequestTimes(self, time.monotonic(), stream).observe


class RequestTimes:
    """One request's arrival and, per choice, when its last tokens came and how many it had."""

    def __init__(self, stats: LatencyStats, arrival: float, stream: bool):
        self.stats, self.arrival, self.stream = stats, arrival, stream
        self.last: dict[tuple, tuple[float, int]] = {}     # (prompt, sample) -> (time, tokens)

    def observe(self, idx, out):
        if not hasattr(out, "outputs"):                    # an EngineError
            return
        now, s = time.monotonic(), self.stats
        for c in out.outputs:
            n = len(c.token_ids)
            t, seen = self.last.get((idx, c.index), (self.arrival, 0))
            if n <= seen or not (self.stream or n == 1):
                continue
            if seen == 0:
                s.ttft.observe(now - self.arrival)
            else:
                s.itl.observe((now - t) / (n - seen), n - seen)
            self.last[(idx, c.index)] = (now, n)
        if out.finished:
            s.e2e.observe(now - self.arrival)


def summary_line(model_name: str, model_dir: str, s: dict, seconds: float) -> str:
    """The start-up line: what was built, and how long the engine process took to be ready."""
    name = model_name if model_name == model_dir else f"{model_name} ({model_dir})"
    return (f"model {name}: {s['dtype']} on {s['device']}, max_model_len {s['max_model_len']}, "
            f"KV cache {s['num_kv_blocks']} blocks x {s['block_size']} = {s['num_kv_blocks'] * s['block_size']} "
            f"tokens ({s['kv_cache_gib']:.2f} GiB, {s['kv_cache_dtype']}), attention {s['attention_backend']}, "
            f"CUDA graphs {s['cuda_graphs'].replace('none', 'off')}, engine started in {seconds:.1f} s")


class ThroughputLogger:
    """vLLM's periodic line: token rates over the last interval, the batch, the KV cache. Logged
    while there is work or was some in the interval; silent while idle."""

    def __init__(self, engine: AsyncEngine, interval: float = 10.0):
        self.engine, self.interval = engine, interval
        self.last = (time.monotonic(), engine.snapshot["prompt_tokens"], engine.snapshot["generation_tokens"])

    def line(self) -> str | None:
        s, now = self.engine.snapshot, time.monotonic()
        t, prompt, gen = self.last
        self.last = (now, s["prompt_tokens"], s["generation_tokens"])
        dt = max(now - t, 1e-9)
        dp, dg = s["prompt_tokens"] - prompt, s["generation_tokens"] - gen
        if not (dp or dg or s["running"] or s["waiting"]):
            return None
        usage = 1 - s["blocks_free"] / s["blocks_total"] if s["blocks_total"] else 0.0
        return (f"Avg prompt throughput: {dp / dt:.1f} tokens/s, Avg generation throughput: {dg / dt:.1f} tokens/s, "
                f"Running: {s['running']} reqs, Waiting: {s['waiting']} reqs, KV cache usage: {100 * usage:.1f}%, "
                f"Prefix cache hit rate: {100 * s['prefix_cache_hit_rate']:.1f}%")

    async def run(self):
        while True:
            await asyncio.sleep(self.interval)
            line = self.line()
            if line:
                log.info(line)


def render_metrics(engine: AsyncEngine, model_name: str, http_counts: dict,
                   latency: LatencyStats | None = None) -> str:
    model = f'model_name="{_escape(model_name)}"'
    # with data parallel, each engine's series (label engine="i"), then the total (no engine label)
    series = [(f'{{{model},engine="{i}"}}', e) for i, e in enumerate(engine.engines)] if len(engine.engines) > 1 else []
    series.append((f"{{{model}}}", engine))
    lines = []
    for kind, table in (("gauge", GAUGES), ("counter", COUNTERS)):
        for name, help_, fn in table:
            lines += [f"# HELP asynct_{name} {help_}", f"# TYPE asynct_{name} {kind}"]
            lines += [f"asynct_{name}{label} {_num(fn(e.snapshot, e))}" for label, e in series]
    lines += ["# HELP asynct_http_responses_total HTTP responses by status code",
              "# TYPE asynct_http_responses_total counter"]
    for status, count in sorted(dict(http_counts).items()):
        lines.append(f'asynct_http_responses_total{{model_name="{_escape(model_name)}",status="{status}"}} {count}')
    for h in latency.histograms() if latency else []:
        lines += h.render(f"{{{model}}}")
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    return str(x) if isinstance(x, int) else repr(float(x))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
