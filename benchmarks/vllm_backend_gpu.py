"""The vLLM plugin's attention on a GPU without vLLM: its compute core (`asynct.integrations.vllm
.attend`, what `AsyncTAttentionImpl.forward` calls) on a cache laid out as vLLM 0.32 allocates it
and metadata built from a double of vLLM's `CommonAttentionMetadata` the way its GPU model runner
fills it (decodes first, int32 tables, int64 slots). For decode-only, prefill-only and mixed
batches (GQA, lengths not multiples of the block size) it checks the CUDA path (asynct's Triton
kernels reading vLLM's cache in place) against the plugin's torch path in bf16, and times it
against asynct's own engine attention (`asynct.attention.triton_backend`) on the same batch in
asynct's contiguous cache. The table comes last.

    python benchmarks/vllm_backend_gpu.py            # on a GPU
    python benchmarks/vllm_backend_gpu.py --smoke    # tiny shapes on CPU, Triton interpreted

Columns: max|err| and rel (of the largest output) of the kernel path against the torch path;
"vs asynct" the largest difference from the engine's output; ratio = plugin ms / asynct ms
(one layer's forward: this step's K/V write plus attention); "batch order ms" the plugin without
its decode order (rows longest first from 64 decodes, as the engine takes them), whose output
must be bit-identical; "host ms/step" the host time to build a step's metadata and launch
--layers layers' eager forwards (device idle at the start), the cost a vLLM step pays in Python
between its piecewise graphs. (These columns' functions use only `attend`'s public calls, so the
script run over an older tree's `asynct` gives that tree's numbers as the peer.) Exits 1 if any rel > --tol or the order changes a bit.
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from asynct.attention.base import StepInputs  # noqa: E402
from asynct.attention.triton_backend import TritonAttentionImpl, TritonMetadataBuilder  # noqa: E402
from asynct.integrations.vllm import attend  # noqa: E402


@dataclass
class CommonAttentionMetadata:
    """The fields of vLLM 0.32's CommonAttentionMetadata that the plugin's builder reads."""
    query_start_loc: torch.Tensor      # [B+1] int32, device
    query_start_loc_cpu: torch.Tensor  # [B+1] int32, host
    seq_lens: torch.Tensor             # [B] int32, device
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor   # [B, max_blocks] int32, device
    slot_mapping: torch.Tensor         # [T] int64, device
    seq_lens_cpu_upper_bound: torch.Tensor | None = None   # [B] int32, host


@dataclass
class Shape:
    hq: int
    hkv: int
    d: int
    block_size: int


GPU_SHAPE = Shape(hq=16, hkv=4, d=128, block_size=16)   # GQA 4
SMOKE_SHAPE = Shape(hq=4, hkv=2, d=16, block_size=16)


def cases(smoke: bool, gen: torch.Generator):
    """name -> (q_lens, ctx_lens), decodes first as vLLM's reorder leaves them."""
    def lens(n, lo, hi):
        return torch.randint(lo, hi, (n,), generator=gen).tolist()
    if smoke:
        return {"decode": ([1] * 3, [5, 37, 70]), "prefill": ([9, 20], [0, 13]),
                "mixed": ([1, 1, 11, 6], [40, 3, 0, 21])}
    return {
        "decode": ([1] * 128, lens(128, 200, 4000)),
        "prefill": ([1000, 517, 2049, 77], [0, 300, 0, 1500]),
        "mixed": ([1] * 96 + [700, 333, 1025], lens(96, 200, 4000) + [0, 901, 2000]),
    }


def vllm_cache(num_blocks, s: Shape, dtype, device, layout, gen):
    """One layer's cache as vLLM 0.32 hands it over: [NB, Hkv, BS, 2*D] in the stride order of
    its KVCacheLayout (LBNHC, its default: physical [NB, BS, Hkv, 2D])."""
    if layout == "LBHNC":
        phys = torch.randn(num_blocks, s.hkv, s.block_size, 2 * s.d, generator=gen)
        return phys.to(dtype).to(device)
    phys = torch.randn(num_blocks, s.block_size, s.hkv, 2 * s.d, generator=gen)
    return phys.to(dtype).to(device).transpose(1, 2)


