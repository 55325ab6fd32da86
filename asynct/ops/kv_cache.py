"""Writing this step's K/V into the paged cache [2, num_blocks, block_size, Hkv, D]."""
import torch

from asynct.ops._triton import jit as _jit, tl, triton


def _check(k, v, kv_cache, slot_mapping):
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [2, num_blocks, block_size, Hkv, D] tensor")
    want = (k.shape[0],) + tuple(kv_cache.shape[3:])
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"k/v must be {want}, got {tuple(k.shape)} / {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError("slot_mapping must be [T]")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k/v need unit last stride")


def write_kv_cache_ref(k, v, kv_cache, slot_mapping):
    _check(k, v, kv_cache, slot_mapping)
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    keep = slot_mapping >= 0  # negative slots are CUDA-graph padding
    slots = slot_mapping[keep]
    flat[0, slots] = k[keep].to(kv_cache.dtype)
    flat[1, slots] = v[keep].to(kv_cache.dtype)


@_jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, T, sk0, sk1, sv0, sv1, cache_half, H,
                     D: tl.constexpr, H_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, H_PAD)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1)
    mask = (h < H) & (slot >= 0)
    kk = tl.load(k_ptr + t.to(tl.int64) * sk0 + h * sk1 + d, mask=mask)
    vv = tl.load(v_ptr + t.to(tl.int64) * sv0 + h * sv1 + d, mask=mask)
    dst = cache_ptr + slot * (H * D) + h * D + d
    ty = cache_ptr.dtype.element_ty
    tl.store(dst, kk.to(ty), mask=mask)
    tl.store(dst + cache_half, vv.to(ty), mask=mask)


def write_kv_cache_triton(k, v, kv_cache, slot_mapping):
    _check(k, v, kv_cache, slot_mapping)
    t, h, d = k.shape
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if t == 0:
        return
    h_pad = triton.next_power_of_2(h)
    block_t = max(1, 4096 // (h_pad * d))
    _write_kv_kernel[(triton.cdiv(t, block_t),)](
        k, v, kv_cache, slot_mapping, t, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache[0].numel(), h, D=d, H_PAD=h_pad, BLOCK_T=block_t, num_warps=4)


def write_kv_cache(k, v, kv_cache, slot_mapping):
    if kv_cache.is_cuda and triton is not None:
        write_kv_cache_triton(k, v, kv_cache, slot_mapping)
    else:
        write_kv_cache_ref(k, v, kv_cache, slot_mapping)
