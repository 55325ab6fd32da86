"""The measurements behind `asynct bench`: its workloads, the device's copy bandwidth, a timed
engine run, the roofline of a decode step, and HF eager as the peer. The command (bench_cli.py)
and the scripts in benchmarks/ share them, so a script's numbers are the command's."""
import os
import random
import time

from asynct.engine.sampling_params import SamplingParams

WORKLOADS = ("throughput", "gsm8k", "latency", "prefill")
DEFAULT_WORKLOADS = WORKLOADS[:3]


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a large device copy (median of 10)."""
    import torch
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * n / _median_seconds(device, lambda: dst.copy_(src))


def matmul_flops(device, dtype) -> float:
    """FLOP/s of a large square matmul in the engine's dtype (median of 10): a prefill's roof,
    measured in the run as the copy bandwidth is a decode step's."""
    import torch
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn_like(a)
    return 2 * n ** 3 / _median_seconds(device, lambda: a @ b)


def _median_seconds(device, fn) -> float:
    """fn's median time over 10 runs after 2 warm-up runs; on CUDA its device time (events): a
    host clock around synchronize adds the launch and the sync, ~2 % of a 0.5 ms copy, which
    made the copy bandwidth, and so every decode roofline, read low."""
    times = [_seconds(device, fn) for _ in range(12)]
    return sorted(times[2:])[len(times[2:]) // 2]


def _seconds(device, fn) -> float:
    import torch
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / 1e3


def _now(device) -> float:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def workload(name: str, vocab: int, scale: float, seed: int = 0):
    """(prompt token ids, SamplingParams) per request, as the issue defines each workload. Each
    workload draws from its own generator: one seed for all made the throughput workload's first
    prompt begin with gsm8k's 5-shot prefix and latency's prompt, which `asynct bench` then found
    in the prefix cache (its cached_prompt_tokens said 112 of latency's 128)."""
    rng = random.Random(f"{name}:{seed}")
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
    if name == "prefill":      # an evaluation's scoring pass: unrelated prompts of 200-2,000 tokens, one token each
        return [(tok(rng.randint(s(200), s(2000))), SamplingParams(temperature=0, ignore_eos=True, max_tokens=1))
                for _ in range(s(512))]
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
            "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs), "step_log": log,
            "cached_per_request": [o.num_cached_tokens for o in outs]}


def _refuse_failed(outs):
    """A request the engine refused (a prompt past max_model_len) comes back as an error output:
    its row reported the workload's request count and a rate over what was left of it."""
    failed = [o.error for o in outs if o.error]
    if failed:
        raise ValueError(f"{len(failed)} of {len(outs)} requests failed, first: {failed[0]} (the workloads' "
                         "lengths scale with --scale: lower it, or raise --max-model-len)")


def shared_prefix_tokens(requests, block_size: int, prefix_caching: bool) -> int:
    """Leading prompt tokens that every request shares, in whole blocks before each prompt's
    last token: with the prefix cache they are the same KV blocks in every running sequence
    (gsm8k's 5-shot prefix), which a decode step must read once, not once a row (the engine's
    cascade decode reads them once per tile of rows). 0 without the prefix cache."""
    prompts = [p for p, _ in requests]
    if not prefix_caching or len(prompts) < 2:
        return 0
    common = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
    return max(0, common) // block_size * block_size


def decode_roofline(result, llm, bandwidth, batch=None, requests=None) -> dict:
    """Mean decode-step time (at `batch` running sequences, or all decode steps) against
    (weights + KV actually read + the step's new KV written) / copy bandwidth. The KV a step reads is its rows' keys
    (the engine's kv_tokens), a prefix that all of `requests` share (shared_prefix_tokens)
    counted once: a row's own copy of it is the same blocks as every other row's."""
    eng = llm.llm_engine
    steps = [r for r in result["step_log"] if r.kind in ("graph", "decode")
             and (batch is None or r.num_seqs == batch)]
    if not steps:
        return {}
    kv_per_token = eng.runner.block_bytes // eng.args.block_size
    shared = 0 if requests is None else shared_prefix_tokens(requests, eng.args.block_size,
                                                             eng.args.enable_prefix_caching)
    wb = weight_bytes(eng.runner.model)
    mean = sum(r.wall_s for r in steps) / len(steps)
    roof = sum(decode_step_bytes(wb, kv_per_token, r.kv_tokens - (r.num_seqs - 1) * shared, r.num_seqs)
               for r in steps) / len(steps) / bandwidth
    return {"decode_steps": len(steps), "decode_batch": batch or round(sum(r.num_seqs for r in steps) / len(steps)),
            "step_ms": mean * 1e3, "roofline_ms": roof * 1e3, "step_over_roofline": mean / roof}


def decode_step_bytes(weights: int, kv_per_token: int, keys: int, rows: int) -> int:
    """The least a decode step moves: the weights, the `keys` its attention reads, and each
    row's new key and value, written to the cache before they are read with the rest."""
    return weights + (keys + rows) * kv_per_token


def prefill_flops(model, config, prompt_lens, cached=None) -> float:
    """FLOPs of scoring these prompts: every linear but the LM head once a computed token, the
    head once a prompt, causal attention's two products (2 x multiply-adds) for the computed
    tokens' rows. `cached`: each prompt's leading tokens found in the prefix cache (computed
    by nothing in this run)."""
    named = dict(model.named_parameters())
    head = named.get("lm_head.weight", named["embed_tokens.weight"]).numel()
    linear = sum(p.numel() for n, p in named.items() if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
    attn = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    cached = cached or [0] * len(prompt_lens)
    return sum(2 * linear * (n - c) + 2 * head + attn * (n * (n + 1) - c * (c + 1)) / 2
               for n, c in zip(prompt_lens, cached, strict=True))


def prefill_roofline(result, llm, requests, flops_per_s) -> dict:
    """A decode-free workload's wall time against its FLOPs at the matmul's rate; prompt
    tokens the prefix cache held (the warm-up's requests are the workload's first) count none."""
    eng = llm.llm_engine
    flops = prefill_flops(eng.runner.model, eng.config, [len(p) for p, _ in requests],
                          result.get("cached_per_request"))
    roof = flops / flops_per_s
    return {"prefill_tflops": flops / result["wall_s"] / 1e12, "prefill_roofline_s": roof,
            "prefill_over_roofline": result["wall_s"] / roof}


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
