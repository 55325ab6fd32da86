"""The `torch` backend: the vectorised path of the original vLLM adaptation, on any device.

Per step, the builder sorts the sequences by length and packs them into buckets whose padded
size stays under a budget; for each bucket it expands block tables into token indices once.
Each layer then does one gather and one batched dense AsyncI per bucket: no per-request loop.
"""
from dataclasses import dataclass

import torch

from asynct.attention.base import (AttentionBackend, AttentionImpl, AttentionMetadata,
                                   AttentionMetadataBuilder, StepInputs, block_table_array,
                                   register_backend)
from asynct.ops.asynci import asynci_attention
from asynct.ops.kv_cache import dequantize

MAX_BUCKET_KEYS = 1 << 17        # padded keys gathered per bucket (131072, as in the original vLLM adaptation)
MAX_BUCKET_SCORES = 1 << 22      # padded query x key scores per head per bucket


@dataclass(frozen=True)
class Bucket:
    key_index: torch.Tensor   # [b, tk] flat slots into the cache's [num_blocks * block_size]
    key_mask: torch.Tensor    # [b, tk] real keys
    q_index: torch.Tensor     # [b, tq] rows of the step's queries (0 where padded)
    q_mask: torch.Tensor      # [b, tq]
    q_offset: torch.Tensor    # [b] key index of each sequence's first query
    out_rows: torch.Tensor    # q_index[q_mask]


@dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    buckets: tuple = ()


def plan_buckets(query_lens, seq_lens):
    """Sequences sorted by length, cut greedily so every bucket's padding stays in budget."""
    order = sorted(range(len(seq_lens)), key=lambda i: seq_lens[i])
    buckets, cur, max_tk, max_tq = [], [], 0, 0
    for i in order:
        tk, tq = max(max_tk, seq_lens[i]), max(max_tq, query_lens[i])
        n = len(cur) + 1
        if cur and (n * tk > MAX_BUCKET_KEYS or n * tq * tk > MAX_BUCKET_SCORES):
            buckets.append(cur)
            cur, tk, tq = [], seq_lens[i], query_lens[i]
        cur.append(i)
        max_tk, max_tq = tk, tq
    return buckets + [cur] if cur else buckets


class TorchMetadataBuilder(AttentionMetadataBuilder):
    def build(self, step: StepInputs) -> TorchAttentionMetadata:
        common = self.common(step)
        table = torch.from_numpy(block_table_array(step.block_tables)).long()  # host copy: no device sync
        qsl = torch.tensor(common["query_start_loc_cpu"])
        buckets = tuple(self._bucket(rows, step, table, qsl)
                        for rows in plan_buckets(step.query_lens, step.seq_lens))
        return TorchAttentionMetadata(**common, buckets=buckets)

    def _bucket(self, rows, step, table, qsl) -> Bucket:
        rows_t = torch.tensor(rows)
        seq = torch.tensor([step.seq_lens[i] for i in rows])
        qlen = torch.tensor([step.query_lens[i] for i in rows])
        j = torch.arange(int(seq.max()))
        key_mask = j[None] < seq[:, None]
        blocks = table[rows_t][:, : (len(j) + self.block_size - 1) // self.block_size]
        key_index = blocks.gather(1, (j // self.block_size)[None].expand(len(rows), -1))
        key_index = (key_index * self.block_size + j % self.block_size).masked_fill(~key_mask, 0)
        t = torch.arange(int(qlen.max()))
        q_mask = t[None] < qlen[:, None]
        q_index = (qsl[rows_t][:, None] + t[None]).masked_fill(~q_mask, 0)
        dev = self.device
        return Bucket(key_index.to(dev), key_mask.to(dev), q_index.to(dev), q_mask.to(dev),
                      (seq - qlen).to(dev), q_index[q_mask].to(dev))


class TorchAttentionImpl(AttentionImpl):
    def forward(self, q, k, v, kv_cache, metadata: TorchAttentionMetadata, output):
        self.store_kv(k, v, kv_cache, metadata)
        k_flat, v_flat = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)
        for b in metadata.buckets:
            qb = q[b.q_index].transpose(1, 2)                  # [b, Hq, tq, D]
            kb = dequantize(k_flat[b.key_index], self.k_scale, q.dtype).transpose(1, 2)  # [b, Hkv, tk, D]
            vb = dequantize(v_flat[b.key_index], self.v_scale, q.dtype).transpose(1, 2)
            o = asynci_attention(qb, kb, vb, self.sigma, self.scale, self.pool_size, self.relu_pre,
                                 key_mask=b.key_mask, q_offset=b.q_offset)
            output[b.out_rows] = o.transpose(1, 2)[b.q_mask].to(output.dtype)
        return output


@register_backend
class TorchBackend(AttentionBackend):
    name = "torch"

    @classmethod
    def get_builder_cls(cls):
        return TorchMetadataBuilder

    @classmethod
    def get_impl_cls(cls):
        return TorchAttentionImpl
