"""Kernel timings on the GPU against the device's copy bandwidth and torch SDPA, measured in
the same run. Seed-model shapes: 8 query / 4 KV heads of 128, bf16, hidden 1024, inter 3072.

    PYTHONPATH=. python3 benchmarks/kernel_bench.py [elementwise] [decode] [uneven] [prefill] [argmax] [--sweep]
        [--no-cuda]   (default: elementwise, decode, prefill)

Each timing replays a CUDA graph that runs the op once on each of several input sets, so the
inputs together are several times the 60 MB L2 (every op reads HBM) and launch gaps are the
engine's (graphs) rather than Python's; the median of 20 replays, divided by the sets.
Decode bandwidth counts the KV bytes read; elementwise bandwidth counts bytes read + written,
as the copy's does. The decode peer is SDPA's fastest backend on dense K/V; 'triton, engine' is
the decode as the engine's graphs launch it (engine_kwargs). --sweep adds the
block-size / split / config ablations. `uneven`: decode over lengths of 100-2,048 keys, rows
longest first against batch order (the peer column)."""
import math
import statistics
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from asynct import ops
from asynct.attention.graph_inputs import longest_first
from asynct.attention.triton_backend import CASCADE_MIN_DECODES, DECODE_ORDER_MIN_ROWS
from asynct.ops import cuda_ext
from asynct.ops.asynci_decode import asynci_decode_triton

HQ, HKV, D, BS, C, INTER = 8, 4, 128, 16, 1024, 3072
BF = torch.bfloat16
rows = []  # (op, shape, kernel, us, TB/s, TFLOP/s, x copy, sdpa time / this)


def n_sets(set_bytes):
    return max(1, min(64, math.ceil(256e6 / set_bytes)))


