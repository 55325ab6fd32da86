"""AsyncI over vLLM's paged KV cache in plain PyTorch (no vLLM import; any device, any head size).

The cache is the `[2, num_blocks, block_size, Hkv, D]` view of vLLM's (`attend.as_ops_layout`),
of any strides: everything here goes through indexing, never through `.view()` of the cache.

The batched path is the original vLLM adaptation's: the scheduler's batch is cut once per step
into groups of (request, query-row range) segments whose padded score tensor fits a budget; each
layer then does one gather, two matmuls and the gate per group, with no per-request Python.
"""
from dataclasses import dataclass

import torch

from asynct.ops.asynci import asynci_gate

# Padded fp32 score elements (B * Hq * Tq * Tk) one group may need: 2**24 is 64 MiB.
SCORE_BUDGET = 1 << 24


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
    """AsyncI of every query row [T, Hq, D] into `out` [T, Hq, D], per docs/model.md: products in the
    inputs' dtype taken to fp32, gate in fp32 (as the reference model does)."""
    g = query.shape[1] // kv_cache.shape[3]
    for grp in groups:
        kv = kv_cache[:, grp.key_blocks, grp.key_offs]             # [2, b, tk, Hkv, D]
        k = kv[0].transpose(1, 2).repeat_interleave(g, 1)          # [b, Hq, tk, D]
        v = kv[1].transpose(1, 2).repeat_interleave(g, 1)
        q = query[grp.q_rows].transpose(1, 2).to(k.dtype)          # [b, Hq, tq, D]
        s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        a = asynci_gate(s, grp.valid, sigma, pool_size, relu_pre)
        o = torch.matmul(a.to(v.dtype), v).transpose(1, 2)         # [b, tq, Hq, D]
        out[grp.q_rows[grp.q_valid]] = o[grp.q_valid].to(out.dtype)
    return out
