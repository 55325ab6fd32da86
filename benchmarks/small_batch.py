"""Small-batch decode: the fused decode-sized linears (asynct/ops/fused_linear.py) against the
unfused ops they replace (cuBLAS + the elementwise kernels), same run, on bench-0.6b's shapes.

    PYTHONPATH=. python3 benchmarks/small_batch.py [--model DIR] [--sweep] [--skip-ops] [--skip-engine]
        [--modes unfused,...,fused] [--batches 1,2,...] [--uneven LO,HI]

1. Each layer op at 1, 2, 3, 4, 8, 16, 24 and 32 rows (unfused, fused without PDL, without the
   L2 prefetch, with dot tiles where it takes the CUDA-core path, and fused), graph-timed over
   enough distinct weight copies that every replay reads HBM (as 35 layers do), with the
   bandwidth its weights achieve. --sweep adds the dot tiles' configs at 1 and 32 rows (BLOCK_K,
   stages, warps, weight rows per program) and the CUDA-core path's at 1 to 4 rows (weight
   rows per program, K tile, warps), for every op.
2. Whole decode steps (full CUDA graphs) at batch 1, 2, 4, 8, 16, 24, 32 and 48 (--batches),
   context 384, for an engine with the fused linears, one with them but without programmatic dependent
   launch (every kernel waits for the one before to drain), one whose QKV kernel leaves the KV
   write to the attention backend, one whose linears do not prefetch their weights into L2
   while the kernel before runs, one whose linears take dot tiles at every row count (no
   GEMV), one whose graphs leave the LM head and greedy argmax to eager launches, one whose small
   decode steps write split partials and sum them (no fp32 sums), one whose fused linears stop
   at 32 rows (try --batches 40,48,64), one whose decode takes its rows in batch order, not
   longest first (try --uneven 100,2048: contexts of 100-2,048 keys, not 384 each), and one
   without fused linears, against the step's roofline: weights + the KV the timed steps read
   (their contexts: the prompts and the tokens decoded so far) and write, once, at the copy
   bandwidth."""
import argparse
import contextlib
import gc
import tempfile
from pathlib import Path
from unittest import mock

import torch
from kernel_bench import bench, copy_bandwidth, n_sets
from profile_decode import fill_decodes, mean_step

from asynct import LLM
from asynct.attention import triton_backend
from asynct.engine import cuda_graph
from asynct.entrypoints.bench import decode_step_bytes
from asynct.model import engine_model
from asynct.model.checkpoint import make_checkpoint
from asynct.ops import _triton, fused_linear as fl, fused_linear_checks
from asynct.ops.rope import rope_cos_sin_cache

C, INTER, HQ, HKV, D = 1024, 3072, 8, 4, 128
BF = torch.bfloat16


# Each engine mode of the step table is a patch of the module value it changes (mock.patch)
def unfused():
    """cuBLAS and the unfused elementwise kernels at every row count."""
    return mock.patch.object(fl, "_fast", lambda *a: False)


def no_pdl():
    """Every kernel launched plainly: the same-run peer of programmatic dependent launch."""
    return mock.patch.object(_triton, "PDL", False)


def no_kv_fold():
    """The attention backend stores each step's k/v (a kernel of its own), not the QKV kernel."""
    return mock.patch.object(engine_model.Attention, "cache_target", lambda self, slot_mapping=None: {})


def no_prefetch():
    """Fused linears without the L2 prefetch of their weights before the PDL wait."""
    return mock.patch.object(fl, "L2_PREFETCH", False)


def no_gemv():
    """The fused linears' 16-row dot tiles at every row count: the CUDA-core path's same-run peer."""
    return mock.patch.object(fl, "GEMV", {op: (rows, block_k, ()) for op, (rows, block_k, *_) in fl.GEMV.items()})


