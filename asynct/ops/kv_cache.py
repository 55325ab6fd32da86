"""Writing this step's K/V into the paged cache [2, num_blocks, block_size, Hkv, D].

Every kernel takes the cache through its strides (unit stride along D only), so that the same
kernels serve our contiguous cache and vLLM's block-major one viewed as [2, ...]."""
import torch

from asynct.ops._triton import jit as _jit, tl, triton


def check_kv_cache(kv_cache):
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be a [2, num_blocks, block_size, Hkv, D] tensor with unit "
                         f"stride along D, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")


def _check(k, v, kv_cache, slot_mapping):
    check_kv_cache(kv_cache)
    want = (k.shape[0],) + tuple(kv_cache.shape[3:])
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"k/v must be {want}, got {tuple(k.shape)} / {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError("slot_mapping must be [T]")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k/v need unit last stride")


def write_kv_cache_ref(k, v, kv_cache, slot_mapping):
    _check(k, v, kv_cache, slot_mapping)
    keep = slot_mapping >= 0  # negative slots are CUDA-graph padding
    slots = slot_mapping[keep]
    blk, off = slots // kv_cache.shape[2], slots % kv_cache.shape[2]
    kv_cache[0, blk, off] = k[keep].to(kv_cache.dtype)
    kv_cache[1, blk, off] = v[keep].to(kv_cache.dtype)


@_jit(do_not_specialize=["T"])
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, T, sk0, sk1, sv0, sv1, s_blk, s_tok,
                     s_head, H, D: tl.constexpr, BS: tl.constexpr, H_PAD: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, H_PAD)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1)
    mask = (h < H) & (slot >= 0)
    kk = tl.load(k_ptr + t.to(tl.int64) * sk0 + h * sk1 + d, mask=mask)
    vv = tl.load(v_ptr + t.to(tl.int64) * sv0 + h * sv1 + d, mask=mask)
    dst = (slot // BS) * s_blk + (slot % BS) * s_tok + h * s_head + d
    tl.store(kc_ptr + dst, kk.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, vv.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(k, v, kv_cache, slot_mapping):
    _check(k, v, kv_cache, slot_mapping)
    t, h, d = k.shape
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if t == 0:
        return
    h_pad = triton.next_power_of_2(h)
    block_t = max(1, 4096 // (h_pad * d))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(triton.cdiv(t, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, t, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], h, D=d, BS=kv_cache.shape[2], H_PAD=h_pad, BLOCK_T=block_t,
        num_warps=4)


def write_kv_cache(k, v, kv_cache, slot_mapping):
    if kv_cache.is_cuda and triton is not None:
        write_kv_cache_triton(k, v, kv_cache, slot_mapping)
    else:
        write_kv_cache_ref(k, v, kv_cache, slot_mapping)
