"""ReGLU: `relu(gate) * up` over the fused gate_up projection, one pass."""
import torch

from asynct.ops._triton import jit as _jit, cdiv, next_power_of_2, tl, triton


def reglu_ref(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.relu(gate) * up).to(gate_up.dtype)


@_jit(do_not_specialize=["T"])
def _reglu_kernel(x_ptr, out_ptr, T, I, sx, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < T) & (cols[None, :] < I)
    src = x_ptr + rows.to(tl.int64)[:, None] * sx + cols[None, :]
    gate = tl.load(src, mask=mask).to(tl.float32)
    up = tl.load(src + I, mask=mask).to(tl.float32)
    y = tl.maximum(gate, 0.0) * up
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


def reglu_triton(gate_up):
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"reglu needs [T, 2I] with unit column stride, got {tuple(gate_up.shape)}")
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block_c = min(next_power_of_2(i), 1024)
    block_r = max(1, 4096 // block_c)
    grid = (cdiv(t, block_r), cdiv(i, block_c))
    _reglu_kernel[grid](gate_up, out, t, i, gate_up.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
                        num_warps=8)
    return out


def reglu(gate_up):
    if gate_up.is_cuda and triton is not None:
        return reglu_triton(gate_up)
    return reglu_ref(gate_up)
