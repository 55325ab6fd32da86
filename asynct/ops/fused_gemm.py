"""gate/up + ReGLU of prefill-sized batches as one GEMM whose epilogue finishes ReGLU: each
program keeps its tile's gate and up accumulators in fp32 and stores relu(gate) * up, so the
2I-wide product is never written to HBM and read back (cuBLAS + the ReGLU kernel: the ReGLU pass
is a quarter of the pair's time at 8K rows). The two accumulators share each activation tile, a
128 x 2*128 tile in effect, fed by TMA loads (Hopper's bulk tensor copies).

H200, bench-0.6b's gate/up (K 1,024, 2 x 3,072 rows), against cuBLAS + the ReGLU kernel
(benchmarks/RESULTS.md): 1.20x at 2,048 rows, 1.21x at 4,096, 1.26x at 8,192; 0.96-1.03x at
512-1,024 and 0.71x at 256, hence FUSED_GEMM_MIN_ROWS. The same epilogue idea for o_proj and
down_proj (+ residual + DyHT) lost to cuBLAS + dyht_add below 8K rows: not built.

Decode-sized batches have their own fused kernels (fused_linear.py)."""
import functools

import torch

from asynct.ops._triton import jit as _jit, tl, triton

FUSED_GEMM_MIN_ROWS = 2048
GROUP_M = 8     # row tiles a group of programs shares its weight tiles over (L2 reuse)
CONFIG = (128, 128, 64, 8, 3)   # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: 144 KB of shared memory
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:     # a Triton without host-side TMA descriptors: the unfused ops serve
    TensorDescriptor = None


@_jit(do_not_specialize=["M"])
def _gemm_reglu_kernel(x_desc, g_desc, u_desc, out_desc, M, N, K, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr):
    """out[M, N] = relu(x @ gate.T) * (x @ up.T); the descriptors zero-fill and clip past the
    tensors' edges, so M, N and K need not be tile multiples."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    off_m = (first_m + (pid % width) % size_m) * BLOCK_M
    off_n = ((pid % width) // size_m) * BLOCK_N
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([off_m, k])
        acc_g = tl.dot(x, g_desc.load([off_n, k]).T, acc_g, input_precision=PREC)
        acc_u = tl.dot(x, u_desc.load([off_n, k]).T, acc_u, input_precision=PREC)
    out_desc.store([off_m, off_n], (tl.maximum(acc_g, 0.0) * acc_u).to(out_desc.dtype))


@functools.lru_cache(maxsize=None)
def _has_tma(device_index) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def gemm_reglu_supported(x, weight) -> bool:
    """Hopper or newer, 16-bit operands the descriptors can address (16-byte aligned rows)."""
    return (TensorDescriptor is not None and x.is_cuda and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.is_contiguous() and weight.shape[0] % 2 == 0 and x.stride(1) == 1
            and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and x.shape[1] % 8 == 0
            and _has_tma(x.device.index or 0))


def gemm_reglu(x, weight, config=CONFIG):
    """relu(x @ gate.T) * (x @ up.T) of the fused gate_up weight [2I, K] = [gate; up]."""
    bm, bn, bk, warps, stages = config
    (m, k), i = x.shape, weight.shape[0] // 2
    if weight.shape[1] != k:
        raise ValueError(f"gate_up weight {tuple(weight.shape)} does not take x of {k} columns")
    out = torch.empty(m, i, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    descs = [TensorDescriptor.from_tensor(t, block) for t, block in
             ((x, [bm, bk]), (weight[:i], [bn, bk]), (weight[i:], [bn, bk]), (out, [bm, bn]))]
    _gemm_reglu_kernel[(triton.cdiv(m, bm) * triton.cdiv(i, bn),)](
        *descs, m, i, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return out


def warmup_gemm_reglu(weight):
    """Compiles the kernel where it would serve (its row count is not specialised: one row does)."""
    x = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    if gemm_reglu_supported(x, weight):
        gemm_reglu(x, weight)
