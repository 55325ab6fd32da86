"""The attention-backend interface (vLLM's shape): backend, per-step metadata, builder, impl.

The builder runs once per step, outside any CUDA graph; its immutable metadata is shared by every
layer. Decodes come first in a batch, so `[:num_decode_tokens]` is the decode subset everywhere.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from asynct.ops import write_kv_cache


@dataclass(frozen=True)
class AttentionMetadata:
    num_decodes: int                  # sequences with one query token, first in the batch
    num_prefills: int                 # sequences with a prefill chunk, after the decodes
    num_decode_tokens: int
    num_actual_tokens: int            # real tokens; input buffers may be padded past this
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor     # [B + 1] int32, into the step's tokens
    seq_lens: torch.Tensor            # [B] int32: keys after this step (cached + this step's)
    block_table: torch.Tensor         # [B, max_blocks] int32
    slot_mapping: torch.Tensor        # [num_tokens] int64, -1 for padding tokens
    query_start_loc_cpu: tuple = ()   # host copies, for builders that plan on the CPU
    seq_lens_cpu: tuple = ()

    @property
    def num_reqs(self) -> int:
        return self.num_decodes + self.num_prefills

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_actual_tokens - self.num_decode_tokens


@dataclass
class StepInputs:
    """What the model runner knows about a step, on the host, before any tensor is built."""
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]] | np.ndarray   # the engine's: block_table_array's already
    slot_mapping: list[int] | np.ndarray
    num_decodes: int


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def host_to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list/array on `device` without waiting for the device: a plain copy to CUDA
    synchronises the stream, which would stall the host behind the step in flight. Pinned
    blocks come from torch's caching host allocator, which reuses one only after its copy ran."""
    a = data if isinstance(data, np.ndarray) else np.asarray(data, dtype=_NUMPY[dtype])
    if device.type != "cuda":
        return torch.from_numpy(a).to(device)
    return pinned(a).to(device, non_blocking=True)


def copy_from_host(dst: torch.Tensor, data: np.ndarray):
    """host_to_device into an existing tensor (a graph's static buffer), without waiting."""
    dst.copy_(pinned(data) if dst.is_cuda else torch.from_numpy(data), non_blocking=True)


def pinned(data: np.ndarray) -> torch.Tensor:
    """A pinned copy of `data`, copied by numpy on this thread. Tensor.pin_memory() copies with
    torch's intra-op threads past 32K elements (a 256-row block table), and those threads then
    spin-wait for the next such copy: in a server's engine process on an H200 host, 15 threads
    at 0.6 of a core each, taking cores from the API process and its clients."""
    out = torch.empty(data.shape, dtype=torch.from_numpy(data).dtype, pin_memory=True)
    out.numpy()[...] = data
    return out


