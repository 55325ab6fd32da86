"""An independent float64 evaluation of docs/model.md, written out loop by loop for the tests."""
import math

import torch


def dyht(x, t, prefix):
    return t[f"{prefix}.weight"] * torch.clamp(t[f"{prefix}.alpha"] * x, -1, 1)


def asynci_loop(q, k, v, sigma, scale, pool, relu_pre):
    """q [T, Hq, D], k/v [T, Hkv, D], float64; per query, per key, the pool written out."""
    t_len, hq, _ = q.shape
    g = hq // k.shape[1]
    out = torch.zeros_like(q)
    for h in range(hq):
        kh = h // g
        for i in range(t_len):
            s = [scale * float(q[i, h] @ k[j, kh]) for j in range(i + 1)]
            r = [max(x, 0.0) if relu_pre else x for x in s]
            for j in range(i + 1):
                lp = sum(r[j - m] for m in range(pool) if j - m >= 0) / pool
                a = min(max(s[j] - float(sigma[h]) * lp, 0.0), 1.0)
                out[i, h] += a * v[j, kh]
    return out


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def forward(cfg, t, ids):
    """Logits [T, V] of one sequence, from the tensors `t` (name -> float64 tensor)."""
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    scale = cfg.attention_scale if cfg.attention_scale is not None else 1 / math.sqrt(cfg.hidden_size)
    pos = torch.arange(len(ids))
    x = t["model.embed_tokens.weight"][ids]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        h = dyht(x, t, f"{p}.input_layernorm")
        q = (h @ t[f"{p}.self_attn.q_proj.weight"].T).view(-1, hq, d)
        k = (h @ t[f"{p}.self_attn.k_proj.weight"].T).view(-1, hkv, d)
        v = (h @ t[f"{p}.self_attn.v_proj.weight"].T).view(-1, hkv, d)
        q = rope(dyht(q, t, f"{p}.self_attn.q_norm"), pos, cfg.rope_theta)
        k = rope(dyht(k, t, f"{p}.self_attn.k_norm"), pos, cfg.rope_theta)
        o = asynci_loop(q, k, v, t[f"{p}.self_attn.sigma"], scale, cfg.asynci_pool_size, cfg.asynci_relu_pre)
        o = o.reshape(len(ids), -1) @ t[f"{p}.self_attn.o_proj.weight"].T
        x = x + dyht(o, t, f"{p}.post_attention_layernorm")
        m = dyht(x, t, f"{p}.pre_feedforward_layernorm")
        g = torch.relu(m @ t[f"{p}.mlp.gate_proj.weight"].T) * (m @ t[f"{p}.mlp.up_proj.weight"].T)
        x = x + g @ t[f"{p}.mlp.down_proj.weight"].T
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return dyht(x, t, "model.norm") @ head.T
