"""What the backend declares to vLLM's GPU model runner (CUDA graphs, batch reorder), checked on
the builder with a stand-in VllmConfig: no GPU here, so vLLM never asks on its own."""
from types import SimpleNamespace

import pytest
import torch

from vllm_helpers import HAVE_VLLM

if not HAVE_VLLM:
    pytest.skip("vLLM not installed (see scripts/ci_vllm.sh)", allow_module_level=True)

from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402

from asynct.attention import triton_backend  # noqa: E402
from asynct.integrations.vllm.backend import AsyncTAttentionMetadataBuilder  # noqa: E402

MAX_MODEL_LEN, MAX_GRAPH_BATCH = 4096, 8


def vllm_config(head_size=64, mode=CUDAGraphMode.FULL_AND_PIECEWISE, device="cuda"):
    model = SimpleNamespace(get_head_size=lambda: head_size, max_model_len=MAX_MODEL_LEN,
                            get_num_attention_heads=lambda parallel: 4)
    return SimpleNamespace(
        model_config=model, device_config=SimpleNamespace(device=torch.device(device)),
        compilation_config=SimpleNamespace(cudagraph_mode=mode,
                                           max_cudagraph_capture_size=MAX_GRAPH_BATCH),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_GRAPH_BATCH * 2),
        speculative_config=None)


def builder(cfg):
    spec = SimpleNamespace(block_size=16)
    # "cpu" tensors, "cuda" path: build() only slices, and the path is chosen from the config
    return AsyncTAttentionMetadataBuilder(spec, ["l0"], cfg, cfg.device_config.device)


def decode_batch(num_reqs, max_seq_len=40):
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, num_reqs=num_reqs,
        seq_lens=torch.full((num_reqs,), max_seq_len, dtype=torch.int32),
        num_actual_tokens=num_reqs, max_query_len=1, max_seq_len=max_seq_len,
        block_table_tensor=torch.zeros(num_reqs, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(num_reqs, dtype=torch.int64))


def test_kernel_path_declares_decode_graphs_and_reorder():
    cfg = vllm_config()
    support = AsyncTAttentionMetadataBuilder.get_cudagraph_support(cfg, None)
    assert support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    b = builder(cfg)
    assert b.path == "ops" and b.reorder_batch_threshold == 1


def test_graph_batches_size_the_decode_grid_by_max_model_len():
    """The split count is baked into a captured graph: every batch vLLM may replay in one
    (single-token decodes, at most the largest capture size) uses the same bound."""
    b = builder(vllm_config())
    assert b.build(0, decode_batch(MAX_GRAPH_BATCH)).decode_max_seq_len == MAX_MODEL_LEN
    assert b.build(0, decode_batch(MAX_GRAPH_BATCH + 1)).decode_max_seq_len == 40
    eager = builder(vllm_config(mode=CUDAGraphMode.PIECEWISE))  # attention is never captured
    assert eager.build(0, decode_batch(2)).decode_max_seq_len == 40


@pytest.mark.parametrize("head_size,device", [(24, "cuda"), (64, "cpu")])
def test_torch_path_declares_no_graphs(head_size, device):
    cfg = vllm_config(head_size=head_size, device=device)
    assert builder(cfg).path == "torch"
    support = AsyncTAttentionMetadataBuilder.get_cudagraph_support(cfg, None)
    assert support == AttentionCGSupport.NEVER


def test_the_builder_sends_large_decode_batches_longest_first(monkeypatch):
    """The builder's DecodeOrder holds every row a step or a captured graph may have, and build()
    sends the order from vLLM's host upper bounds (the triton path runs on CPU tensors)."""
    monkeypatch.setenv("ASYNCT_VLLM_ATTN", "triton")
    monkeypatch.setattr(triton_backend, "DECODE_ORDER_MIN_ROWS", 4)
    b = builder(vllm_config(device="cpu"))
    assert b.order.max_rows == 2 * MAX_GRAPH_BATCH      # max_num_seqs, past the largest capture
    batch = decode_batch(5)
    batch.seq_lens_cpu_upper_bound = torch.tensor([7, 40, 9, 40, 12], dtype=torch.int32)
    assert b.build(0, batch).decode_order.tolist() == [1, 3, 4, 2, 0]
    small = decode_batch(3)
    small.seq_lens_cpu_upper_bound = torch.tensor([7, 40, 9], dtype=torch.int32)
    assert b.build(0, small).decode_order is None     # below the threshold: batch order
    assert b.order.buffer.tolist() == list(range(2 * MAX_GRAPH_BATCH))    # what a captured graph reads
