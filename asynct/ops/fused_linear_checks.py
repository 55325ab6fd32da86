"""What the fused linears (fused_linear.py) take, as the reason they cannot (None: they can): the
*_triton functions raise it (`check`), the dispatch functions send such inputs to the unfused ops."""
import torch

from asynct.ops._triton import pow2

SMALL_M = 64    # rows a fused linear takes at most (decode-sized steps; fused_linear.ROW_TILES' largest)


def operands_problem(x, weight, fp32_x=False):
    """fp32_x: x may be fp32 whatever the weights' dtype (a path that takes it: fused_linear)."""
    if x.dim() != 2 or x.stride(-1) != 1 or not 0 < x.shape[0] <= SMALL_M:
        return f"x must be [T <= {SMALL_M}, K] with unit last stride, got {tuple(x.shape)}"
    alike = weight.dtype == x.dtype or (fp32_x and x.dtype == torch.float32)
    if not weight.is_contiguous() or not alike or weight.shape[1] != x.shape[1]:
        return (f"weight must be contiguous [N, {x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} "
                f"{weight.dtype}")
    return None


def head_dim_problem(d, min_d):
    if d < min_d or not pow2(d):
        return f"head_dim must be a power of two >= {min_d}, got {d}"
    return None


def residual_problem(residual, x, weight):
    shape = (x.shape[0], weight.shape[0])
    if (residual is None or residual.shape != shape or not residual.is_contiguous()
            or residual.dtype != weight.dtype):
        return f"residual must be contiguous {shape} {weight.dtype}"
    return None


def cache_problem(kv_cache, slot_mapping, x, num_kv_heads, d):
    t = x.shape[0]
    if (kv_cache.shape[3:] != (num_kv_heads, d) or kv_cache.device != x.device or slot_mapping is None
            or slot_mapping.shape != (t,) or not slot_mapping.is_contiguous()
            or slot_mapping.device != x.device):
        return (f"kv_cache must hold {num_kv_heads} heads of {d} and slot_mapping be a contiguous ({t},), "
                f"both on {x.device}, got {tuple(kv_cache.shape)} and "
                f"{None if slot_mapping is None else tuple(slot_mapping.shape)}")
    return None


def sums_problem(attn_sums, q):
    if attn_sums is not None and (attn_sums.shape != q.shape or attn_sums.dtype != torch.float32
                                  or not attn_sums.is_contiguous()):
        return f"attn_sums must be contiguous fp32 {tuple(q.shape)}, got {tuple(attn_sums.shape)} {attn_sums.dtype}"
    return None


def check(*problems):
    for problem in problems:
        if problem:
            raise ValueError(problem)