def make_step(q_lens, ctx_lens, s: Shape, dtype, device, layout, gen):
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    per_seq = [-(-n // s.block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 1  # block 0: vLLM's null block, never in a table
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(perm[at:at + n])
        at += n
    width = max(per_seq)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = [tables[b][p // s.block_size] * s.block_size + p % s.block_size
             for b, (c, n) in enumerate(zip(ctx_lens, seq_lens)) for p in range(c, n)]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    t = int(qsl[-1])
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_reqs=len(q_lens), num_actual_tokens=t, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_table_tensor=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32))
    engine_step = StepInputs(query_lens=list(q_lens), seq_lens=seq_lens, block_tables=tables,
                             slot_mapping=slots, num_decodes=sum(q == 1 for q in q_lens))

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.5).to(dtype).to(device)
    qkv = dict(q=rand(t, s.hq, s.d), k=rand(t, s.hkv, s.d), v=rand(t, s.hkv, s.d))
    cache = vllm_cache(num_blocks, s, dtype, device, layout, gen)
    return cm, engine_step, qkv, cache


def timed(fn, iters, device, graph=True):
    """Mean milliseconds per call, after a warm-up call (it compiles). On CUDA, device time:
    calls replayed from a CUDA graph, so neither path's Python launch cost is counted (eager
    launches timed with events measured the host, and varied by 1.3x between identical runs)."""
    if device.type == "cuda" and graph:
        from decode_sweep import time_call  # benchmarks/ is this script's sys.path[0]
        return time_call(fn, reps=max(1, iters // 5)) * 1e3
    if device.type == "cuda":   # the torch path syncs with the host: it cannot be captured
        from cascade_ablation import time_us
        return time_us(fn, iters) / 1e3
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def host_step_ms(cm, s: Shape, x, cache, params, path, layers, device, reps=7):
    """Host milliseconds to build a step's metadata and launch `layers` layers' eager forwards
    (vLLM's piecewise graphs run attention so, a layer at a time), median of `reps` steps, each
    started on an idle device. The layers share one cache: the host's work is the same."""
    order, times = attend.DecodeOrder(cm.num_reqs, device), []
    out = torch.zeros_like(x["q"])
    for _ in range(reps + 1):   # the first compiles what the graph timings did not
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        md = attend.build_metadata(cm, path, s.block_size, s.hq, order=order)
        for _ in range(layers):
            attend.forward(x["q"], x["k"], x["v"], cache, md, params, out)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[reps // 2] * 1e3


def run_case(name, q_lens, ctx_lens, s, dtype, device, layout, kernel_path, iters, gen, layers):
    cm, engine_step, x, cache = make_step(q_lens, ctx_lens, s, dtype, device, layout, gen)
    sigma = (torch.rand(s.hq, generator=gen) + 0.5).to(device)
    params = attend.AsyncIParams(sigma, s.d ** -0.5, 3, True)
    outs, ms = {}, {}
    # the builder's decode order (rows longest first from 64 decodes) and, the peer, batch order
    for variant, order in ((kernel_path, attend.DecodeOrder(len(q_lens), device)), ("batch order", None),
                           ("torch", None)):
        path = kernel_path if variant == "batch order" else variant
        md = attend.build_metadata(cm, path, s.block_size, s.hq, order=order)
        out = torch.zeros_like(x["q"])
        layer_cache = cache.clone()  # each path writes this step's K/V itself

        def plugin(md=md, out=out, layer_cache=layer_cache):
            attend.forward(x["q"], x["k"], x["v"], layer_cache, md, params, out)
        ms[variant] = timed(plugin, iters, device, graph=path != "torch")
        outs[variant] = out

    # asynct's engine on the same batch, in its own contiguous [2, NB, BS, Hkv, D] cache.
    engine_cache = attend.as_ops_layout(cache).contiguous()
    engine_md = TritonMetadataBuilder(s.block_size, device).build(engine_step)
    impl = TritonAttentionImpl(s.hq, s.d, s.hkv, params.scale, sigma, 3, True)
    engine_out = torch.zeros_like(x["q"])
    ms["asynct"] = timed(lambda: impl.forward(x["q"], x["k"], x["v"], engine_cache, engine_md,
                                              engine_out), iters, device)

    host = host_step_ms(cm, s, x, cache.clone(), params, kernel_path, layers, device)
    ref = outs["torch"].float()
    err = (outs[kernel_path].float() - ref).abs().max().item()
    rel = err / max(ref.abs().max().item(), 1e-6)
    engine_err = (engine_out.float() - outs[kernel_path].float()).abs().max().item()
    order_err = (outs["batch order"].float() - outs[kernel_path].float()).abs().max().item()
    return dict(case=name, seqs=len(q_lens), tokens=cm.num_actual_tokens, err=err, rel=rel,
                engine_err=engine_err, order_err=order_err, plugin=ms[kernel_path], asynct=ms["asynct"],
                torch=ms["torch"], unordered=ms["batch order"], host=host)


def patch_interpreter_scalars():
    """Triton 3.6's interpreter turns a scalar loop bound into int() of a 1-element array,
    which NumPy >= 2.4 refuses (tests/test_ops_attention.py patches the same)."""
    import triton.runtime.interpreter as interp
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    interp._patch_lang_tensor = patched


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, Triton interpreted")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--layout", choices=("LBNHC", "LBHNC"), default="LBNHC",
                    help="vLLM's KVCacheLayout of the cache (LBNHC: vLLM's default)")
    ap.add_argument("--layers", type=int, default=35, help="layers a step, for the host time (bench-0.6b: 35)")
    ap.add_argument("--tol", type=float, default=2e-2, help="max relative error, bf16")
    a = ap.parse_args()
    if a.smoke:
        patch_interpreter_scalars()
        device, dtype, shape, iters = torch.device("cpu"), torch.float32, SMOKE_SHAPE, a.iters or 1
        kernel_path = "triton"  # the kernels by name: on CPU "ops" would pick the references
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
        device, dtype, shape, iters = torch.device("cuda"), torch.bfloat16, GPU_SHAPE, a.iters or 50
        kernel_path = "ops"  # what the plugin's builder picks on CUDA
    gen = torch.Generator().manual_seed(0)
    rows = [run_case(name, q, c, shape, dtype, device, a.layout, kernel_path, iters, gen, a.layers)
            for name, (q, c) in cases(a.smoke, gen).items()]

    print(f"\nvLLM plugin attention ({kernel_path} path, {a.layout} cache) vs its torch path "
          f"and vs asynct's engine attention; {dtype}, Hq={shape.hq} Hkv={shape.hkv} "
          f"D={shape.d} block={shape.block_size}, {iters} iters, {device}")
    print(f"{'case':8} {'seqs':>5} {'tokens':>6} {'max|err|':>9} {'rel':>8} {'vs asynct':>9} "
          f"{'plugin ms':>9} {'asynct ms':>9} {'ratio':>6} {'torch ms':>9} {'batch order ms':>14} "
          f"{'host ms/step':>12}  ok")
    ok = True
    for r in rows:
        good = r["rel"] <= a.tol and r["order_err"] == 0    # the order moves rows, not sums
        ok &= good
        print(f"{r['case']:8} {r['seqs']:5d} {r['tokens']:6d} {r['err']:9.2e} {r['rel']:8.1e} "
              f"{r['engine_err']:9.2e} {r['plugin']:9.3f} {r['asynct']:9.3f} "
              f"{r['plugin'] / r['asynct']:6.2f} {r['torch']:9.3f} {r['unordered']:14.3f} {r['host']:12.2f}  "
              f"{'yes' if good else 'NO'}")
    if a.smoke:
        print("smoke: interpreted kernels against CPU references; the times measure nothing")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
