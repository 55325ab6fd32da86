"""NeoX ("rotate_half") RoPE over the whole head, alone and fused after the q/k DyHT norm.

The fused kernel reads q and k straight from their strided views of the QKV output, applies
DyHT per head vector and rotates in fp32: one read and one write per element. Given the paged
cache, it stores k and v there itself (`qk_norm_rope_to_cache`): past the fused linears' rows
(decode graphs of 65+ sequences, prefill pieces) the KV write is then no kernel of its own."""
import torch

from asynct.ops._triton import jit as _jit, cdiv, next_power_of_2, pow2, tl, triton
from asynct.ops.dyht import output_buffer
from asynct.ops.kv_cache import check_kv_write, is_fp8, store_cache_rows, write_kv_cache


def rope_cos_sin_cache(head_dim, max_positions, theta=10000.0, device=None):
    """[max_positions, head_dim] fp32: cos in the first half, sin in the second."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float().to(device)


def _rotate_f32(x, positions, cos_sin_cache):
    half = x.shape[-1] // 2
    cs = cos_sin_cache[positions].float()[:, None, :]
    cos, sin = cs[..., :half], cs[..., half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_ref(x, positions, cos_sin_cache):
    return _rotate_f32(x.float(), positions, cos_sin_cache).to(x.dtype).contiguous()


def qk_norm_rope_ref(q, k, positions, q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache):
    def one(x, a, w):
        n = w.float() * (a.float() * x.float()).clamp(-1.0, 1.0)
        return _rotate_f32(n, positions, cos_sin_cache).to(x.dtype).contiguous()
    return one(q, q_alpha, q_weight), one(k, k_alpha, k_weight)


@_jit
def _norm_rope_heads(x_ptr, out_ptr, t0, T, pos_ptr, cs_ptr, sx0, sx1, a_ptr, w_ptr, sa, sw, H,
                     c_ptr, cs_scale_ptr, slot_ptr, s_blk, s_tok, s_head,
                     HALF: tl.constexpr, H_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                     HAS_NORM: tl.constexpr, TO_CACHE: tl.constexpr, BS: tl.constexpr, FP8: tl.constexpr):
    # [tokens, heads, half] tiles; one cos/sin row per token serves all its heads
    t = t0 + tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, H_PAD)[None, :, None]
    d = tl.arange(0, HALF)[None, None, :]
    tmask = t < T
    mask = tmask & (h < H)
    src = x_ptr + t.to(tl.int64) * sx0 + h * sx1 + d
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    if HAS_NORM:
        x1 = tl.load(w_ptr + d * sw) * tl.minimum(tl.maximum(tl.load(a_ptr + d * sa) * x1, -1.0), 1.0)
        x2 = tl.load(w_ptr + (d + HALF) * sw) * tl.minimum(
            tl.maximum(tl.load(a_ptr + (d + HALF) * sa) * x2, -1.0), 1.0)
    pos = tl.load(pos_ptr + t, mask=tmask, other=0)
    cs = cs_ptr + pos * (2 * HALF) + d
    cos = tl.load(cs, mask=tmask)
    sin = tl.load(cs + HALF, mask=tmask)
    ty = x_ptr.dtype.element_ty     # the cache gets k rounded as the unfused path stored it
    r1, r2 = (x1 * cos - x2 * sin).to(ty), (x2 * cos + x1 * sin).to(ty)
    if TO_CACHE:
        slot = tl.load(slot_ptr + t, mask=tmask, other=-1)
        keep = mask & (slot >= 0)     # negative slots: CUDA-graph padding
        store_cache_rows(c_ptr, cs_scale_ptr, slot, h, d, r1, keep, h < H, s_blk, s_tok, s_head, BS, 2 * HALF, FP8)
        store_cache_rows(c_ptr, cs_scale_ptr, slot, h, d + HALF, r2, keep, h < H, s_blk, s_tok, s_head, BS,
                         2 * HALF, FP8)
    else:
        dst = out_ptr + (t.to(tl.int64) * H + h) * (2 * HALF) + d
        tl.store(dst, r1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, r2.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _heads_to_cache(v_ptr, t0, T, sv0, sv1, H, c_ptr, scale_ptr, slot_ptr, s_blk, s_tok, s_head,
                    D: tl.constexpr, H_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BS: tl.constexpr,
                    FP8: tl.constexpr):
    t = t0 + tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, H_PAD)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1)
    keep = (h < H) & (slot >= 0)
    x = tl.load(v_ptr + t.to(tl.int64) * sv0 + h * sv1 + d, mask=keep)
    store_cache_rows(c_ptr, scale_ptr, slot, h, d, x, keep, h < H, s_blk, s_tok, s_head, BS, D, FP8)


@_jit(do_not_specialize=["T"])
def _qk_rope_kernel(q_ptr, qo_ptr, k_ptr, ko_ptr, v_ptr, pos_ptr, cs_ptr, T, sq0, sq1, sk0, sk1, sv0, sv1,
                    qa_ptr, qw_ptr, ka_ptr, kw_ptr, sqa, sqw, ska, skw, HQ, HK,
                    kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, s_blk, s_tok, s_head,
                    HALF: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
                    BLOCK_T: tl.constexpr, HAS_NORM: tl.constexpr, TO_CACHE: tl.constexpr,
                    BS: tl.constexpr, FP8: tl.constexpr):
    """Grid (token tiles, 2 or 3): q; k (into ko, or with TO_CACHE the cache's K); v into the
    cache's V (TO_CACHE only)."""
    t0 = tl.program_id(0) * BLOCK_T
    which = tl.program_id(1)
    if which == 0:
        _norm_rope_heads(q_ptr, qo_ptr, t0, T, pos_ptr, cs_ptr, sq0, sq1, qa_ptr, qw_ptr, sqa, sqw, HQ,
                         kc_ptr, ks_ptr, slot_ptr, s_blk, s_tok, s_head, HALF, HQ_PAD, BLOCK_T, HAS_NORM,
                         False, BS, FP8)
    elif which == 1:
        _norm_rope_heads(k_ptr, ko_ptr, t0, T, pos_ptr, cs_ptr, sk0, sk1, ka_ptr, kw_ptr, ska, skw, HK,
                         kc_ptr, ks_ptr, slot_ptr, s_blk, s_tok, s_head, HALF, HK_PAD, BLOCK_T, HAS_NORM,
                         TO_CACHE, BS, FP8)
    else:
        _heads_to_cache(v_ptr, t0, T, sv0, sv1, HK, vc_ptr, vs_ptr, slot_ptr, s_blk, s_tok, s_head,
                        2 * HALF, HK_PAD, BLOCK_T, BS, FP8)


def _check(x, name):
    if x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] % 2:
        raise ValueError(f"{name} must be [T, H, D] with unit last stride and even D, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    if not pow2(x.shape[-1]):
        raise ValueError(f"{name}: head_dim must be a power of two, got {x.shape[-1]}")


def _pstride(p, d, name):
    if p.numel() not in (1, d):
        raise ValueError(f"{name} must have 1 or {d} elements, got {tuple(p.shape)}")
    return 0 if p.numel() == 1 else 1


def _launch(q, k, positions, cos_sin_cache, params, has_norm, pairs=2, out=(None, None), target=None):
    """`target` (v, kv_cache, slot_mapping, k_scale, v_scale): k and v go to the cache, not ko."""
    _check(q, "q")
    _check(k, "k")
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or positions.shape != (t,):
        raise ValueError("q, k and positions must agree on T and head_dim")
    if cos_sin_cache.shape[-1] != d or cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache must be fp32 [max_positions, head_dim]")
    qo = output_buffer(out[0], q.shape, q.dtype, q.device, "q out")
    ko = None if target else output_buffer(out[1], k.shape, k.dtype, k.device, "k out")
    if t == 0:
        return qo, ko
    qa, qw, ka, kw = [p.float().contiguous() for p in params]
    strides = [_pstride(p, d, n) for p, n in zip((qa, qw, ka, kw), ("q_alpha", "q_weight",
                                                                     "k_alpha", "k_weight"))]
    hq_pad = next_power_of_2(hq)
    block_t = max(1, 4096 // (hq_pad * d // 2))
    cache, v, bs, fp8 = _cache_args(target, q, positions)
    _qk_rope_kernel[(cdiv(t, block_t), pairs + bool(target))](
        q, qo, k, k if ko is None else ko, v, positions, cos_sin_cache.contiguous(), t, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), qa, qw, ka, kw, *strides, hq, k.shape[1], *cache,
        HALF=d // 2, HQ_PAD=hq_pad, HK_PAD=next_power_of_2(k.shape[1]), BLOCK_T=block_t,
        HAS_NORM=has_norm, TO_CACHE=bool(target), BS=bs, FP8=fp8, num_warps=4)
    return qo, ko


def _cache_args(target, q, positions):
    """(kernel's cache operands, v, block size, FP8) of a cache target, or stand-ins never read."""
    if not target:
        return (q, q, positions, q, q, 0, 0, 0), q, 1, False
    v, kv_cache, slot_mapping, k_scale, v_scale = target
    fp8 = is_fp8(kv_cache.dtype)
    scales = (k_scale, v_scale) if fp8 else (q, q)
    return (kv_cache[0], kv_cache[1], slot_mapping, *scales, *kv_cache[0].stride()[:3]), v, kv_cache.shape[2], fp8


def qk_norm_rope_triton(q, k, positions, q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache, out=None):
    return _launch(q, k, positions, cos_sin_cache, (q_alpha, q_weight, k_alpha, k_weight), True,
                   out=out or (None, None))


def qk_norm_rope_to_cache_triton(q, k, v, positions, q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache,
                                 kv_cache, slot_mapping, k_scale=None, v_scale=None, out=None):
    _check_target(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return _launch(q, k, positions, cos_sin_cache, (q_alpha, q_weight, k_alpha, k_weight), True,
                   out=(out, None), target=(v, kv_cache, slot_mapping, k_scale, v_scale))[0]


def _check_target(k, v, kv_cache, slot_mapping, k_scale, v_scale):
    check_kv_write(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    if not slot_mapping.is_contiguous():    # the kernel reads slot t at slot_ptr + t
        raise ValueError("slot_mapping must be contiguous")


def rope_triton(x, positions, cos_sin_cache):
    one = torch.ones(1, device=x.device)
    # a grid of one column runs only the q half of the kernel; k is a placeholder
    return _launch(x, x, positions, cos_sin_cache, (one, one, one, one), False, pairs=1)[0]


def _use_triton(x):
    """CUDA heads of a power-of-two size; others (head_dim 24 under the torch backend) the reference."""
    d = x.shape[-1]
    return x.is_cuda and triton is not None and pow2(d)


def rope(x, positions, cos_sin_cache):
    fn = rope_triton if _use_triton(x) else rope_ref
    return fn(x, positions, cos_sin_cache)


def qk_norm_rope(q, k, positions, q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache, out=None):
    """(q, k) DyHT-normed per head and rotated, into `out` = (q buffer, k buffer) where given
    (contiguous, q's and k's shapes: a piecewise graph's static buffers)."""
    if _use_triton(q):
        return qk_norm_rope_triton(q, k, positions, q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache, out)
    qo, ko = qk_norm_rope_ref(q, k, positions, q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache)
    if out is None:
        return qo, ko
    return (output_buffer(out[0], q.shape, q.dtype, q.device, "q out").copy_(qo),
            output_buffer(out[1], k.shape, k.dtype, k.device, "k out").copy_(ko))


def qk_norm_rope_to_cache(q, k, v, positions, q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache,
                          kv_cache, slot_mapping, k_scale=None, v_scale=None, out=None):
    """q DyHT-normed and rotated (into `out` where given), returned; k normed and rotated, and v,
    stored at the tokens' cache slots (negative ones skipped), as qk_norm_rope then
    write_kv_cache would: one kernel for both on CUDA."""
    if _use_triton(q) and kv_cache.is_cuda:
        return qk_norm_rope_to_cache_triton(q, k, v, positions, q_alpha, q_weight, k_alpha, k_weight,
                                            cos_sin_cache, kv_cache, slot_mapping, k_scale, v_scale, out)
    _check_target(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    qo, ko = qk_norm_rope_ref(q, k, positions, q_alpha, q_weight, k_alpha, k_weight, cos_sin_cache)
    qo = qo if out is None else output_buffer(out, q.shape, q.dtype, q.device, "q out").copy_(qo)
    write_kv_cache(ko, v, kv_cache, slot_mapping, k_scale, v_scale)
    return qo