def host_to_device_many(parts, device: torch.device) -> list[torch.Tensor]:
    """[(data, dtype), ...] -> tensors on `device`, from one host-to-device copy: each copy is a
    memcpy on the stream, between the step before and this one (H200, a batch-1 decode step: 8
    copies took 23 of its 858 us). Views of one byte buffer, each part 16-byte aligned: Triton
    specialises a pointer on its 16-byte alignment, and an 8-aligned view compiled new kernel
    variants in the middle of a run. The parts come back from one split, 1-D ones without a
    reshape: a slice and two views a part cost 2.5x the host time (six parts, CPU: 42-74 against
    25-30 us); a penalised step runs it two to four times."""
    arrays = [np.ascontiguousarray(np.asarray(data, dtype=_NUMPY[dtype])) for data, dtype in parts]
    sizes = []                               # each part's bytes, then its padding to 16
    for a in arrays:
        sizes += [a.nbytes, -a.nbytes % 16]
    buf = np.zeros(max(sum(sizes), 16), dtype=np.uint8)
    offset = 0
    for a, pad in zip(arrays, sizes[1::2]):
        buf[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        offset += a.nbytes + pad
    pieces = host_to_device(buf, torch.uint8, device).split(sizes + [buf.nbytes - offset])
    return [p.view(dtype) if a.ndim == 1 else p.view(dtype).view(a.shape)
            for p, a, (_, dtype) in zip(pieces[::2], arrays, parts)]


def block_table_array(tables: list[list[int]] | np.ndarray) -> np.ndarray:
    """Ragged block tables -> a zero-padded int32 array (row copies, not a list of lists)."""
    if isinstance(tables, np.ndarray):
        return tables
    out = np.zeros((len(tables), max(map(len, tables), default=1) or 1), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


class AttentionMetadataBuilder(ABC):
    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device

    def common(self, step: StepInputs, table: np.ndarray | None = None) -> dict:
        """The fields every backend needs, sent to the device in one copy."""
        qsl = [0]
        for n in step.query_lens:
            qsl.append(qsl[-1] + n)
        table = block_table_array(step.block_tables) if table is None else table
        starts, lens, table, slots = host_to_device_many(
            [(qsl, torch.int32), (step.seq_lens, torch.int32), (table, torch.int32),
             (step.slot_mapping, torch.int64)], self.device)
        return dict(
            num_decodes=step.num_decodes, num_prefills=len(step.query_lens) - step.num_decodes,
            num_decode_tokens=step.num_decodes, num_actual_tokens=qsl[-1],
            max_query_len=max(step.query_lens, default=0), max_seq_len=max(step.seq_lens, default=0),
            query_start_loc=starts, seq_lens=lens, block_table=table, slot_mapping=slots,
            query_start_loc_cpu=tuple(qsl), seq_lens_cpu=tuple(step.seq_lens))

    @abstractmethod
    def build(self, step: StepInputs) -> AttentionMetadata:
        ...


class AttentionImpl(ABC):
    """One per attention layer: holds the layer's constants, its per-head sigma and, for an FP8
    cache, its static dequantisation scales (fp32 [Hkv, D], set after the weights load)."""

    def __init__(self, num_heads, head_dim, num_kv_heads, scale, sigma, pool_size, relu_pre):
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.sigma, self.pool_size, self.relu_pre = scale, sigma, pool_size, relu_pre
        self.k_scale = self.v_scale = None

    @property
    def kv_scales(self) -> dict:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def store_kv(self, k, v, kv_cache, metadata: AttentionMetadata):
        """This step's k/v into the cache, unless the fused QKV projection stored them (None)."""
        if k is not None:
            write_kv_cache(k, v, kv_cache, metadata.slot_mapping, **self.kv_scales)

    def accumulates(self, metadata: AttentionMetadata) -> bool:
        """Whether this step's attention adds into an fp32 output that the model zeroed
        (the fused QKV projection does, Attention.attn_sums), not one of q's dtype."""
        return False

    @abstractmethod
    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, output):
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens; writes k/v into `kv_cache`
        ([2, num_blocks, block_size, Hkv, D]) and the attention of every query into `output`
        (adds it, where `accumulates`).
        k and v None: the step's keys and values are in the cache already (the fused QKV
        projection stored them)."""


class AttentionBackend(ABC):
    name: str = ""
    supports_cuda_graphs = False

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    @abstractmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        ...

    @classmethod
    @abstractmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        ...

    def warmup(self, impl: AttentionImpl, kv_cache: torch.Tensor, dtype: torch.dtype):
        """Compiles, at start-up, every kernel variant a step can reach beyond what a plain
        forward exercises (so that nothing compiles while serving)."""

    # CUDA-graph hooks: the backend owns the static buffers that decode graphs read, the
    # tokens' positions among them (a decode token's is its sequence's length less one).
    def init_capture(self, max_batch_size: int, max_blocks_per_seq: int, max_seq_len: int, block_size: int,
                     device):
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def graph_positions(self, batch_size: int) -> torch.Tensor:
        raise NotImplementedError

    def prepare_for_capture(self, batch_size: int) -> AttentionMetadata:
        raise NotImplementedError

    def prepare_for_replay(self, step: StepInputs, batch_size: int) -> AttentionMetadata:
        """Sends a decode-only step's host inputs to the static buffers; its metadata over them."""
        raise NotImplementedError


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def get_backend_cls(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def available_backends() -> list[str]:
    return sorted(_BACKENDS)