def bench(fns, reps=20):
    """Seconds per call: a graph of all fns (one per input set), replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile / build / allocate outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times) * 1e-3 / len(fns)


def add(op, shape, kernel, t, nbytes, flops, peer_t, copy_bw):
    bw = nbytes / t / 1e12
    rows.append((op, shape, kernel, t * 1e6, bw, flops / t / 1e12 if flops else 0.0,
                 bw / copy_bw, peer_t / t if peer_t else 0.0))
    print(f"{op:8s} {shape:22s} {kernel:16s} {t * 1e6:9.1f} us {bw:6.2f} TB/s", flush=True)


def try_add(op, shape, kernel, fns, *rest):
    try:
        add(op, shape, kernel, bench(fns), *rest)
    except Exception as e:  # a config that does not fit is an ablation result, not a crash
        print(f"{op} {shape} {kernel}: {type(e).__name__}: {str(e)[:160]}", flush=True)


def copy_bandwidth():
    # a captured copy becomes a graph memcpy node, which ran at 2.7 TB/s here: time it plainly
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3
    bw = 2 * x.numel() / t / 1e12
    rows.append(("copy", "2 GiB d2d", "torch", t * 1e6, bw, 0.0, 1.0, 0.0))
    return bw


def paged(b, t, gen):
    nblk = b * triton.cdiv(t, BS)
    cache = torch.randn(2, nblk, BS, HKV, D, device="cuda", dtype=BF)
    table = torch.randperm(nblk, device="cuda", generator=gen).int().view(b, -1)
    return cache, table


# SDPA's backends for a one-token query over dense K/V; the peer is the fastest of those that run
# (torch 2.11 picks cuDNN by default on the H200, whose time moved 126-144 us between runs at B=256)
SDPA_BACKENDS = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                 ("efficient", SDPBackend.EFFICIENT_ATTENTION))


def sdpa_decode(sets, b, shape, nbytes, flops, copy_bw):
    """Times each SDPA backend on the dense sets, adds a row for each, returns the fastest time."""
    times = {}
    for name, backend in SDPA_BACKENDS:
        try:
            with sdpa_kernel(backend):
                times[name] = bench([lambda s=s: sdpa(s[0].view(b, HQ, 1, D), s[5], s[6], enable_gqa=True)
                                     for s in sets])
        except RuntimeError as e:    # a backend that does not take this shape is no peer
            print(f"decode {shape} sdpa-{name}: {str(e)[:120]}", flush=True)
    best = min(times.values())
    for name, t in times.items():
        add("decode", shape, f"sdpa-{name}", t, nbytes, flops, best, copy_bw)
    return best


def engine_kwargs(b, t):
    """The decode as the engine's graphs run b rows of t keys: the cascade variant with nothing
    shared from CASCADE_MIN_DECODES rows, longest first (here: a row's KV heads side by side)
    from DECODE_ORDER_MIN_ROWS; {} where the engine adds into fp32 sums instead (few rows)."""
    kw = {}
    if b >= CASCADE_MIN_DECODES:
        kw["prefix_len"] = torch.zeros(1, dtype=torch.int32, device="cuda")
    if b >= DECODE_ORDER_MIN_ROWS:
        kw["order"] = torch.from_numpy(longest_first([t] * b, b)).cuda()
    return kw


def decode(copy_bw, sweep):
    gen = torch.Generator("cuda").manual_seed(0)
    sigma = torch.randn(HQ, device="cuda")
    # --no-cuda: no CUDA decode row, and no minute's build of the extension on a fresh machine
    have_cuda = "--no-cuda" not in sys.argv and cuda_ext.load_extension() is not None
    for b in (1, 32, 256):
        for t in (1024, 4096):
            nbytes, flops = 2 * b * t * HKV * D * 2, 4 * b * HQ * t * D
            sets = []
            for _ in range(n_sets(nbytes)):
                cache, table = paged(b, t, gen)
                q = torch.randn(b, HQ, D, device="cuda", dtype=BF)
                kd = torch.randn(b, HKV, t, D, device="cuda", dtype=BF)
                sets.append((q, cache, table, torch.full((b,), t, dtype=torch.int32, device="cuda"),
                             torch.empty_like(q), kd, torch.randn_like(kd)))
            shape = f"B={b} T={t}"
            t_sdpa = sdpa_decode(sets, b, shape, nbytes, flops, copy_bw)
            variants = [("triton", asynci_decode_triton, {})]
            if have_cuda:
                variants.append(("cuda", cuda_ext.asynci_decode_cuda, {}))
            variants.append(("dispatch", ops.asynci_decode, {}))
            engine = engine_kwargs(b, t)
            if engine:
                variants.append(("triton, engine", asynci_decode_triton, engine))
            if sweep:
                variants += [(f"tri n{bn} w{w} st{st}", asynci_decode_triton,
                              dict(block_n=bn, num_warps=w, num_stages=st))
                             for bn, w, st in ((64, 4, 3), (32, 2, 2))]
            for name, fn, kw in variants:
                fns = [lambda s=s, fn=fn, kw=kw: fn(s[0], s[1], s[2], s[3], sigma, 0.03, 3, True,
                                                    s[4], max_seq_len=t, **kw) for s in sets]
                try_add("decode", shape, name, fns, nbytes, flops, t_sdpa, copy_bw)
            del sets


def uneven(copy_bw):
    """Decode over uneven lengths (100-2,048 keys): rows in batch order, the peer, against the
    rows longest first (the engine's `order` from DECODE_ORDER_MIN_ROWS sequences)."""
    gen = torch.Generator("cuda").manual_seed(2)
    sigma = torch.randn(HQ, device="cuda")
    for b in (64, 128, 256):
        lens = torch.randint(100, 2049, (b,), generator=torch.Generator().manual_seed(b)).tolist()
        nbytes = 2 * sum(lens) * HKV * D * 2
        order = torch.from_numpy(longest_first(lens, b)).cuda()
        sets = []
        for _ in range(n_sets(nbytes)):
            cache, table = paged(b, 2048, gen)
            sets.append((torch.randn(b, HQ, D, device="cuda", dtype=BF), cache, table,
                         torch.tensor(lens, dtype=torch.int32, device="cuda")))
        times = {}
        for name, od in (("row order", None), ("longest first", order)):
            times[name] = bench([lambda s=s, od=od: asynci_decode_triton(
                s[0], s[1], s[2], s[3], sigma, 0.03, 3, True, torch.empty_like(s[0]), max_seq_len=2048, order=od)
                for s in sets])
            add("decode", f"B={b} T=100-2048", name, times[name], nbytes, 0.0, times["row order"], copy_bw)
        del sets


def prefill(copy_bw, sweep):
    gen = torch.Generator("cuda").manual_seed(1)
    sigma = torch.randn(HQ, device="cuda")
    for t in (512, 2048, 8192):
        flops = 4 * HQ * D * t * (t + 1) / 2
        nbytes = 4 * t * HQ * D * 2  # q, k, v, out once, k/v at all 8 heads as SDPA reads them
        sets = []
        for _ in range(n_sets(nbytes)):
            cache, table = paged(1, t, gen)
            q = torch.randn(t, HQ, D, device="cuda", dtype=BF)
            kd = torch.randn(1, HQ, t, D, device="cuda", dtype=BF)  # flash wants equal heads
            sets.append((q, cache, table, torch.empty_like(q), q.transpose(0, 1)[None].contiguous(),
                         kd, torch.randn_like(kd)))
        qsl = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        seq = torch.tensor([t], dtype=torch.int32, device="cuda")
        shape = f"T={t}"
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t_sdpa = bench([lambda s=s: sdpa(s[4], s[5], s[6], is_causal=True) for s in sets])
        add("prefill", shape, "sdpa-flash", t_sdpa, nbytes, flops, t_sdpa, copy_bw)
        configs = [(None, "triton")]
        if sweep:
            configs += [((bm, bn, w, st), f"tri {bm}x{bn} w{w}s{st}") for bm, bn, w, st in
                        ((128, 64, 8, 3), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3))]
        for cfg, name in configs:
            kw = {} if cfg is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"),
                                                 cfg))
            fns = [lambda s=s, kw=kw: ops.asynci_prefill_triton(
                s[0], s[1], s[2], qsl, seq, sigma, 0.03, 3, True, s[3], t, t, **kw) for s in sets]
            try_add("prefill", shape, name, fns, nbytes, flops, t_sdpa, copy_bw)
        del sets


