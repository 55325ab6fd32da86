"""AsyncI as a vLLM v1 attention backend (softmax-free: vLLM's own backends cannot run it).

The model passes this backend explicitly to `Attention(attn_backend=...)`; vLLM's CPU platform
would otherwise always choose its softmax `CPU_ATTN`. This module is vLLM's interface only; the
compute is `attend` (no vLLM import): on CUDA the same `asynct.ops` kernels as asynct's engine,
reading vLLM's cache in place; on the CPU a batched PyTorch path. ASYNCT_VLLM_ATTN=ops|triton|torch
forces one.

CUDA graphs: FULL graphs of single-token decode batches (vLLM's FULL_DECODE_ONLY, or the decode
half of FULL_AND_PIECEWISE). The metadata keeps the runner's persistent buffers, and the decode
grid of a graph-eligible batch is sized by max_model_len, as asynct's own graphs are.
"""
from collections import Counter
from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from asynct.integrations.vllm import BACKEND_NAME, attend
from asynct.integrations.vllm.attend import AsyncTAttentionMetadata

# Under "vllm." so vLLM's logging config prints it.
logger = init_logger("vllm.asynct.backend")

# Proof that this backend (not vLLM's) ran: builds, forwards, tokens, per path. Eager steps
# only: a replayed CUDA graph runs no Python.
STATS: Counter = Counter()


def _path(vllm_config, device) -> str:
    return attend.choose_path(torch.device(device), vllm_config.model_config.get_head_size())


def _full_decode_graphs(vllm_config) -> bool:
    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode.decode_mode().name == "FULL"


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
        return None  # any KVCacheLayout: every one keeps D contiguous, all attend.py needs


class AsyncTAttentionMetadataBuilder(AttentionMetadataBuilder[AsyncTAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first: vLLM reorders the batch so that [:num_decodes] is the decode subset.
        self._init_reorder_batch_threshold(1)
        self.block_size = kv_cache_spec.block_size
        self.num_heads = vllm_config.model_config.get_num_attention_heads(
            vllm_config.parallel_config)
        self.path = _path(vllm_config, device)
        self.graph_max_seq_len, self.graph_max_reqs = None, 0
        if self.path != "torch" and _full_decode_graphs(vllm_config):
            self.graph_max_seq_len = vllm_config.model_config.max_model_len
            self.graph_max_reqs = vllm_config.compilation_config.max_cudagraph_capture_size or 0
        # rows a step (or a graph's padded batch) may have: the order buffer holds them all
        max_rows = max(vllm_config.scheduler_config.max_num_seqs, self.graph_max_reqs)
        self.order = attend.DecodeOrder(max_rows, device) if self.path != "torch" else None

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # The torch path plans index tensors on the host each step: no graphs.
        device = vllm_config.device_config.device
        if _path(vllm_config, device) == "torch":
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AsyncTAttentionMetadata:
        cm = common_attn_metadata
        graphable = cm.max_query_len <= 1 and cm.num_reqs <= self.graph_max_reqs
        STATS["builds"] += 1
        return attend.build_metadata(cm, self.path, self.block_size, self.num_heads,
                                     self.graph_max_seq_len if graphable else None, self.order)


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
        self.params = attend.AsyncIParams(sigma, float(scale), int(pool_size), bool(relu_pre))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("AsyncT attention has no fused output quantization")
        if attn_metadata is None:  # profiling / warm-up run: nothing cached, nothing to do
            return output
        attend.forward(query, key, value, kv_cache, attn_metadata, self.params, output,
                       write_kv=self.kv_sharing_target_layer_name is None)
        self._count(attn_metadata)
        return output

    @staticmethod
    def _count(m: AsyncTAttentionMetadata):
        if not STATS["forwards"]:
            logger.info("AsyncT attention backend ran its first forward (path=%s)", m.path)
        STATS["forwards"] += 1
        STATS[f"forwards_{m.path}"] += 1
        STATS["tokens"] += m.num_actual_tokens
