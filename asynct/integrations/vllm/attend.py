"""The compute core of the vLLM backend, without any vLLM import (the GPU benchmark and the tests
run it where vLLM is not installed): per-step metadata from vLLM's `CommonAttentionMetadata`,
and the cache write + AsyncI of one layer.

vLLM 0.32 hands each layer its cache as the logical view `[num_blocks, Hkv, block_size, 2*D]`
in the stride order of the resolved `KVCacheLayout` (key `[..., :D]`, value `[..., D:]`). Its
`[2, num_blocks, block_size, Hkv, D]` view (`as_ops_layout`) has unit stride along D in every
layout, which is all `asynct.ops` asks: the kernels of asynct's own engine read and write vLLM's
cache in place.

Paths (chosen once per process, see `choose_path`):
- "ops": `asynct.ops` dispatch, as asynct's engine calls it (Triton on CUDA, the torch
  references elsewhere). Decodes first (vLLM reorders the batch for us: the builder's
  `reorder_batch_threshold = 1`), one decode launch for them and one prefill launch for the rest.
- "triton": the same with the Triton kernels named explicitly, so that they run on CPU tensors
  under TRITON_INTERPRET=1 (tests and `benchmarks/vllm_backend_gpu.py --smoke`).
- "torch": `paged_torch`, batched gather + matmul; any head size (the kernels want a power of
  two >= 16). The CPU default: faster than the per-sequence references.
"""
import os
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch

from asynct.attention import triton_backend
from asynct.attention.base import copy_from_host
from asynct.attention.graph_inputs import longest_first
from asynct.integrations.vllm import paged_torch
from asynct.ops._triton import pow2
from asynct.ops.asynci_decode import DecodeLaunch, decode_launch
from asynct.ops.asynci_prefill import PrefillLaunch, prefill_launch
from asynct.ops.kv_cache import KVWriteLaunch, write_kv_launch, write_kv_ref_launch

PATHS = ("ops", "triton", "torch")


class Planners(NamedTuple):
    """Per path, what plans a step's K/V write, decode and prefill once for all its layers: each
    returns a layer's launch (the ops' `*_launch` convention)."""
    write: Callable
    decode: Callable | None
    prefill: Callable | None


PLANNERS = {
    "ops": Planners(write_kv_launch, decode_launch, prefill_launch),
    "triton": Planners(KVWriteLaunch, DecodeLaunch, PrefillLaunch),
    "torch": Planners(write_kv_ref_launch, None, None),   # the torch write: any head size
}


def kernels_take_head_size(head_size: int) -> bool:
    return head_size >= 16 and pow2(head_size)


def choose_path(device: torch.device, head_size: int) -> str:
    """ASYNCT_VLLM_ATTN forces a path; else the kernels on CUDA when they take the head size."""
    forced = os.environ.get("ASYNCT_VLLM_ATTN", "").strip().lower()
    if forced:
        if forced not in PATHS:
            raise ValueError(f"ASYNCT_VLLM_ATTN must be one of {PATHS}, got {forced!r}")
        if forced != "torch" and not kernels_take_head_size(head_size):
            raise ValueError(f"ASYNCT_VLLM_ATTN={forced}: the asynct kernels need a head size "
                             f"that is a power of two >= 16, got {head_size}")
        return forced
    if device.type == "cuda" and kernels_take_head_size(head_size):
        return "ops"
    return "torch"