def elementwise(copy_bw):
    t, e = 65536, 2
    qkv = [torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", dtype=BF) for _ in range(2)]
    qs = [x[:, :HQ * D].view(t, HQ, D) for x in qkv]
    ks = [x[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D) for x in qkv]
    vs = [x[:, (HQ + HKV) * D:].view(t, HKV, D) for x in qkv]
    a, w = torch.rand(D, device="cuda"), torch.randn(D, device="cuda")
    xs = [torch.randn(4 * t, C, device="cuda", dtype=BF) for _ in range(2)]
    ca, cw = torch.rand(C, device="cuda"), torch.randn(C, device="cuda")
    gus = [torch.randn(t, 2 * INTER, device="cuda", dtype=BF) for _ in range(2)]
    pos = torch.randint(0, 32768, (t,), device="cuda")
    cs = ops.rope_cos_sin_cache(D, 32768, 1e6, "cuda")
    caches = [torch.empty(2, t // BS, BS, HKV, D, device="cuda", dtype=BF) for _ in range(2)]
    slots = torch.randperm(t, device="cuda")
    x0 = xs[0]
    cases = [
        ("dyht", f"[{4 * t},{C}]", [lambda x=x: ops.dyht(x, ca, cw) for x in xs], 2 * x0.numel()),
        ("dyht", f"q view [{t},{HQ},{D}]", [lambda q=q: ops.dyht(q, a, w) for q in qs],
         2 * qs[0].numel()),
        ("dyht_add", f"[{4 * t},{C}] post",
         [lambda x=x, y=y: ops.dyht_add(x, y, ca, cw, ca, cw) for x, y in zip(xs, xs[::-1])],
         4 * x0.numel()),
        ("reglu", f"[{t},{2 * INTER}]", [lambda g=g: ops.reglu(g) for g in gus],
         1.5 * gus[0].numel()),
        ("qk_rope", f"[{t},{HQ}+{HKV},{D}]",
         [lambda q=q, k=k: ops.qk_norm_rope(q, k, pos, a, w, a, w, cs) for q, k in zip(qs, ks)],
         2 * (qs[0].numel() + ks[0].numel())),
        ("write_kv", f"[{t},{HKV},{D}] x2",
         [lambda k=k, v=v, c=c: ops.write_kv_cache(k, v, c, slots)
          for k, v, c in zip(ks, vs, caches)], 4 * ks[0].numel()),
        # the engine's q/k kernel with the KV write folded in: against qk_rope + write_kv above
        ("qk_rope+kv", f"[{t},{HQ}+{HKV}+{HKV},{D}]",
         [lambda q=q, k=k, v=v, c=c: ops.qk_norm_rope_to_cache(q, k, v, pos, a, w, a, w, cs, c, slots)
          for q, k, v, c in zip(qs, ks, vs, caches)], 2 * (qs[0].numel() + 2 * ks[0].numel())),
        ("dyht", f"[{4 * t},{C}] torch-eager",
         [lambda x=x: (cw * (ca * x.float()).clamp(-1, 1)).to(BF) for x in xs], 2 * x0.numel()),
    ]
    for op, shape, fns, n in cases:
        try_add(op, shape, "triton" if "eager" not in shape else "torch", fns, n * e, 0.0, None,
                copy_bw)


def greedy_argmax(copy_bw, vocab=151936):
    """Greedy sampling's argmax of bf16 logits rows; the peer column is torch.argmax's time."""
    for r in (1, 8, 32, 256):
        sets = [torch.randn(r, vocab, device="cuda", dtype=BF) for _ in range(n_sets(2 * r * vocab))]
        nbytes = 2 * r * vocab
        t_torch = bench([lambda x=x: x.argmax(-1) for x in sets])
        add("argmax", f"[{r},{vocab}]", "torch", t_torch, nbytes, 0.0, t_torch, copy_bw)
        try_add("argmax", f"[{r},{vocab}]", "triton", [lambda x=x: ops.argmax(x) for x in sets], nbytes, 0.0,
                t_torch, copy_bw)


GROUPS = ("elementwise", "decode", "uneven", "prefill", "argmax")


def main():
    sweep = "--sweep" in sys.argv
    groups = [a for a in sys.argv[1:] if not a.startswith("--")] or ["elementwise", "decode", "prefill"]
    if set(groups) - set(GROUPS):
        sys.exit(f"ops to time: {', '.join(GROUPS)}; got {' '.join(groups)}")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw:.2f} TB/s (read + write)")
    for name in groups:
        {"elementwise": elementwise, "decode": lambda bw: decode(bw, sweep), "uneven": uneven,
         "prefill": lambda bw: prefill(bw, sweep), "argmax": greedy_argmax}[name](copy_bw)
    print("\n| op | shape | kernel | time (us) | TB/s | TFLOP/s | / copy BW | peer's time / time |")
    print("|---|---|---|---|---|---|---|---|")
    for op, shape, kern, us, bw, tf, vs_copy, vs_peer in rows:
        if sweep or not any(c in kern for c in (" s", " n", " w")):
            peer = f"{vs_peer:.2f}" if vs_peer else "-"
            print(f"| {op} | {shape} | {kern} | {us:.1f} | {bw:.2f} | {tf:.1f} | {vs_copy:.2f} | "
                  f"{peer} |")


if __name__ == "__main__":
    main()
