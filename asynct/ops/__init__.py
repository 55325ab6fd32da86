"""Fused ops: each has a plain-torch `*_ref`, Triton (and for decode, CUDA) kernels, and a
dispatch function that runs the kernel on CUDA tensors and the reference elsewhere."""
import importlib.util
import warnings

import torch

from asynct.ops.argmax import argmax, argmax_ref, argmax_triton
from asynct.ops.asynci_decode import asynci_decode, asynci_decode_triton
from asynct.ops.asynci_prefill import asynci_prefill, asynci_prefill_triton
from asynct.ops.dyht import dyht, dyht_add, dyht_add_ref, dyht_add_triton, dyht_ref, dyht_triton
from asynct.ops.fused_linear import (GEMV_MAX_ROWS, ROW_TILES, SMALL_M, linear_dyht_add, linear_dyht_add_unfused,
                                      linear_dyht_add_triton, linear_qk_norm_rope,
                                      linear_qk_norm_rope_unfused, linear_qk_norm_rope_triton,
                                      linear_reglu, linear_reglu_unfused, linear_reglu_triton)
from asynct.ops.kv_cache import write_kv_cache, write_kv_cache_ref, write_kv_cache_triton
from asynct.ops.paged_ref import asynci_decode_ref, asynci_prefill_ref
from asynct.ops.reglu import reglu, reglu_ref, reglu_triton
from asynct.ops.rope import (qk_norm_rope, qk_norm_rope_ref, qk_norm_rope_to_cache, qk_norm_rope_to_cache_triton,
                             qk_norm_rope_triton, rope,
                             rope_cos_sin_cache, rope_ref, rope_triton)

if torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
    warnings.warn("triton is not installed: asynct.ops runs its slow torch references on CUDA")

__all__ = [
    "argmax", "argmax_ref", "argmax_triton",
    "asynci_decode", "asynci_decode_ref", "asynci_decode_triton",
    "asynci_prefill", "asynci_prefill_ref", "asynci_prefill_triton",
    "dyht", "dyht_add", "dyht_add_ref", "dyht_add_triton", "dyht_ref", "dyht_triton",
    "GEMV_MAX_ROWS", "ROW_TILES", "SMALL_M", "linear_dyht_add", "linear_dyht_add_unfused", "linear_dyht_add_triton",
    "linear_qk_norm_rope", "linear_qk_norm_rope_unfused", "linear_qk_norm_rope_triton",
    "linear_reglu", "linear_reglu_unfused", "linear_reglu_triton",
    "qk_norm_rope", "qk_norm_rope_ref", "qk_norm_rope_to_cache", "qk_norm_rope_to_cache_triton",
    "qk_norm_rope_triton",
    "reglu", "reglu_ref", "reglu_triton",
    "rope", "rope_cos_sin_cache", "rope_ref", "rope_triton",
    "write_kv_cache", "write_kv_cache_ref", "write_kv_cache_triton",
]


def asynci_decode_cuda(*args, **kwargs):
    """The CUDA decode kernel (builds the extension on first call)."""
    from asynct.ops.cuda_ext import asynci_decode_cuda as fn
    return fn(*args, **kwargs)
