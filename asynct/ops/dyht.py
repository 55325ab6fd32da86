"""DyHT (`weight * clamp(alpha * x, -1, 1)`), alone and fused with the residual add.

The kernels read 3-D strided views ([tokens, heads, head_dim] narrow views of the fused QKV
output) directly: a `.contiguous()` copy costs as much as the op itself."""
import torch

from asynct.ops._triton import jit as _jit, cdiv, next_power_of_2, tl, triton


def output_buffer(out, shape, dtype, device, name="out"):
    """`out` where the caller gave one (a static buffer of a piecewise graph: written in place,
    no copy after), checked; else a fresh tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != torch.device(device) \
            or not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous {tuple(shape)} {dtype} on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def dyht_ref(x, alpha, weight):
    y = weight.float() * (alpha.float() * x.float()).clamp(-1.0, 1.0)
    return y.to(x.dtype).contiguous()


def dyht_add_ref(y, residual, alpha, weight, post_alpha=None, post_weight=None, out=None):
    h = y.float() if post_alpha is None else dyht_ref(y.float(), post_alpha, post_weight)
    hidden = (h if residual is None else h + residual.float()).to(y.dtype)
    if out is not None:
        hidden = output_buffer(out, y.shape, y.dtype, y.device, "out").copy_(hidden)
    return hidden, dyht_ref(hidden, alpha, weight)


def _param_stride(p, c, name):
    if p.numel() not in (1, c):
        raise ValueError(f"{name} must have 1 or {c} elements, got shape {tuple(p.shape)}")
    return 0 if p.numel() == 1 else p.stride(-1)


def _as_3d(x):
    """[..., C] -> a [R, H, C] view with stride(-1) == 1, copying only for >3-D uncollapsible views."""
    if x.stride(-1) != 1:
        raise ValueError("dyht needs stride(-1) == 1")
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.flatten(0, -3)


def _blocks(c):
    block_c = min(next_power_of_2(c), 2048)
    return block_c, max(1, 8192 // block_c)


@_jit(do_not_specialize=["R"])
def _dyht_kernel(x_ptr, out_ptr, alpha_ptr, weight_ptr, R, H, C, sx0, sx1, sa, sw,
                 BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    # 3-D tiles [rows, heads, channels]: no index division, any row and head stride
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None, None]
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)[None, None, :]
    cmask = c < C
    mask = (r < R) & (h < H) & cmask
    x = tl.load(x_ptr + r.to(tl.int64) * sx0 + h * sx1 + c, mask=mask).to(tl.float32)
    a = tl.load(alpha_ptr + c * sa, mask=cmask).to(tl.float32)
    w = tl.load(weight_ptr + c * sw, mask=cmask).to(tl.float32)
    y = w * tl.minimum(tl.maximum(a * x, -1.0), 1.0)
    tl.store(out_ptr + (r.to(tl.int64) * H + h) * C + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def dyht_triton(x, alpha, weight):
    x3 = _as_3d(x)
    r, h, c = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    sa, sw = _param_stride(alpha, c, "alpha"), _param_stride(weight, c, "weight")
    block_c = min(next_power_of_2(c), 1024)
    block_h = min(next_power_of_2(h), max(1, 4096 // block_c))
    block_r = max(1, 8192 // (block_c * block_h))
    grid = (cdiv(r, block_r), cdiv(h, block_h), cdiv(c, block_c))
    _dyht_kernel[grid](x3, out, alpha, weight, r, h, c, x3.stride(0), x3.stride(1), sa, sw,
                       BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_C=block_c, num_warps=8)
    return out


@_jit(do_not_specialize=["T"])
def _dyht_add_kernel(y_ptr, res_ptr, hid_ptr, out_ptr, a_ptr, w_ptr, pa_ptr, pw_ptr, T, C,
                     sa, sw, spa, spw, HAS_RES: tl.constexpr, HAS_POST: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows[:, None] < T) & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    h = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    if HAS_POST:
        pa = tl.load(pa_ptr + cols * spa, mask=cmask).to(tl.float32)
        pw = tl.load(pw_ptr + cols * spw, mask=cmask).to(tl.float32)
        h = pw[None, :] * tl.minimum(tl.maximum(pa[None, :] * h, -1.0), 1.0)
    if HAS_RES:
        h += tl.load(res_ptr + offs, mask=mask).to(tl.float32)
    h = h.to(hid_ptr.dtype.element_ty)
    tl.store(hid_ptr + offs, h, mask=mask)
    # normed is taken from the rounded hidden, exactly as the unfused pair of ops would
    a = tl.load(a_ptr + cols * sa, mask=cmask).to(tl.float32)
    w = tl.load(w_ptr + cols * sw, mask=cmask).to(tl.float32)
    n = w[None, :] * tl.minimum(tl.maximum(a[None, :] * h.to(tl.float32), -1.0), 1.0)
    tl.store(out_ptr + offs, n.to(out_ptr.dtype.element_ty), mask=mask)


def dyht_add_triton(y, residual, alpha, weight, post_alpha=None, post_weight=None, out=None):
    if y.dim() != 2 or not y.is_contiguous():
        raise ValueError(f"dyht_add needs a contiguous [T, C] input, got {tuple(y.shape)}")
    if residual is not None and (residual.shape != y.shape or not residual.is_contiguous()):
        raise ValueError("residual must be contiguous and shaped like y")
    if (post_alpha is None) != (post_weight is None):
        raise ValueError("post_alpha and post_weight go together")
    t, c = y.shape
    hidden, normed = output_buffer(out, y.shape, y.dtype, y.device), torch.empty_like(y)
    if y.numel() == 0:
        return hidden, normed
    has_post = post_alpha is not None
    pa, pw = (post_alpha, post_weight) if has_post else (alpha, weight)
    block_c, block_r = _blocks(c)
    grid = (cdiv(t, block_r), cdiv(c, block_c))
    _dyht_add_kernel[grid](
        y, residual if residual is not None else y, hidden, normed, alpha, weight, pa, pw, t, c,
        _param_stride(alpha, c, "alpha"), _param_stride(weight, c, "weight"),
        _param_stride(pa, c, "post_alpha"), _param_stride(pw, c, "post_weight"),
        HAS_RES=residual is not None, HAS_POST=has_post, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=8)
    return hidden, normed


def _use_triton(x):
    return x.is_cuda and triton is not None


def dyht(x, alpha, weight):
    return dyht_triton(x, alpha, weight) if _use_triton(x) else dyht_ref(x, alpha, weight)


def dyht_add(y, residual, alpha, weight, post_alpha=None, post_weight=None, out=None):
    """(hidden, DyHT(hidden)): hidden = [post DyHT of] y + residual, written into `out` where given
    (contiguous, y's shape; it may be the residual itself: each element is read before it is written)."""
    fn = dyht_add_triton if _use_triton(y) else dyht_add_ref
    return fn(y, residual, alpha, weight, post_alpha, post_weight, out)
