"""Attention backends, registered by name: `torch` (any device) and `triton` (CUDA)."""
from asynct.attention.base import (AttentionBackend, AttentionImpl, AttentionMetadata,
                                   AttentionMetadataBuilder, StepInputs, available_backends,
                                   get_backend_cls, register_backend)
from asynct.attention import torch_backend, triton_backend  # noqa: F401  (registration)


def resolve_backend(name: str, device) -> type[AttentionBackend]:
    """`auto` picks the fastest backend the device runs: triton on CUDA, torch elsewhere."""
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "torch"
    return get_backend_cls(name)  # off CUDA, every backend's ops fall back to their references


__all__ = ["AttentionBackend", "AttentionImpl", "AttentionMetadata", "AttentionMetadataBuilder",
           "StepInputs", "available_backends", "get_backend_cls", "register_backend", "resolve_backend"]
