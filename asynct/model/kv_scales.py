"""Static FP8 KV scales from AsyncT's own weights (docs/fp8_kv.md): no calibration data.

k = RoPE(w_k * clamp(alpha * x, -1, 1)): the rotation mixes channels i and i + D/2 only, so both
are bounded by sqrt(w_i^2 + w_{i+D/2}^2). v = W_v h with |h_i| <= |w_h,i| (the input DyHT), so
|v_j| <= sum_i |W_v[j, i]| |w_h,i|. Both hold for every input; a scale is bound / FP8_MAX."""
import torch

from asynct.ops.kv_cache import FP8_DTYPE, FP8_MAX, dequantize, is_fp8  # noqa: F401  (is_fp8: re-exported)

KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


def _norm_weight(norm, dim: int) -> torch.Tensor:
    """|weight| of a DyHT as [dim] fp32 (a checkpoint may store one scalar weight)."""
    return norm.weight.detach().float().abs().expand(dim)


def k_bound(k_norm, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[Hkv, D]: the largest |k| any token can have, channel by channel (k_norm is per head_dim,
    shared by the heads)."""
    w = _norm_weight(k_norm, head_dim)
    pair = torch.sqrt(w * w + w.roll(head_dim // 2) ** 2)
    return pair.expand(num_kv_heads, head_dim).clone()


def v_bound(w_v: torch.Tensor, input_norm, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[Hkv, D]: the largest |v| any token can have (W_v [Hkv * D, hidden])."""
    w = _norm_weight(input_norm, w_v.shape[1])
    return (w_v.detach().float().abs() @ w).view(num_kv_heads, head_dim)


def layer_bounds(model, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k bound, v bound) of layer i of an AsyncTEngineModel."""
    layer = model.layers[i]
    hkv, d = layer.num_kv_heads, layer.head_dim
    w_v = layer.qkv_proj.weight[(layer.num_heads + hkv) * d:]
    return k_bound(layer.k_norm, hkv, d), v_bound(w_v, model.input_norms[i], hkv, d)


def bound_to_scale(bound: torch.Tensor) -> torch.Tensor:
    """Dequantisation scale (fp32): a channel whose bound is 0 is always 0; any scale stores it."""
    return torch.where(bound > 0, bound / FP8_MAX, torch.ones_like(bound)).float().contiguous()


@torch.no_grad()
def set_kv_scales(model):
    """Gives every attention layer's impl its static k_scale / v_scale ([Hkv, D] fp32)."""
    for i, layer in enumerate(model.layers):
        kb, vb = layer_bounds(model, i)
        layer.attn.impl.k_scale, layer.attn.impl.v_scale = bound_to_scale(kb), bound_to_scale(vb)


@torch.no_grad()
def observed_kv_max(llm, prompts) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the largest |k| and |v| ([Hkv, D]) that prefilling `prompts` produces: what the
    bounds are measured against (docs/fp8_kv.md, tests). Where the QKV projection stored them
    (every step, once the cache is bound), they are read back from the cache: measure on a 16-bit
    cache (an FP8 one holds them clamped to the bounds)."""
    from asynct import SamplingParams
    model = llm.llm_engine.runner.model
    seen = [[None, None] for _ in model.layers]

    def recording(i, forward):
        impl = model.layers[i].attn.impl

        def wrapped(q, k, v, kv_cache, md, *rest):
            out = forward(q, k, v, kv_cache, md, *rest)
            if k is None:       # the QKV projection stored them: read them back
                slots = md.slot_mapping[md.slot_mapping >= 0]
                k, v = (dequantize(kv_cache[j].flatten(0, 1)[slots], s, torch.float32)
                        for j, s in ((0, impl.k_scale), (1, impl.v_scale)))
            for j, x in enumerate((k, v)):
                m = x.float().abs().amax(0)
                seen[i][j] = m if seen[i][j] is None else torch.maximum(seen[i][j], m)
            return out
        return wrapped
    for i, layer in enumerate(model.layers):
        layer.attn.impl.forward = recording(i, layer.attn.impl.forward)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        for layer in model.layers:
            del layer.attn.impl.forward
    return [tuple(s) for s in seen]
