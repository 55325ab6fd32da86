"""The one torch CUDA extension (csrc/), built on first use into a persistent cache, and the
choice between its decode kernel and the Triton one.

Where nvcc is missing or the build fails, one warning is raised and Triton serves instead."""
import functools
import hashlib
import importlib
import os
import warnings
from pathlib import Path

import torch

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("asynci_decode.cu", "bindings.cpp")


def _arch_flags():
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")  # sm_90a on Hopper
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


@functools.lru_cache(maxsize=None)
def load_extension():
    """The compiled module, or None (after one warning) where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load
        flags = _arch_flags()
        digest = hashlib.sha1(" ".join(flags + [torch.__version__]).encode())
        for name in _SOURCES + ("asynci_decode.h",):
            digest.update((_CSRC / name).read_bytes())
        tag = digest.hexdigest()[:16]
        build_dir = Path(os.path.expanduser("~/.cache/asynct/torch_ext")) / tag
        build_dir.mkdir(parents=True, exist_ok=True)
        return load(name=f"asynct_ext_{tag}", sources=[str(_CSRC / s) for s in _SOURCES],
                    build_directory=str(build_dir), extra_cflags=["-O3", "-std=c++17"],
                    extra_cuda_cflags=["-O3", "-std=c++17"] + flags, verbose=False)
    except Exception as e:  # no nvcc, no compiler, a failed build: Triton still works
        warnings.warn(f"asynct CUDA extension unavailable, using Triton kernels: {e}")
        return None


def cuda_decode_supported(q, kv_cache, pool_size=3):
    g = q.shape[1] // kv_cache.shape[3]
    return (q.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q.dtype
            and kv_cache.is_contiguous()
            and q.shape[2] in (64, 128) and g in (1, 2, 4, 8) and 1 <= pool_size <= 64
            and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and q.data_ptr() % 16 == 0)


def asynci_decode_cuda(q, kv_cache, block_table, seq_lens, sigma, scale, pool_size, relu_pre, out,
                       max_seq_len=None, splits=None):
    from asynct.ops.asynci_common import sm_count
    from asynct.ops.asynci_decode import check_decode_args, num_splits
    check_decode_args(q, kv_cache, block_table, seq_lens, sigma, out)
    if splits is None:
        hint = max_seq_len or block_table.shape[1] * kv_cache.shape[2]
        splits = num_splits(q.shape[0], kv_cache.shape[3], hint, sm_count(q))
    load_extension().asynci_decode_cuda(q, kv_cache, block_table, seq_lens,
                                        sigma.float().contiguous(), float(scale), int(pool_size),
                                        bool(relu_pre), out, int(splits))
    return out


def pick_decode(q, kv_cache, pool_size=3):
    """The decode kernel for this shape: CUDA where it is supported and was measured faster
    (benchmarks/RESULTS.md, Kernels), else Triton; the reference where neither can run."""
    from asynct.ops._triton import triton
    dec = importlib.import_module("asynct.ops.asynci_decode")  # the module, not the function
    if triton is None:
        if cuda_decode_supported(q, kv_cache, pool_size) and load_extension() is not None:
            return asynci_decode_cuda
        warnings.warn("triton is missing: AsyncI decode falls back to the slow reference")
        return dec.asynci_decode_ref
    if CUDA_DEFAULT and cuda_decode_supported(q, kv_cache, pool_size) and load_extension():
        return asynci_decode_cuda
    return dec.asynci_decode_triton


# Triton's decode measured faster than this CUDA kernel at every benchmarked shape on the H200
# (benchmarks/RESULTS.md, Kernels), so the dispatch uses CUDA only where Triton is missing.
CUDA_DEFAULT = False