def tiles(half_tile=None, **changes):
    """Overrides of the fused kernels' launch options and rows per tile (the sweep's configs)."""
    orig = fl._tiles

    def patched(x, k, n):
        t = orig(x, k, n)
        t.update(changes)
        t["EVEN_K"] = k % t["BLOCK_K"] == 0
        t["LINES"] = t["LINES"] and max(1, t["BLOCK_K"] * x.element_size() // 128)
        return t
    return mock.patch.multiple(fl, _tiles=patched, HALF_TILE=half_tile or fl.HALF_TILE)


def gemv(op, rows, block_k, warps):
    """The CUDA-core path of `op` (a fused_linear.GEMV key) with this config up to its row limit."""
    config = ((rows,) * fl.GEMV_MAX_ROWS, block_k, (warps,) * fl.GEMV_MAX_ROWS)
    return mock.patch.object(fl, "GEMV", {**fl.GEMV, op: config})


def hidden_state_graphs():
    """Decode graphs that leave the hidden states: the LM head and argmax eager, as before 2026-12-02."""
    return mock.patch.object(cuda_graph, "SAMPLING_MAX_BS", 0)


def no_decode_sums():
    """Small decode steps' attention as split partials + a sum kernel, o_proj reading bf16 (before
    2026-12-04): the same-run peer of the fp32 sums (DECODE_SUMS_MAX_ROWS)."""
    return mock.patch.object(triton_backend, "DECODE_SUMS_MAX_ROWS", 0)


def row_order():
    """Decode rows in batch order at every batch size (before 2026-12-04): the same-run peer of
    the rows longest first (DECODE_ORDER_MIN_ROWS); try --uneven 100,2048 --batches 64,128,256."""
    return mock.patch.object(triton_backend, "DECODE_ORDER_MIN_ROWS", 1 << 30)


def fused_to_32():
    """The fused linears up to 32 rows, cuBLAS and the unfused elementwise kernels past them (the
    engine before its 64-row tiles, 2026-12-04): the same-run peer of decode steps of 33-64."""
    return mock.patch.object(fused_linear_checks, "SMALL_M", 32)


# (weight rows a program, K tile, warps) of the CUDA-core path, swept at 1 to fl.GEMV_MAX_ROWS rows
GEMV_SWEEP = [(r, bk, w) for r in (2, 4, 8, 16) for bk in (512, 1024, 4096) for w in (4, 8) if r * bk <= 16384]
GEMV_OPS = {"qkv+norm+rope": "qkv", "o+dyht_add": "dyht_add", "gate_up+reglu": "reglu", "down+dyht_add": "dyht_add"}
def gemv_configs(op, k, m):
    """GEMV_SWEEP's configs as the plan runs them, each once: its K tile is all of K wherever
    the rows fit fused_linear.GEMV_EARLY_ELEMENTS, whatever the config asks. Past two rows at
    most 8 weight rows a program: four accumulators of 16 would not fit in registers (8 x 2,048
    at 4 warps already spills: sm_90 compile)."""
    runs = {}
    for r, bk, w in (c for c in GEMV_SWEEP if m <= 2 or c[0] <= 8):
        with gemv(op, r, bk, w):
            runs.setdefault((r, fl._plan(torch.zeros(m, k), k, op)[1]["BLOCK_K"], w), None)
    return list(runs)


# (BLOCK_K, stages, warps, rows per tile / 2) of the dot tiles at 1 and 32 rows
SWEEP = [(256, 4, 4, 8), (512, 3, 4, 8), (256, 4, 2, 8), (512, 3, 2, 8), (1024, 2, 4, 8),
         (256, 6, 4, 8), (512, 4, 4, 8), (512, 3, 4, 16), (256, 4, 2, 16), (512, 3, 2, 16),
         (256, 3, 4, 8), (128, 4, 4, 8), (256, 3, 4, 16), (128, 4, 2, 8)]


def op_cases(m):
    """(name, weight shape, fn(x, w, aux)) per layer op; aux holds what the epilogue reads."""
    pos = torch.arange(m, device="cuda") + 300
    cache = rope_cos_sin_cache(D, 4096, 1e6, "cuda")
    one, res = torch.ones(1, device="cuda", dtype=BF), torch.randn(m, C, device="cuda", dtype=BF)
    return [
        ("qkv+norm+rope", ((HQ + 2 * HKV) * D, C),
         lambda x, w: fl.linear_qk_norm_rope(x, w, pos, HQ, HKV, one, one, one, one, cache)),
        ("o+dyht_add", (C, HQ * D), lambda x, w: fl.linear_dyht_add(x, w, res, one, one, one, one)),
        ("gate_up+reglu", (2 * INTER, C), lambda x, w: fl.linear_reglu(x, w)),
        ("down+dyht_add", (C, INTER), lambda x, w: fl.linear_dyht_add(x, w, res, one, one)),
    ]


def time_op(fn, shape, m):
    nbytes = shape[0] * shape[1] * 2
    sets = [(torch.randn(m, shape[1], device="cuda", dtype=BF),
             torch.randn(shape, device="cuda", dtype=BF) * 0.02) for _ in range(n_sets(nbytes))]
    t = bench([lambda s=s: fn(*s) for s in sets])
    return t, nbytes / t / 1e12


def ops_table(copy_bw, sweep):
    print("\nop | rows | unfused us | fused, no PDL us | no L2 prefetch us | dot tiles us | fused us | fused TB/s | "
          "of copy BW | unfused / fused | no PDL / fused | no prefetch / fused | dot tiles / fused")
    configs = SWEEP if sweep else []
    for m in (1, 2, 3, 4, 8, 16, 24, fl.SMALL_M):
        for name, shape, fn in op_cases(m):
            with unfused():
                t_u, _ = time_op(fn, shape, m)
            with no_pdl():
                t_n, _ = time_op(fn, shape, m)
            with no_prefetch():
                t_p, _ = time_op(fn, shape, m)
            with no_gemv():
                t_g, _ = time_op(fn, shape, m)
            t_f, bw = time_op(fn, shape, m)
            print(f"{name} | {m} | {t_u * 1e6:.1f} | {t_n * 1e6:.1f} | {t_p * 1e6:.1f} | {t_g * 1e6:.1f} | "
                  f"{t_f * 1e6:.2f} | {bw:.2f} | {bw / copy_bw:.2f} | {t_u / t_f:.2f} | {t_n / t_f:.2f} | "
                  f"{t_p / t_f:.2f} | {t_g / t_f:.2f}", flush=True)
            sweeps = [(f"dot bk{bk} st{st} w{w} rows{2 * hb}", tiles(hb, BLOCK_K=bk, num_stages=st, num_warps=w))
                      for bk, st, w, hb in (configs if m in (1, fl.SMALL_M) else [])]
            sweeps += [(f"gemv rows{r} bk{bk} w{w}", gemv(GEMV_OPS[name], r, bk, w))
                       for r, bk, w in (gemv_configs(GEMV_OPS[name], shape[1], m)
                                        if sweep and m <= fl.GEMV_MAX_ROWS else [])]
            for label, mode in sweeps:
                with no_gemv() if label.startswith("dot") else contextlib.nullcontext(), mode:
                    try:
                        t_c, bw_c = time_op(fn, shape, m)
                    except Exception as e:      # a config that does not fit is a result too
                        print(f"  {label}: {type(e).__name__}")
                        continue
                print(f"  {label} | {t_c * 1e6:.1f} us | {bw_c / copy_bw:.2f}")


def contexts(batch, context) -> list[int]:
    """Each sequence's prompt length: `context` tokens, or (lo, hi) drawn uniformly (seeded by
    the batch size, so every mode meets the same lengths)."""
    if isinstance(context, int):
        return [context] * batch
    return torch.randint(context[0], context[1] + 1, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()


def decode_keys(eng) -> int:
    """Keys the running sequences hold in the cache: a decode step of them all reads these and
    one more a row (its new token's, which it writes first)."""
    return sum(s.num_computed_tokens for s in eng.scheduler.running)


def timed_decode(eng, batch, steps) -> tuple[float, float]:
    """(mean seconds, mean keys read) of `steps` decode steps of `batch` sequences: the keys
    grow by one a row each step, so the mean is (keys before + keys after + batch) / 2."""
    before = decode_keys(eng)
    seconds = mean_step(eng, steps)
    return seconds, (before + decode_keys(eng) + batch) / 2


def step_roofline(weights, kv_per_token, keys, batch, copy_bw) -> float:
    """Seconds of a decode step at the copy bandwidth (TB/s), as `asynct bench` roofs one."""
    return decode_step_bytes(weights, kv_per_token, keys, batch) / (copy_bw * 1e12)


def engine_steps(model, mode, batches, context):
    """{batch: (mean step seconds, mean keys a step read)}, weight bytes, KV bytes a token."""
    with mode():
        llm = LLM(model, max_num_seqs=max(batches), gpu_memory_utilization=0.3,
                  cudagraph_mode="full_decode_only")
        eng, out = llm.llm_engine, {}
        for b in batches:
            fill_decodes(llm, b, contexts(b, context))
            mean_step(eng, 10)
            out[b] = timed_decode(eng, b, 100)
            for seq in list(eng.scheduler.running):
                eng.abort_request(seq.request_id)
            while eng.has_unfinished_requests():
                eng.step()
    weights = sum(p.numel() * p.element_size() for n, p in eng.runner.model.named_parameters()
                  if "embed_tokens" not in n or eng.runner.model.lm_head is None)
    kv_per_token = eng.runner.block_bytes // eng.runner.block_size
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()
    return out, weights, kv_per_token


MODES = {"unfused": unfused, "no PDL": no_pdl, "no KV fold": no_kv_fold,
         "no L2 prefetch": no_prefetch, "no GEMV": no_gemv, "hidden-state graphs": hidden_state_graphs,
         "no decode sums": no_decode_sums, "fused to 32": fused_to_32,
         "row order": row_order,
         "fused": contextlib.nullcontext}


def steps_table(model, copy_bw, names, batches, context=384):
    modes = {n: MODES[n] for n in MODES if n in names}
    ms = {}
    for name, mode in modes.items():
        ms[name], weights, kv_per_token = engine_steps(model, mode, batches, context)
    print(f"\ndecode step ms, prompts of {context} keys, full CUDA graphs; roofline = (weights "
          f"{weights / 1e9:.2f} GB + the KV the timed steps read and write) / copy BW")
    peers = list(modes)[:-1]
    print(" | ".join(["batch", *modes, *(f"{n} / fused" for n in peers), "keys a row", "roofline",
                      "fused / roofline"]))
    for b in batches:
        f, keys = ms["fused"][b]
        roof = step_roofline(weights, kv_per_token, keys, b, copy_bw)
        print(" | ".join([str(b), *(f"{ms[n][b][0] * 1e3:.3f}" for n in modes),
                          *(f"{ms[n][b][0] / f:.2f}" for n in peers), f"{keys / b:.0f}", f"{roof * 1e3:.3f}",
                          f"{f / roof:.2f}"]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--modes", default=",".join(MODES), help="engines of the step table, comma-separated")
    ap.add_argument("--batches", default="1,2,4,8,16,24,32,48", help="the step table's, comma-separated")
    ap.add_argument("--uneven", default=None, metavar="LO,HI",
                    help="contexts drawn uniformly from LO to HI keys, not 384 each")
    a = ap.parse_args()
    names = a.modes.split(",")
    if set(names) - set(MODES) or "fused" not in names:
        ap.error(f"--modes: a comma-separated subset of {', '.join(MODES)}, with fused (the ratios' base)")
    print(torch.cuda.get_device_name())
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw:.2f} TB/s")
    if not a.skip_ops:
        ops_table(copy_bw, a.sweep)
    if not a.skip_engine:
        model = a.model or make_checkpoint("bench-0.6b", Path(tempfile.mkdtemp()) / "m", tokenizer=False)
        context = tuple(int(n) for n in a.uneven.split(",")) if a.uneven else 384
        steps_table(str(model), copy_bw, names, [int(b) for b in a.batches.split(",")], context)


if __name__ == "__main__":
    main()
