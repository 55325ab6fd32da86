"""Greedy sampling's argmax over logits [R, V], as torch.argmax(-1) answers it: the first index of
the largest value, a NaN counting as larger than everything (its first index wins).

torch reduces a row of a 152k vocabulary in one block: 8.5 us at one row, 17.8 at 32 (H200,
benchmarks/RESULTS.md). Here each row is cut into chunks that programs reduce side by side (their
loads all in flight); a second kernel picks the best chunk of each row from those partials: 2.8
and 11.8 us. It lost at 256 rows (62.6 against 55.3), and as an eager op its two launches cost
the host more than torch's one, so only small decode graphs run it (engine/cuda_graph.py)."""
import torch

from asynct.ops._triton import jit as _jit, cdiv, pdl_args, tl, triton, wait_for_prior

CHUNK = 4096        # columns a first-stage program reduces, in one load
MAX_CHUNKS = 64     # partials the second stage loads at once: V <= 262,144


def argmax_ref(logits):
    return logits.argmax(-1)


@_jit
def _best(v, i, BIG: tl.constexpr):
    """(value, index) of the winner among candidates (v, i): a NaN's first index, else the
    first index of the maximum. Candidates with i == BIG are empty."""
    nan = v != v
    nan_i = tl.min(tl.where(nan, i, BIG))
    clean = tl.where(nan | (i == BIG), float("-inf"), v)
    m = tl.max(clean)
    # an all -inf row still answers its first index: -inf == -inf
    first = tl.min(tl.where((clean == m) & (i != BIG), i, BIG))
    return tl.where(nan_i < BIG, float("nan"), m), tl.where(nan_i < BIG, nan_i, first)


@_jit(do_not_specialize=["V", "sx"])
def _chunk_kernel(x_ptr, sx, V, val_ptr, idx_ptr, CHUNK: tl.constexpr, BIG: tl.constexpr, PDL: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    wait_for_prior(PDL)
    x = tl.load(x_ptr + row.to(tl.int64) * sx + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    v, i = _best(x, tl.where(cols < V, cols, BIG), BIG)
    out = row * tl.num_programs(1) + c
    tl.store(val_ptr + out, v)
    tl.store(idx_ptr + out, i)


@_jit(do_not_specialize=["C"])
def _pick_kernel(val_ptr, idx_ptr, out_ptr, C, MAX_C: tl.constexpr, BIG: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, MAX_C)
    wait_for_prior(PDL)
    v = tl.load(val_ptr + row * C + c, mask=c < C, other=float("-inf"))
    i = tl.load(idx_ptr + row * C + c, mask=c < C, other=BIG)
    _, best = _best(v, i, BIG)
    tl.store(out_ptr + row, best.to(tl.int64))


def argmax_triton(logits, out=None):
    r, v = logits.shape
    chunks = cdiv(v, CHUNK)
    out = torch.empty(r, dtype=torch.int64, device=logits.device) if out is None else out
    if r == 0:
        return out
    vals = torch.empty(r, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(r, chunks, dtype=torch.int32, device=logits.device)
    pdl = pdl_args(logits)
    _chunk_kernel[(r, chunks)](logits, logits.stride(0), v, vals, idx, CHUNK=CHUNK, BIG=2**31 - 1,
                               num_warps=8, **pdl)
    _pick_kernel[(r,)](vals, idx, out, chunks, MAX_C=MAX_CHUNKS, BIG=2**31 - 1, num_warps=1, **pdl)
    return out


def argmax(logits, out=None):
    """The index of each row's maximum (int64 [R]) of float logits [R, V], written into `out`
    (a contiguous int64 [R]) where given."""
    if out is not None and (out.shape != logits.shape[:1] or out.dtype != torch.int64 or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous int64 ({logits.shape[0]},), got {tuple(out.shape)} {out.dtype}")
    fast = (logits.is_cuda and triton is not None and logits.dim() == 2 and logits.stride(-1) == 1
            and logits.is_floating_point() and cdiv(logits.shape[1], CHUNK) <= MAX_CHUNKS)
    if fast:
        return argmax_triton(logits, out)
    return argmax_ref(logits) if out is None else out.copy_(argmax_ref(logits))


def warmup_argmax(vocab: int, dtype, device):
    """Compiles both stages at start-up for the model's logits (what decode graphs take)."""
    argmax(torch.zeros(1, vocab, dtype=dtype, device=device))
