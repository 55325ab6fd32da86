"""Where a workload's time goes, per step kind (`asynct bench --breakdown`): steps, wall time
between step ends (its own launch in, the next step's out: LLMEngine._record), device time of the
forward and sampling, and host time to launch a step.
With async scheduling a step's wall time near its device time means the host keeps up."""
from collections import defaultdict

# graph: a decode step replayed from a full CUDA graph; piecewise: graphs between eager attentions
KINDS = ("graph", "piecewise mixed", "piecewise prefill", "decode", "mixed", "prefill")


def breakdown(records) -> list[dict]:
    by_kind = defaultdict(list)
    for r in records:
        by_kind[r.kind].append(r)
    return [_row(kind, by_kind[kind]) for kind in KINDS if by_kind[kind]]


def _row(kind, rs) -> dict:
    n = len(rs)
    wall = sum(r.wall_s for r in rs)
    gpu = [r.gpu_s for r in rs if r.gpu_s is not None]
    row = {"kind": kind, "steps": n, "wall_s": wall, "wall_ms": 1e3 * wall / n,
           "max_wall_ms": 1e3 * max(r.wall_s for r in rs),
           "launch_ms": 1e3 * sum(r.launch_s for r in rs) / n,
           "seqs": sum(r.num_seqs for r in rs) / n, "tokens": sum(r.num_tokens for r in rs) / n}
    if gpu:
        row["gpu_ms"] = 1e3 * sum(gpu) / len(gpu)
        row["wall_over_gpu"] = row["wall_ms"] / row["gpu_ms"]
    return row


def print_breakdown(workload: str, rows: list[dict], compiles=None):
    cols = ["kind", "steps", "seqs", "tokens", "wall_s", "wall_ms", "max_wall_ms", "gpu_ms", "launch_ms",
            "wall_over_gpu"]
    extra = "" if compiles is None else f", {len(compiles.compiles)} Triton compiles ({compiles.seconds:.1f} s)"
    print(f"breakdown of {workload}{extra}")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c, "")) for c in cols))


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
