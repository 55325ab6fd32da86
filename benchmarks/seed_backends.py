"""The early attention paths of the original vLLM adaptation ("the seed", benchmarks/RESULTS.md), as registered backends, for the ablation only.

Each reuses the engine's builder and differs only in how the request dimension is handled:
`seed-loop` attends request by request; `seed-padded` copies every request into one padded
batch with a Python loop; `seed-bucketed` does the same per length bucket."""
import torch

from asynct.attention.base import AttentionBackend, AttentionImpl, register_backend
from asynct.attention.torch_backend import plan_buckets
from asynct.attention.triton_backend import TritonMetadataBuilder
from asynct.ops.asynci import asynci_attention


def _token_slots(table_row, n, bs, device):
    idx = torch.arange(n, device=device)
    return table_row[idx // bs].long() * bs + idx % bs


class _SeedImpl(AttentionImpl):
    def _attend(self, q, k, v, key_mask, q_offset):
        return asynci_attention(q, k, v, self.sigma, self.scale, self.pool_size, self.relu_pre,
                                key_mask=key_mask, q_offset=q_offset)


class LoopImpl(_SeedImpl):
    def forward(self, q, k, v, kv_cache, md, output):
        self.store_kv(k, v, kv_cache, md)
        kf, vf, bs = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1), kv_cache.shape[2]
        qsl, seq = md.query_start_loc_cpu, md.seq_lens_cpu
        for i in range(md.num_reqs):
            slots = _token_slots(md.block_table[i], seq[i], bs, q.device)
            qi = q[qsl[i]:qsl[i + 1]].transpose(0, 1)[None]
            o = self._attend(qi, kf[slots].transpose(0, 1)[None], vf[slots].transpose(0, 1)[None], None,
                             seq[i] - (qsl[i + 1] - qsl[i]))
            output[qsl[i]:qsl[i + 1]] = o[0].transpose(0, 1).to(output.dtype)
        return output


class PaddedImpl(_SeedImpl):
    bucketed = False

    def forward(self, q, k, v, kv_cache, md, output):
        self.store_kv(k, v, kv_cache, md)
        qsl, seq = md.query_start_loc_cpu, md.seq_lens_cpu
        qlens = [qsl[i + 1] - qsl[i] for i in range(md.num_reqs)]
        groups = plan_buckets(qlens, list(seq)) if self.bucketed else [list(range(md.num_reqs))]
        for rows in groups:
            self._group(rows, q, kv_cache, md, output, qlens)
        return output

    def _group(self, rows, q, kv_cache, md, output, qlens):
        kf, vf, bs = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1), kv_cache.shape[2]
        seq, qsl = md.seq_lens_cpu, md.query_start_loc_cpu
        tq, tk = max(qlens[i] for i in rows), max(seq[i] for i in rows)
        qp = q.new_zeros(len(rows), tq, *q.shape[1:])
        kp = kf.new_zeros(len(rows), tk, *kf.shape[1:])
        vp, mask = torch.zeros_like(kp), torch.zeros(len(rows), tk, dtype=torch.bool, device=q.device)
        for b, i in enumerate(rows):             # the original adaptation's memcpy-only loop
            slots = _token_slots(md.block_table[i], seq[i], bs, q.device)
            qp[b, :qlens[i]] = q[qsl[i]:qsl[i + 1]]
            kp[b, :seq[i]], vp[b, :seq[i]], mask[b, :seq[i]] = kf[slots], vf[slots], True
        off = torch.tensor([seq[i] - qlens[i] for i in rows], device=q.device)
        o = self._attend(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), mask, off).transpose(1, 2)
        for b, i in enumerate(rows):
            output[qsl[i]:qsl[i + 1]] = o[b, :qlens[i]].to(output.dtype)


class BucketedImpl(PaddedImpl):
    bucketed = True


def _backend(name, impl):
    cls = type(f"Seed{impl.__name__}Backend", (AttentionBackend,), {
        "name": name, "get_builder_cls": classmethod(lambda c: TritonMetadataBuilder),
        "get_impl_cls": classmethod(lambda c: impl)})
    return register_backend(cls)


for _name, _impl in (("seed-loop", LoopImpl), ("seed-padded", PaddedImpl), ("seed-bucketed", BucketedImpl)):
    _backend(_name, _impl)
