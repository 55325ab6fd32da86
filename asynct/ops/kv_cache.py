"""Writing this step's K/V into the paged cache [2, num_blocks, block_size, Hkv, D].

Every kernel takes the cache through its strides (unit stride along D only), so that the same
kernels serve our contiguous cache and vLLM's block-major one viewed as [2, ...].

An FP8 (e4m3) cache stores x / scale with static per-(KV head, channel) scales [Hkv, D] fp32
(asynct/model/kv_scales.py); stores saturate at +-448, so a value past its bound clamps instead
of becoming NaN, and readers multiply the scale back in registers."""
import torch

from asynct.ops._triton import KernelLaunch, jit as _jit, cdiv, next_power_of_2, pdl, pow2, tl, triton, wait_for_prior


def check_kv_cache(kv_cache):
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be a [2, num_blocks, block_size, Hkv, D] tensor with unit "
                         f"stride along D, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0    # e4m3's largest finite value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def check_kv_scales(kv_cache, k_scale, v_scale):
    """An FP8 cache needs both scales as fp32 [Hkv, D]; other caches ignore them."""
    if not is_fp8(kv_cache.dtype):
        return
    want = tuple(kv_cache.shape[3:])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"an FP8 KV cache needs {name} as contiguous fp32 {want}, got "
                             f"{None if s is None else (tuple(s.shape), s.dtype)}")


def quantize_fp8(x, scale):
    """x / scale as e4m3, saturating: torch's cast turns out-of-range values into NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x, scale, dtype):
    """Cache rows [..., Hkv, D] -> dtype; the identity (no copy) without a scale."""
    return x if scale is None else (x.float() * scale).to(dtype)


def check_kv_write(k, v, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    check_kv_shapes(k, v, kv_cache, slot_mapping)
    check_kv_scales(kv_cache, k_scale, v_scale)


def check_kv_shapes(k, v, kv_cache, slot_mapping):
    check_kv_cache(kv_cache)
    want = (k.shape[0],) + tuple(kv_cache.shape[3:])
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"k/v must be {want}, got {tuple(k.shape)} / {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError("slot_mapping must be [T]")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k/v need unit last stride")


def write_kv_cache_ref(k, v, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    check_kv_write(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0  # negative slots are CUDA-graph padding
    slots = slot_mapping[keep]
    blk, off = slots // kv_cache.shape[2], slots % kv_cache.shape[2]
    for i, (x, scale) in enumerate(((k, k_scale), (v, v_scale))):
        x = x[keep]
        kv_cache[i, blk, off] = quantize_fp8(x, scale) if is_fp8(kv_cache.dtype) else x.to(kv_cache.dtype)


@_jit
def store_cache_rows(cache_ptr, scale_ptr, slot, h, d, x, mask, hmask, s_blk, s_tok, s_head,
                     BS: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr):
    """Stores x (this step's keys or values of heads h, dims d, broadcast over tokens) at each
    token's cache slot; an FP8 cache gets x / scale, clamped to e4m3's range. `hmask`: the
    real heads (a mask of the scales' shape)."""
    if FP8:
        s = tl.load(scale_ptr + h * D + d, mask=hmask, other=1.0)
        x = tl.minimum(tl.maximum(x.to(tl.float32) / s, -448.0), 448.0)
    dst = (slot // BS) * s_blk + (slot % BS) * s_tok + h * s_head + d
    tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@_jit(do_not_specialize=["T"])
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, T, sk0, sk1, sv0, sv1,
                     s_blk, s_tok, s_head, H, D: tl.constexpr, BS: tl.constexpr,
                     H_PAD: tl.constexpr, BLOCK_T: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, H_PAD)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1)
    mask = (h < H) & (slot >= 0)
    kk = tl.load(k_ptr + t.to(tl.int64) * sk0 + h * sk1 + d, mask=mask)
    vv = tl.load(v_ptr + t.to(tl.int64) * sv0 + h * sv1 + d, mask=mask)
    store_cache_rows(kc_ptr, ks_ptr, slot, h, d, kk, mask, h < H, s_blk, s_tok, s_head, BS, D, FP8)
    store_cache_rows(vc_ptr, vs_ptr, slot, h, d, vv, mask, h < H, s_blk, s_tok, s_head, BS, D, FP8)


class KVWriteLaunch:
    """A step's K/V write planned once for its tokens (grid, tile, options) and launched by every
    layer with its own k, v and cache, shaped and strided as the plan's: the vLLM plugin writes
    each layer's K/V in its eager attention, where Triton's JIT cost ~45 us a launch
    (KernelLaunch)."""

    def __init__(self, k, kv_cache, slot_mapping):
        check_kv_shapes(k, k, kv_cache, slot_mapping)    # the scales come a layer
        t, h, d = k.shape
        if not pow2(d):
            raise ValueError(f"head_dim must be a power of two, got {d}")
        self.slot_mapping, self.tokens = slot_mapping, t
        # what the constants below follow: a layer whose cache differs gets an error, not a write
        # by another layer's block size, heads or dtype
        self.layout = _write_layout(kv_cache)
        h_pad = next_power_of_2(h)
        block_t = max(1, 4096 // (h_pad * d))
        on = pdl(k)
        self.consts = dict(D=d, BS=kv_cache.shape[2], H_PAD=h_pad, BLOCK_T=block_t, FP8=is_fp8(kv_cache.dtype), PDL=on)
        self.kernel = KernelLaunch(_write_kv_kernel, (cdiv(t, block_t),), num_warps=4, launch_pdl=on)

    def __call__(self, k, v, kv_cache, k_scale=None, v_scale=None):
        check_kv_write(k, v, kv_cache, self.slot_mapping, k_scale, v_scale)
        if _write_layout(kv_cache) != self.layout:
            raise ValueError(f"this K/V write was planned for a cache {self.layout}, got {_write_layout(kv_cache)}")
        if self.tokens == 0:
            return
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        scales = (k_scale, v_scale) if self.consts["FP8"] else (self.slot_mapping,) * 2
        self.kernel(k, v, k_cache, v_cache, self.slot_mapping, *scales, self.tokens, k.stride(0), k.stride(1),
                    v.stride(0), v.stride(1), *k_cache.stride()[:3], k.shape[1], **self.consts)


def _write_layout(kv_cache) -> tuple:
    """(block size, KV heads, head size, dtype, device): k and v are checked against the cache."""
    return (*kv_cache.shape[2:], kv_cache.dtype, kv_cache.device)


def write_kv_cache_triton(k, v, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    KVWriteLaunch(k, kv_cache, slot_mapping)(k, v, kv_cache, k_scale, v_scale)   # both check


def write_kv_ref_launch(k, kv_cache, slot_mapping):
    """The reference as a layer's launch (any head size)."""
    return lambda k, v, kv_cache, k_scale=None, v_scale=None: write_kv_cache_ref(k, v, kv_cache, slot_mapping,
                                                                                   k_scale, v_scale)


def write_kv_launch(k, kv_cache, slot_mapping):
    """A step's K/V write as a layer's launch, `launch(k, v, kv_cache, k_scale, v_scale)`:
    planned once (KVWriteLaunch) where the Triton kernel serves, else the reference."""
    if kv_cache.is_cuda and triton is not None and pow2(kv_cache.shape[-1]):
        return KVWriteLaunch(k, kv_cache, slot_mapping)
    return write_kv_ref_launch(k, kv_cache, slot_mapping)


def write_kv_cache(k, v, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    # head sizes not a power of two (the torch backend) take the reference
    write_kv_launch(k, kv_cache, slot_mapping)(k, v, kv_cache, k_scale, v_scale)
