"""AsyncI over vLLM's paged KV cache in plain PyTorch (no vLLM import; any device, any head size).

The cache of one layer is vLLM's logical `[num_blocks, num_kv_heads, block_size, 2*head_size]`
view, in whatever physical stride order vLLM chose: a token's key is `[..., :D]` and its value
`[..., D:]` (the split vLLM's own FlashAttention and CPU backends use). Everything here goes
through indexing, never through `.view()` of the cache, so any stride order works.

The batched path follows the seed's diary (1.2-1.4): the scheduler's batch is cut once per step
into groups of (request, query-row range) segments whose padded score tensor fits a budget; each
layer then does one gather, two matmuls and the gate per group, with no per-request Python.
"""
from dataclasses import dataclass

import torch

from asynct.ops.asynci import asynci_gate

# Padded fp32 score elements (B * Hq * Tq * Tk) one group may need: 2**24 is 64 MiB.
SCORE_BUDGET = 1 << 24


def write_kv(key, value, kv_cache, slot_mapping, has_padding=True):
    """Stores key/value [T, Hkv, D] at `slot_mapping` [T] (block * block_size + offset).
    Negative slots are padding and are skipped; `has_padding=False` (known once per step)
    saves the check."""
    d = key.shape[-1]
    if has_padding:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    bs = kv_cache.shape[2]
    blocks, offs = (slot_mapping // bs).long(), (slot_mapping % bs).long()
    # Advanced indices on dims 0 and 2 around a slice: the indexed shape is [T, Hkv, D].
    kv_cache[blocks, :, offs, :d] = key.to(kv_cache.dtype)
    kv_cache[blocks, :, offs, d:] = value.to(kv_cache.dtype)


def as_ops_layout(kv_cache):
    """The same memory as the `[2, num_blocks, block_size, Hkv, D]` view that `asynct.ops`
    takes (strided, no copy)."""
    nb, hkv, bs, d2 = kv_cache.shape
    return kv_cache.unflatten(-1, (2, d2 // 2)).permute(3, 0, 2, 1, 4)


@dataclass
class Group:
    """Index tensors for one padded batch of query segments, built once per step."""
    q_rows: torch.Tensor      # [b, tq] long: rows of the step's query tensor (0 where padding)
    q_valid: torch.Tensor     # [b, tq] bool
    key_blocks: torch.Tensor  # [b, tk] long: cache block of each key position
    key_offs: torch.Tensor    # [tk] long: offset of each key position inside its block
    valid: torch.Tensor       # [b, 1, tq, tk] bool: causal and in-sequence


def _segments(q_lens, seq_lens, num_heads, budget):
    """(request, first row, end row) pieces whose own score tensor fits the budget."""
    segs = []
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        rows = max(1, budget // max(1, num_heads * sl))
        segs += [(r, lo, min(ql, lo + rows)) for lo in range(0, ql, rows)]
    return segs


def _batches(segs, q_lens, seq_lens, num_heads, budget):
    """Greedy consecutive batches of segments, padded size within the budget."""
    out, cur, tq, tk = [], [], 0, 0
    for seg in segs:
        r, lo, hi = seg
        keys = seq_lens[r] - q_lens[r] + hi  # the segment's last row sees this many keys
        ntq, ntk = max(tq, hi - lo), max(tk, keys)
        if cur and (len(cur) + 1) * num_heads * ntq * ntk > budget:
            out.append(cur)
            cur, ntq, ntk = [], hi - lo, keys
        cur.append(seg)
        tq, tk = ntq, ntk
    return out + [cur] if cur else out


def _group(batch, qsl, q_lens, seq_lens, block_table, block_size, device):
    req = torch.tensor([s[0] for s in batch])
    lo = torch.tensor([s[1] for s in batch])
    n = torch.tensor([s[2] - s[1] for s in batch])
    ctx = torch.tensor([seq_lens[s[0]] - q_lens[s[0]] for s in batch])
    keys = ctx + lo + n
    i = torch.arange(int(n.max()))
    j = torch.arange(int(keys.max()))
    q_valid = i[None] < n[:, None]
    q_rows = torch.where(q_valid, torch.tensor(qsl)[req][:, None] + lo[:, None] + i[None], 0)
    pos = ctx[:, None] + lo[:, None] + i[None]  # absolute position of each query row
    valid = (j[None, None] <= pos[:, :, None]) & (j[None, None] < keys[:, None, None])
    key_blocks = block_table[req.to(block_table.device)][:, j.to(block_table.device) // block_size]
    return Group(q_rows.to(device), q_valid.to(device), key_blocks.long().to(device),
                 (j % block_size).to(device), valid[:, None].to(device))


def plan(query_start_loc, seq_lens, block_table, block_size, num_heads, budget=SCORE_BUDGET):
    """Groups for one step. `query_start_loc` [B+1] and `seq_lens` [B] may live anywhere (read
    once to the host here, the one place per step where that is allowed)."""
    qsl = [int(x) for x in query_start_loc.tolist()]
    sl = [int(x) for x in seq_lens.tolist()]
    ql = [b - a for a, b in zip(qsl, qsl[1:])]
    segs = _segments(ql, sl, num_heads, budget)
    return [_group(b, qsl, ql, sl, block_table, block_size, block_table.device)
            for b in _batches(segs, ql, sl, num_heads, budget)]


def attend(query, kv_cache, groups, sigma, scale, pool_size, relu_pre, out):
    """AsyncI of every query row [T, Hq, D] into `out` [T, Hq, D], per MODEL.md: products in the
    inputs' dtype taken to fp32, gate in fp32 (as the reference model does)."""
    d = query.shape[-1]
    g = query.shape[1] // kv_cache.shape[1]
    for grp in groups:
        kv = kv_cache[grp.key_blocks, :, grp.key_offs]            # [b, tk, Hkv, 2D]
        k = kv[..., :d].transpose(1, 2).repeat_interleave(g, 1)    # [b, Hq, tk, D]
        v = kv[..., d:].transpose(1, 2).repeat_interleave(g, 1)
        q = query[grp.q_rows].transpose(1, 2).to(k.dtype)          # [b, Hq, tq, D]
        s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        a = asynci_gate(s, grp.valid, sigma, pool_size, relu_pre)
        o = torch.matmul(a.to(v.dtype), v).transpose(1, 2)         # [b, tq, Hq, D]
        out[grp.q_rows[grp.q_valid]] = o[grp.q_valid].to(out.dtype)
    return out
