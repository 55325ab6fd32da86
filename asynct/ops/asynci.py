"""AsyncI attention on dense (unpaged) tensors: the plain-PyTorch reference of docs/model.md.

    s_j  = scale * (q_i . k_j)
    r_j  = relu(s_j) if relu_pre else s_j
    lp_j = (1/P) * sum_{m<P} r_{j-m}          (zero left padding)
    a_j  = clamp(s_j - sigma_h * lp_j, 0, 1)  for j <= i, else 0
    o_i  = sum_j a_j v_j
"""
import torch


def causal_avg_pool(r: torch.Tensor, pool_size: int) -> torch.Tensor:
    """Causal average pool along the last axis with zero left padding, always divided by P."""
    lp = r.clone()
    for m in range(1, min(pool_size, r.shape[-1])):
        lp[..., m:] += r[..., :-m]
    return lp / pool_size


def asynci_gate(s: torch.Tensor, valid: torch.Tensor, sigma: torch.Tensor, pool_size: int,
                relu_pre: bool) -> torch.Tensor:
    """Attention weights from fp32 scores `s` [B, H, Tq, Tk]; `valid` broadcasts to `s` and
    marks the keys a query may see. Invalid keys count as r = 0 in the pool of later keys."""
    r = s.clamp_min(0) if relu_pre else s
    lp = causal_avg_pool(r.masked_fill(~valid, 0.0), pool_size)
    a = (s - sigma.view(1, -1, 1, 1).to(s.dtype) * lp).clamp_(0.0, 1.0)
    return a.masked_fill_(~valid, 0.0)


def asynci_attention(q, k, v, sigma, scale, pool_size=3, relu_pre=True, key_mask=None, q_offset=0):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> [B, Hq, Tq, D].

    Query row i sits at key index `q_offset + i` (an int, or a [B] tensor of per-row offsets) and
    sees keys 0..q_offset+i. `key_mask` [B, Tk]
    (bool) marks real keys; padding keys contribute nothing and pool as zeros.
    Products run in the inputs' dtype with the result taken to fp32, as transformers' eager
    attention does; the gate is fp32."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 gate (fp64 stays fp64 for oracles)
    s = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
    tq, tk = s.shape[-2:]
    offset = q_offset.view(-1, 1, 1, 1) if torch.is_tensor(q_offset) else q_offset
    rows = torch.arange(tq, device=q.device).view(1, 1, -1, 1) + offset
    valid = torch.arange(tk, device=q.device).view(1, 1, 1, -1) <= rows
    if key_mask is not None:
        valid = valid & key_mask.bool().view(-1, 1, 1, tk)
        # a padding key's value may be anything: the torch backend gathers cache slot 0 for it,
        # which need not hold K/V (the cache is torch.empty; a step that failed to launch left
        # its block unwritten), and a zero weight times NaN is NaN
        v = v.masked_fill(~key_mask.bool().view(-1, 1, tk, 1), 0.0)
    a = asynci_gate(s, valid, sigma, pool_size, relu_pre)
    return torch.matmul(a.to(v.dtype), v)