def as_ops_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's `[NB, Hkv, BS, 2*D]` layer view (any stride order) as the `[2, NB, BS, Hkv, D]`
    view that `asynct.ops` takes: the same memory, no copy."""
    nb, hkv, bs, d2 = kv_cache.shape
    return kv_cache.unflatten(-1, (2, d2 // 2)).permute(3, 0, 2, 1, 4)


def num_decodes(query_start_loc_cpu: torch.Tensor, num_reqs: int, max_query_len: int) -> int:
    """Requests before the first one with more than one query token: vLLM's
    `split_decodes_and_prefills(decode_threshold=1)`. A decode left behind a prefill (no
    reorder) is still right: the prefill kernel takes any query length."""
    if max_query_len <= 1:
        return num_reqs  # includes the zero-length padding rows of a CUDA-graph batch
    q_lens = query_start_loc_cpu[1:num_reqs + 1] - query_start_loc_cpu[:num_reqs]
    return int((q_lens > 1).int().argmax())


@dataclass
class AsyncTAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    num_decodes: int               # the first num_decodes requests have one query token each
    max_query_len: int
    max_seq_len: int
    decode_max_seq_len: int        # host bound that sizes the decode grid (fixed under graphs)
    prefill_max_seq_len: int       # host bound of the prefill rows' keys (sizes its key splits)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32
    block_table: torch.Tensor      # [B, max_blocks] int32
    slot_mapping: torch.Tensor     # [T] int64, negative = padding
    path: str
    groups: list | None = None     # paged_torch.plan(), for the "torch" path
    decode_order: torch.Tensor | None = None   # int32 [num_decodes]: DecodeOrder.send
    # the step's launches, planned by its first layer for all (`planned`)
    launches: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def planned(self, key, plan: Callable) -> Callable:
        """The step's launch under `key`, made by `plan()` the first time a layer asks. Every
        layer launches the same rows with tensors shaped alike, so the checks, grids and split
        partials are the step's, and later launches skip Triton's JIT (~45 us a kernel on an
        H100's host; a step's eager attention launched 2-4 a layer)."""
        launch = self.launches.get(key)
        if launch is None:
            launch = self.launches[key] = plan()
        return launch


class DecodeOrder:
    """The decode rows longest first, as asynct's engine takes them from
    `triton_backend.DECODE_ORDER_MIN_ROWS` sequences: the decode kernel then ends a batch of uneven
    lengths on short rows filling the SMs, not on a few long ones alone (H200: the kernel 1.08-1.34x
    at 64-256 rows of 100-2,048 keys). The order lives in one persistent device buffer, which a
    CUDA graph captured with an ordered decode reads at every replay, whatever the step's batch:
    so the buffer always holds a permutation of all its rows (the step's decodes longest first, the
    rest in place), and a step that is not ordered puts it back to the identity."""

    def __init__(self, max_rows: int, device):
        self.max_rows, self.device = max_rows, torch.device(device)
        self.buffer = None      # allocated by the first ordered step, then never moved
        self.ordered = False    # whether the buffer holds anything but the identity

    def send(self, upper_bounds, num_decodes: int) -> torch.Tensor | None:
        """The order of the first `num_decodes` rows by their host upper bounds of the lengths
        (vLLM's `seq_lens_cpu_upper_bound`, CUDA-graph padding rows included), or None."""
        rows = self.max_rows
        if upper_bounds is None or not triton_backend.DECODE_ORDER_MIN_ROWS <= num_decodes <= rows:
            if self.ordered:
                self._write(np.arange(rows, dtype=np.int32))
                self.ordered = False
            return None
        self._write(longest_first(np.asarray(upper_bounds[:num_decodes]), rows))
        self.ordered = True
        return self.buffer[:num_decodes]

    def _write(self, order: np.ndarray):
        if self.buffer is None:
            self.buffer = torch.empty(self.max_rows, dtype=torch.int32, device=self.device)
        copy_from_host(self.buffer, order)


def build_metadata(cm, path: str, block_size: int, num_heads: int,
                   graph_max_seq_len: int | None = None, order: DecodeOrder | None = None) -> AsyncTAttentionMetadata:
    """From vLLM's CommonAttentionMetadata `cm`. Its device tensors are slices of the model
    runner's persistent buffers; the kernel paths keep those slices (no new tensors), so a CUDA
    graph captured over them reads each replay's values. `graph_max_seq_len`, for batches that
    may be replayed in a graph, replaces the step's longest sequence as the decode grid's
    bound: the split count must be the one captured. `order` (the builder's, kernel paths only)
    sends the decode rows' order for this step."""
    n, b = cm.num_actual_tokens, cm.num_reqs
    qsl_cpu = cm.query_start_loc_cpu
    nd = num_decodes(qsl_cpu, b, cm.max_query_len)
    block_table = cm.block_table_tensor[:b]
    seq_lens = cm.seq_lens[:b]
    groups = None
    if path == "torch":
        groups = paged_torch.plan(qsl_cpu[:b + 1], seq_lens, block_table, block_size, num_heads)
    upper = getattr(cm, "seq_lens_cpu_upper_bound", None)    # vLLM's per-row host bounds, where it gives them
    decode_bound, prefill_bound = _subset_bounds(cm, nd, b, upper)
    return AsyncTAttentionMetadata(
        num_actual_tokens=n, num_reqs=b, num_decodes=nd, max_query_len=cm.max_query_len,
        max_seq_len=cm.max_seq_len, prefill_max_seq_len=prefill_bound,
        decode_max_seq_len=graph_max_seq_len if nd == b and graph_max_seq_len else decode_bound,
        query_start_loc=cm.query_start_loc[:b + 1], seq_lens=seq_lens, block_table=block_table,
        slot_mapping=cm.slot_mapping[:n], path=path, groups=groups,
        decode_order=order.send(upper, nd) if order else None)


def _subset_bounds(cm, nd: int, b: int, upper) -> tuple[int, int]:
    """Host bounds of the keys of the decode rows and of the prefill rows. The batch's longest
    sequence bounds both, but a long decode would then make the prefill plan split keys it need
    not (and the reverse): vLLM's per-row host upper bound `upper`, where it gives one, separates them."""
    if upper is None:
        return cm.max_seq_len, cm.max_seq_len
    rows = upper[:b].tolist()
    return max(rows[:nd], default=0) or cm.max_seq_len, max(rows[nd:], default=0) or cm.max_seq_len


@dataclass
class AsyncIParams:
    """A layer's AsyncI constants; `sigma` is the model's Parameter (filled by weight loading)."""
    sigma: torch.Tensor
    scale: float
    pool_size: int
    relu_pre: bool


def forward(query, key, value, kv_cache, m: AsyncTAttentionMetadata, p: AsyncIParams, output,
            write_kv: bool = True):
    """Writes this step's K/V into vLLM's cache (unless the layer shares another's), then AsyncI
    of every query row into `output` [T, Hq, D]."""
    n = m.num_actual_tokens
    paged = as_ops_layout(kv_cache)
    plans = PLANNERS[m.path]
    if write_kv:
        k = key[:n]
        m.planned("write", lambda: plans.write(k, paged, m.slot_mapping))(k, value[:n], paged)
    q, out = query[:n], output[:n]
    if m.path == "torch":
        paged_torch.attend(q, paged, m.groups, p.sigma, p.scale, p.pool_size, p.relu_pre, out)
        return output
    args = (p.sigma, p.scale, p.pool_size, p.relu_pre)
    consts = args[1:]     # a model's layers share them: part of the key all the same
    nd = m.num_decodes
    if nd:  # request i of the decodes is query row i
        decode = m.planned(("decode", *consts), lambda: plans.decode(
            q[:nd], paged, m.block_table[:nd], m.seq_lens[:nd], *args, out[:nd],
            max_seq_len=m.decode_max_seq_len, order=m.decode_order))
        decode(q[:nd], paged, p.sigma, out[:nd])
    if nd < m.num_reqs:
        # query_start_loc[nd:] holds absolute rows of q: no rebased copy per step.
        prefill = m.planned(("prefill", *consts), lambda: plans.prefill(
            q, paged, m.block_table[nd:], m.query_start_loc[nd:], m.seq_lens[nd:], *args, out,
            max_query_len=m.max_query_len, max_seq_len=m.prefill_max_seq_len))
        prefill(q, paged, p.sigma, out)
    return output
