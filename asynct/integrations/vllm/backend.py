"""AsyncI as a vLLM v1 attention backend (softmax-free: vLLM's own backends cannot run it).

The model passes this backend explicitly to `Attention(attn_backend=...)`; vLLM's CPU platform
would otherwise always choose its softmax `CPU_ATTN`. The builder derives everything once per
step; `forward` writes the step's K/V into the cache, then runs AsyncI.

Two compute paths, chosen once per process:
- "ops": the shared `asynct.ops.asynci_prefill` / `asynci_decode` (Triton on CUDA, torch
  references on CPU) on a strided `[2, NB, BS, Hkv, D]` view of vLLM's cache. Used when
  `asynct.ops` exports them and accepts the view (the CUDA kernels currently want it contiguous,
  which vLLM's cache never is, so CUDA falls back to "torch").
- "torch": `paged_torch`, a batched gather + matmul path that takes any head size and layout.
Set ASYNCT_VLLM_ATTN=torch or =ops to force one.
"""
import os
from collections import Counter
from dataclasses import dataclass

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from asynct.integrations.vllm import BACKEND_NAME, paged_torch

# Under "vllm." so vLLM's logging config prints it.
logger = init_logger("vllm.asynct.backend")

# Proof that this backend (not vLLM's) ran: builds, forwards, tokens, per path.
STATS: Counter = Counter()


def shared_ops():
    """The asynct.ops paged kernels, or None while they are not exported."""
    try:
        import asynct.ops as ops
    except ImportError:
        return None
    names = ("asynci_prefill", "asynci_decode")
    return ops if all(callable(getattr(ops, n, None)) for n in names) else None


def choose_path(device: torch.device) -> str:
    forced = os.environ.get("ASYNCT_VLLM_ATTN", "").strip().lower()
    if forced in ("torch", "ops"):
        if forced == "ops" and shared_ops() is None:
            raise RuntimeError("ASYNCT_VLLM_ATTN=ops but asynct.ops has no asynci_prefill/decode")
        return forced
    if forced:
        raise ValueError(f"ASYNCT_VLLM_ATTN must be 'torch' or 'ops', got {forced!r}")
    # The CUDA kernels need a contiguous [2, NB, BS, Hkv, D] cache; vLLM's is block-major.
    return "ops" if shared_ops() is not None and device.type != "cuda" else "torch"


class AsyncTAttentionBackend(AttentionBackend):
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update = True  # forward() writes K/V itself

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return AsyncTAttentionImpl

    @staticmethod
    def get_builder_cls():
        return AsyncTAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]  # any block size: the cache is read by indexing

    @classmethod
    def supported_kv_cache_layouts(cls):
        return None  # any stride order: see paged_torch


@dataclass
class AsyncTAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32
    block_table: torch.Tensor      # [B, max_blocks] int32
    slot_mapping: torch.Tensor     # [T] int64
    has_padding_slots: bool        # any slot < 0 (rows the cache write must skip)
    path: str
    groups: list | None = None     # paged_torch.plan(), for the "torch" path


class AsyncTAttentionMetadataBuilder(AttentionMetadataBuilder[AsyncTAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.num_heads = vllm_config.model_config.get_num_attention_heads(
            vllm_config.parallel_config)
        self.path = choose_path(torch.device(device))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AsyncTAttentionMetadata:
        cm = common_attn_metadata
        n = cm.num_actual_tokens
        seq_lens = cm.seq_lens[:cm.num_reqs]
        qsl = cm.query_start_loc[:cm.num_reqs + 1]
        block_table = cm.block_table_tensor[:cm.num_reqs]
        slots = cm.slot_mapping[:n]
        groups = None
        if self.path == "torch":
            groups = paged_torch.plan(cm.query_start_loc_cpu[:cm.num_reqs + 1], seq_lens,
                                      block_table, self.block_size, self.num_heads)
        STATS["builds"] += 1
        return AsyncTAttentionMetadata(
            num_actual_tokens=n, max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
            query_start_loc=qsl, seq_lens=seq_lens, block_table=block_table,
            slot_mapping=slots, has_padding_slots=bool((slots < 0).any()), path=self.path,
            groups=groups)


class AsyncTAttentionImpl(AttentionImpl[AsyncTAttentionMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, *,
                 sigma=None, pool_size=3, relu_pre=True):
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap}
        bad = [k for k, v in unsupported.items() if v is not None]
        if bad or attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"AsyncT attention does not support {bad or attn_type}")
        if kv_cache_dtype not in AsyncTAttentionBackend.supported_kv_cache_dtypes:
            raise NotImplementedError(f"AsyncT attention: kv_cache_dtype {kv_cache_dtype!r}")
        if sigma is None:
            raise ValueError("AsyncT attention needs the layer's per-head `sigma` parameter")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sigma = sigma  # the model's Parameter: weight loading fills it in place
        self.pool_size, self.relu_pre = int(pool_size), bool(relu_pre)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("AsyncT attention has no fused output quantization")
        if attn_metadata is None:  # profiling / warm-up run: nothing cached, nothing to do
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        if self.kv_sharing_target_layer_name is None:
            paged_torch.write_kv(key[:n], value[:n], kv_cache, m.slot_mapping,
                                 m.has_padding_slots)
        q, out = query[:n], output[:n]
        if m.path == "ops":
            self._ops_attend(q, kv_cache, m, out)
        else:
            paged_torch.attend(q, kv_cache, m.groups, self.sigma, self.scale, self.pool_size,
                               self.relu_pre, out)
        self._count(m, n)
        return output

    def _ops_attend(self, q, kv_cache, m, out):
        ops, paged = shared_ops(), paged_torch.as_ops_layout(kv_cache)
        args = (self.sigma, self.scale, self.pool_size, self.relu_pre, out)
        if m.max_query_len == 1:  # pure decode step: one query per sequence
            ops.asynci_decode(q, paged, m.block_table, m.seq_lens, *args,
                              max_seq_len=m.max_seq_len)
        else:
            ops.asynci_prefill(q, paged, m.block_table, m.query_start_loc, m.seq_lens, *args,
                               max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)

    @staticmethod
    def _count(m, n):
        if not STATS["forwards"]:
            logger.info("AsyncT attention backend ran its first forward (path=%s)", m.path)
        STATS["forwards"] += 1
        STATS[f"forwards_{m.path}"] += 1
        STATS["tokens"] += n
