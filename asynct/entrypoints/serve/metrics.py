"""/metrics in Prometheus' text format, from the last snapshot each engine process sent."""
from asynct.entrypoints.serve.async_engine import AsyncEngine

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
    ("num_preemptions_total", "sequences preempted for lack of KV blocks", lambda s, e: s["preemptions"]),
    ("requests_aborted_total", "requests aborted because their client left", lambda s, e: e.num_aborted),
]


def render_metrics(engine: AsyncEngine, model_name: str, http_counts: dict) -> str:
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
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    return str(x) if isinstance(x, int) else repr(float(x))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
