"""The reference model against an independent float64 evaluation of docs/model.md."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import spec_oracle
from asynct.model.checkpoint import dyht_modules, make_checkpoint
from asynct.ops.asynci import asynci_attention


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("hq,hkv,pool,relu_pre,sigma_sign", [
    (4, 4, 3, True, 1), (4, 2, 1, True, -1), (8, 2, 5, False, 1), (4, 1, 2, True, -1), (2, 2, 4, False, -1)])
def test_asynci_matches_loop(hq, hkv, pool, relu_pre, sigma_sign):
    g = torch.Generator().manual_seed(hq * 31 + pool)
    t, d = 13, 8
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    sigma = sigma_sign * torch.rand(hq, generator=g, dtype=torch.float64) * 2
    ref = spec_oracle.asynci_loop(q, k, v, sigma, 0.4, pool, relu_pre)
    out = asynci_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                           sigma, 0.4, pool, relu_pre)[0].transpose(0, 1)
    assert rel_err(out, ref) < 1e-12


def test_negative_sigma_ignores_future_keys():
    """With sigma < 0 the gate grows with the pool; keys after the query must still add nothing."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    sigma = torch.tensor([-3.0, -1.0])
    base = asynci_attention(q, k, v, sigma, 0.5, 3, True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 5:] += 10 * torch.randn(1, 2, 4, 8, generator=g)
    v2[:, :, 5:] += 10
    out = asynci_attention(q, k2, v2, sigma, 0.5, 3, True)
    assert torch.equal(out[:, :, :5], base[:, :, :5])


def perturb(path, seed, alpha_channel=True, scalar_weight=False):
    """Random DyHT parameters (alpha [C] or [1], weight [C] or [1]) and signed sigma, in place."""
    g = torch.Generator().manual_seed(seed)
    cfg = json.loads((path / "config.json").read_text())
    t = load_file(path / "model.safetensors")
    from asynct import AsyncTConfig
    for prefix, ch in dyht_modules(AsyncTConfig(**cfg)).items():
        t[f"{prefix}.alpha"] = 0.5 + torch.rand(ch if alpha_channel else 1, generator=g) * 2
        t[f"{prefix}.weight"] = torch.randn(1 if scalar_weight else ch, generator=g)
    for name in t:
        if name.endswith("sigma"):
            t[name] = torch.randn(t[name].shape, generator=g)
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    return t


VARIANTS = {
    "gqa1": dict(num_key_value_heads=4),
    "gqa4-headdim": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12),
    "pool1-relu-off": dict(asynci_pool_size=1, asynci_relu_pre=False),
    "pool5-scale-tied": dict(asynci_pool_size=5, attention_scale=0.3, tie_word_embeddings=True),
    "pool2": dict(asynci_pool_size=2, rope_theta=500.0),
    "pool4": dict(asynci_pool_size=4),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_float64_spec(tmp_path, name):
    path = make_checkpoint("tiny", tmp_path, seed=3, **VARIANTS[name])
    tensors = perturb(path, seed=len(name), alpha_channel=name != "pool2", scalar_weight=name == "pool4")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 259, (21,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    ref = spec_oracle.forward(model.config, {k: v.double() for k, v in tensors.items()}, ids)
    assert rel_err(logits, ref) < 1e-4


def test_incremental_decoding_equals_full_forward(tiny_ckpt):
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        cache, steps = out.cache if hasattr(out, "cache") else out.past_key_values, [out.logits]
        for i in range(5, 17):
            out = model(ids[:, i:i + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    assert rel_err(torch.cat(steps, 1), full) < 1e-5


def test_left_padded_batch_generate_equals_single(tiny_ckpt):
    """The HF baseline runs left-padded batches: padding must change nothing."""
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (3, 11, 7)]
    width = max(len(p) for p in prompts)
    ids = torch.full((3, width), 257)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=257)
    for i, p in enumerate(prompts):
        single = model.generate(p[None], max_new_tokens=6, do_sample=False, pad_token_id=257)
        assert batch[i, width:].tolist() == single[0, len(p):].tolist()


def test_random_init_is_not_degenerate(tmp_path):
    path = make_checkpoint("tiny", tmp_path, hidden_size=256, num_attention_heads=4, head_dim=64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    captured = []
    import asynct.ops.asynci as ops_asynci
    real_gate = ops_asynci.asynci_gate

    def spy(s, valid, *a):
        out = real_gate(s, valid, *a)
        captured.append(out[valid.expand_as(out)])
        return out
    ops_asynci.asynci_gate = spy
    try:
        with torch.no_grad():
            model(torch.randint(0, 256, (1, 64)))
    finally:
        ops_asynci.asynci_gate = real_gate
    a = torch.cat(captured)
    zero, one = (a == 0).float().mean().item(), (a == 1).float().mean().item()
    assert 0.05 < zero < 0.95 and one < 0.5 and a.max() > 0
