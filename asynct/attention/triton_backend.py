"""The `triton` backend: split-K decode for the decode subset, varlen paged prefill for the rest.

Where every decoding sequence holds the same leading KV blocks (few-shot prompts through the
prefix cache: lm-eval's gsm8k shares a 5-shot prefix across all 1,319 requests), decode reads
that prefix once per tile of sequences instead of once per sequence (cascade attention).

The CUDA-graph hooks keep static metadata buffers for decode-only steps (graph_inputs.py): replay
sends the real step's rows there in one copy, the rest empty sequences that write nowhere."""
import itertools
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from asynct.attention.base import (AttentionBackend, AttentionImpl, AttentionMetadata,
                                   AttentionMetadataBuilder, StepInputs, block_table_array,
                                   host_to_device, register_backend)
from asynct.attention.graph_inputs import GraphStepInputs, longest_first
from asynct.ops import asynci_decode
from asynct.ops.asynci_decode import decode_launch
from asynct.ops.asynci_prefill import prefill_launch, warmup_prefill

CASCADE_MIN_DECODES = 16     # below this, a prefix tile holds too few sequences to pay off
CASCADE_MIN_PREFIX = 128     # keys: two tiles
# Decode-only steps of at most this many sequences add their key splits into fp32 sums by
# atomics (asynci_decode's `accumulate`) that o_proj's CUDA-core path reads as they are: no
# split partials, no sum kernel, one kernel boundary fewer a layer. H200, bench-0.6b, whole
# decode steps (two runs, benchmarks/RESULTS.md): 1.03-1.06x faster at one sequence, 1.00-1.01x
# at two, 0.96-0.98x at three and four; the adds' order varies from run to run, so the last bits
# of a step's attention may too: only where it pays. o_proj takes the sums up to GEMV_MAX_ROWS.
DECODE_SUMS_MAX_ROWS = 1
# Decodes of at least this many sequences take their rows longest first (asynci_decode's
# `order`): the programs of the longest rows start first and the short ones fill in behind
# them. H200, bench-0.6b (8 q / 4 KV heads of 128), contexts of 100-2,048 keys, whole decode
# steps in CUDA graphs, two repetitions: 64 sequences 1.03x faster, 96 1.13x, 128 0.99x, 192
# 1.12x, 256 1.15-1.17x. The decode kernel alone: 64-256 rows 1.08-1.34x; 256 rows of equal
# lengths 1.00x; 224 behind a shared 688-key prefix (cascade) 1.03-1.04x (benchmarks/RESULTS.md).
DECODE_ORDER_MIN_ROWS = 64


def shared_prefix_len(table: np.ndarray, seq_lens: list[int], num_decodes: int, block_size: int) -> int:
    """Keys that every decoding sequence holds in the same blocks, whole blocks before each
    one's last key (the prefix cache shares blocks only where the tokens agree); 0 if too few."""
    if num_decodes < CASCADE_MIN_DECODES:
        return 0
    full = (min(seq_lens[:num_decodes]) - 1) // block_size
    rows = table[:num_decodes, :full]
    same = (rows == rows[0]).all(axis=0)
    n = full if same.all() else int(same.argmin())
    return n * block_size if n * block_size >= CASCADE_MIN_PREFIX else 0


@dataclass(frozen=True)
class TritonAttentionMetadata(AttentionMetadata):
    prefill_query_start_loc: torch.Tensor | None = None   # query_start_loc[num_decodes:] - num_decodes
    max_prefill_query_len: int = 0
    max_prefill_seq_len: int = 0
    max_decode_seq_len: int = 0
    decode_prefix_len: torch.Tensor | None = None   # int32 [1]: keys all decodes share; None: no cascade
    decode_prefix_len_cpu: int = 0
    decode_accumulates: bool = False   # into fp32 sums (DECODE_SUMS_MAX_ROWS)
    decode_order: torch.Tensor | None = None   # int32 [num_decodes]: rows longest first (DECODE_ORDER_MIN_ROWS)
    # the step's attention launches, planned by the first layer for all (TritonAttentionImpl.launch)
    launches: dict = field(default_factory=dict, init=False, compare=False, repr=False)


class TritonMetadataBuilder(AttentionMetadataBuilder):
    def build(self, step: StepInputs) -> TritonAttentionMetadata:
        table = block_table_array(step.block_tables)
        c = self.common(step, table)
        nd = step.num_decodes
        pre_q, pre_s = step.query_lens[nd:], step.seq_lens[nd:]
        plen = shared_prefix_len(table, step.seq_lens, nd, self.block_size)
        return TritonAttentionMetadata(
            **c, prefill_query_start_loc=(c["query_start_loc"][nd:] - nd) if pre_q else None,
            max_prefill_query_len=max(pre_q, default=0), max_prefill_seq_len=max(pre_s, default=0),
            max_decode_seq_len=max(step.seq_lens[:nd], default=0),
            decode_prefix_len=host_to_device([plen], torch.int32, self.device) if plen else None,
            decode_prefix_len_cpu=plen,
            decode_accumulates=self.device.type == "cuda" and not pre_q and 0 < nd <= DECODE_SUMS_MAX_ROWS,
            decode_order=(host_to_device(longest_first(step.seq_lens[:nd], nd), torch.int32, self.device)
                          if nd >= DECODE_ORDER_MIN_ROWS else None))


