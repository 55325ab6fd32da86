"""Obviously-correct paged AsyncI: gather each sequence's keys, then the dense reference.

Slow (a Python loop over sequences); for tests and CPU runs only. Computes in fp32; an FP8
cache is dequantised with its static scales first."""
import torch

from asynct.ops.asynci import asynci_attention
from asynct.ops.kv_cache import check_kv_scales, dequantize


def gather_kv(kv_cache, block_row, n, k_scale=None, v_scale=None):
    """Keys/values 0..n-1 of one sequence as [Hkv, n, D] each (fp32 where scales are given)."""
    bs = kv_cache.shape[2]
    idx = torch.arange(n, device=kv_cache.device)
    blocks = block_row[idx // bs].long()
    kv = kv_cache[:, blocks, idx % bs]  # [2, n, Hkv, D]
    k, v = dequantize(kv[0], k_scale, torch.float32), dequantize(kv[1], v_scale, torch.float32)
    return k.transpose(0, 1), v.transpose(0, 1)


def _attend(q, kv_cache, block_row, n, sigma, scale, pool_size, relu_pre, k_scale, v_scale):
    """q [Hq, Tq, D]: the last Tq of n positions -> [Hq, Tq, D] fp32."""
    if n == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k, v = gather_kv(kv_cache, block_row, n, k_scale, v_scale)
    o = asynci_attention(q[None].float(), k[None].float(), v[None].float(), sigma.float(), scale,
                         pool_size, relu_pre, q_offset=n - q.shape[1])
    return o[0]


def asynci_decode_ref(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                      k_scale=None, v_scale=None, **_):
    check_kv_scales(kv_cache, k_scale, v_scale)
    for b in range(q.shape[0]):
        o = _attend(q[b][:, None], kv_cache, block_table[b], int(seq_lens[b]), sigma, scale,
                    pool_size, relu_pre, k_scale, v_scale)
        out[b] = o[:, 0].to(out.dtype)
    return out


def asynci_prefill_ref(q, kv_cache, block_table, query_start_loc, seq_lens, sigma, scale,
                       pool_size, relu_pre, out, max_query_len=None, max_seq_len=None, k_scale=None,
                       v_scale=None):
    check_kv_scales(kv_cache, k_scale, v_scale)
    for b in range(seq_lens.shape[0]):
        lo, hi = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if hi == lo:
            continue
        o = _attend(q[lo:hi].transpose(0, 1), kv_cache, block_table[b], int(seq_lens[b]), sigma,
                    scale, pool_size, relu_pre, k_scale, v_scale)
        out[lo:hi] = o.transpose(0, 1).to(out.dtype)
    return out