class TritonAttentionImpl(AttentionImpl):
    def accumulates(self, md: TritonAttentionMetadata) -> bool:
        return md.decode_accumulates

    def forward(self, q, k, v, kv_cache, md: TritonAttentionMetadata, output):
        self.store_kv(k, v, kv_cache, md)
        nd, na = md.num_decode_tokens, md.num_actual_tokens
        if nd:
            self.launch(md, "decode", q[:nd], kv_cache, output[:nd])
        if md.num_prefills:
            self.launch(md, "prefill", q[nd:na], kv_cache, output[nd:na])
        return output

    def launch(self, md: TritonAttentionMetadata, kind, q, kv_cache, out):
        """The step's launch of `kind`, planned by the first layer that needs it (the layers'
        pool size, ReLU and scale are the model's, so they share it: part of the key anyway)."""
        key = (kind, self.pool_size, self.relu_pre, self.scale)
        launch = md.launches.get(key)
        if launch is None:
            launch = md.launches[key] = self.plan(md, kind, q, kv_cache, out)
        launch(q, kv_cache, self.sigma, out, self.k_scale, self.v_scale)

    def plan(self, md: TritonAttentionMetadata, kind, q, kv_cache, out):
        nd, args = md.num_decode_tokens, (self.sigma, self.scale, self.pool_size, self.relu_pre)
        if kind == "decode":
            return decode_launch(q, kv_cache, md.block_table[:nd], md.seq_lens[:nd], *args, out,
                                 max_seq_len=md.max_decode_seq_len, prefix_len=md.decode_prefix_len,
                                 accumulate=md.decode_accumulates, order=md.decode_order)
        return prefill_launch(q, kv_cache, md.block_table[nd:], md.prefill_query_start_loc, md.seq_lens[nd:], *args,
                              out, max_query_len=md.max_prefill_query_len, max_seq_len=md.max_prefill_seq_len)


@register_backend
class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    @classmethod
    def get_builder_cls(cls):
        return TritonMetadataBuilder

    @classmethod
    def get_impl_cls(cls):
        return TritonAttentionImpl

    def warmup(self, impl, kv_cache, dtype):
        """Decode's compiled variants: one split (written straight to the output) or several
        (fp32 partials, then a sum), each with and without the shared prefix's tiles and the rows'
        order; then every prefill variant the plan can pick for the pool (`prefill_variants`).
        Nothing else a step passes is a specialisation key (asynct/ops/_triton.py)."""
        dev = kv_cache.device
        b, blocks = 2, 4
        q = torch.zeros(b, impl.num_heads, impl.head_dim, dtype=dtype, device=dev)
        table = torch.zeros(b, blocks, dtype=torch.int32, device=dev)
        # copied in, not filled by a kernel: the decode kernel reads the lengths before its wait
        lens = torch.tensor([blocks * kv_cache.shape[2]] * b, dtype=torch.int32).to(dev)
        args = (impl.sigma, impl.scale, impl.pool_size, impl.relu_pre)
        prefixes = (None, torch.zeros(1, dtype=torch.int32, device=dev))
        orders = (None, torch.arange(b, dtype=torch.int32).to(dev))   # copied in, as the lengths
        for splits, prefix, order in itertools.product((1, 2), prefixes, orders):
            asynci_decode(q, kv_cache, table, lens, *args, torch.empty_like(q), splits=splits,
                          prefix_len=prefix, order=order, **impl.kv_scales)
        qsl = torch.tensor([0, 1, b], dtype=torch.int32, device=dev)
        warmup_prefill(q, kv_cache, table, qsl, lens, *args, torch.empty_like(q), max_query_len=1,
                       max_seq_len=blocks * kv_cache.shape[2], **impl.kv_scales)

    def init_capture(self, max_batch_size, max_blocks_per_seq, max_seq_len, block_size, device):
        self.graph_max_seq_len, self.graph_block_size = max_seq_len, block_size
        self.graph_inputs = GraphStepInputs(max_batch_size, max_blocks_per_seq, device)
        self.graph_qsl = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)

    def graph_positions(self, batch_size) -> torch.Tensor:
        return self.graph_inputs.positions[:batch_size]

    def prepare_for_capture(self, batch_size) -> TritonAttentionMetadata:
        """Decode-only metadata over the static buffers; the split counts are fixed by the
        longest context a captured graph may meet. Graphs that may hold enough sequences for
        cascade attention always launch its prefix tiles (which exit at once when nothing is
        shared) and sum their partials."""
        bs, g = batch_size, self.graph_inputs
        cascade = bs >= CASCADE_MIN_DECODES
        return TritonAttentionMetadata(
            num_decodes=bs, num_prefills=0, num_decode_tokens=bs, num_actual_tokens=bs,
            max_query_len=1, max_seq_len=0, query_start_loc=self.graph_qsl[: bs + 1],
            seq_lens=g.seq_lens[:bs], block_table=g.block_table[:bs], slot_mapping=g.slot_mapping[:bs],
            max_decode_seq_len=self.graph_max_seq_len, decode_prefix_len=g.prefix_len if cascade else None,
            decode_accumulates=bs <= DECODE_SUMS_MAX_ROWS,
            decode_order=g.decode_order[:bs] if bs >= DECODE_ORDER_MIN_ROWS else None)

    def prepare_for_replay(self, step: StepInputs, batch_size) -> TritonAttentionMetadata:
        md = self.prepare_for_capture(batch_size)
        table = block_table_array(step.block_tables)
        prefix = shared_prefix_len(table, step.seq_lens, step.num_decodes, self.graph_block_size)
        order = None if md.decode_order is None else longest_first(step.seq_lens, batch_size)   # the graph reads it
        self.graph_inputs.send(step, table, prefix, order)
        return replace(md, max_seq_len=max(step.seq_lens))
