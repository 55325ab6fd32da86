"""Top-k, min-p and top-p as one threshold a row: the sampler keeps the logits >= it.

vLLM's rules: top-k keeps the logits at or above the k-th largest (its ties too), min-p those
whose probability is at least min_p times the top one's, and top-p the nucleus of what those two
leave, renormalised: the tokens, largest first, whose mass strictly before them is under top_p.
Each is a threshold on the logits, and so is their intersection. Ties at the nucleus' edge all
stay (a sort keeps whichever of them it put first).

Sorting a 152k vocabulary's rows took 3.1 ms at 256 rows and the whole filter 6.6 (H100): a
sampled decode step of 256 rows ran 2.65x a greedy one's time (benchmarks/RESULTS.md). The kernel
finds each threshold without sorting: one program a row bisects the logits' order-preserving
integer keys, 16 pivots a pass, each pass counting (top-k) or adding the probabilities (top-p)
of the logits at or above every pivot. A bf16 logit's key has 16 bits: four passes a threshold.
Steps of 256 rows with top-p then ran 1.75x faster, with min-p 2.05x. A program streams its row
alone, ~0.55 ms a 152k row for top-p and ~1 ms with top-k too, where the sort's cost grows with
the rows from ~0.3 ms at one: batch-1 steps ran 1.23-1.6x slower, so fewer rows than
KERNEL_MIN_ROWS sort (a crossover extrapolated from 1 and 256 rows, not measured between)."""
import torch

from asynct.ops._triton import jit as _jit, tl, triton

# logits a program reads a loop iteration: each pass keeps [PIVOTS, BLOCK] sums in registers and
# reduces them once (a reduction a tile took ~0.45 ms a pass of a 152k row; H100)
BLOCK = 1024
PIVOTS = 16         # keys a pass tries: 4 bits of the threshold's key
KERNEL_MIN_ROWS = 32
# low key bits that are zero for every value of the dtype (converted to fp32 exactly)
KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}


def filter_threshold_ref(logits, inv_temps, top_k, top_p, min_p):
    """fp32 [R]: keep logits >= it. logits [R, V] (the temperature not applied: inv_temps [R]
    scales them for probabilities), top_k int [R] (V or more: off), top_p [R] (1: off), min_p
    [R] (0: off)."""
    x = logits.float()
    v = x.sort(-1, descending=True).values
    rows, vocab = torch.arange(len(x), device=x.device), x.shape[1]
    inf = torch.full_like(v[:, 0], float("-inf"))
    tau = torch.where(top_k < vocab, v[rows, top_k.long().clamp(1, vocab) - 1], inf)
    m = v[:, 0]
    tau = torch.maximum(tau, torch.where(min_p > 0, m + torch.log(min_p) / inv_temps, inf))
    w = torch.exp((v - m[:, None]) * inv_temps[:, None]).masked_fill(v < tau[:, None], 0)
    cum = w.cumsum(-1)
    cut = (cum < (top_p * cum[:, -1])[:, None]).sum(-1).clamp(max=vocab - 1)   # the first reaching top_p
    return torch.where(top_p < 1, torch.maximum(tau, v[rows, cut]), tau)


@_jit
def _key(x, SHIFT: tl.constexpr):
    """An int32 key of fp32 x in x's order (sign-magnitude bits to two's complement), less the
    SHIFT low bits that the logits' dtype leaves zero."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) >> SHIFT


@_jit
def _value(key, SHIFT: tl.constexpr):
    """The fp32 value whose key is `key` (_key's inverse on the dtype's values)."""
    low = tl.where(key < 0, (1 << SHIFT) - 1, 0)
    k32 = (key.to(tl.int32) << SHIFT) | low
    return tl.where(k32 < 0, k32 ^ 0x7FFFFFFF, k32).to(tl.float32, bitcast=True)


@_jit
def _tile(row_ptr, start, cols, V: tl.constexpr):
    """The row's logits [start, start + BLOCK) in fp32 (-inf past the vocabulary), and which are in it."""
    valid = start + cols < V
    return tl.load(row_ptr + start + cols, mask=valid, other=float("-inf")).to(tl.float32), valid


@_jit
def _largest_key(row_ptr, m, inv_t, floor, target, V: tl.constexpr, MASS: tl.constexpr, SHIFT: tl.constexpr,
                 PASSES: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, LO: tl.constexpr,
                 HI: tl.constexpr):
    """The largest key t whose logits at or above it count (or, MASS, whose probabilities at or
    above `floor` add up) to at least `target`: always a logit's own key. Bisection keeps
    F(lo) >= target > F(hi + 1); each pass cuts [lo, hi] into PIVOTS parts."""
    lo = tl.zeros([], dtype=tl.int64) + LO
    hi = tl.zeros([], dtype=tl.int64) + HI
    idx = tl.arange(0, PIVOTS)
    cols = tl.arange(0, BLOCK)
    for _ in tl.static_range(PASSES):
        step = (hi - lo) // PIVOTS + 1
        piv = lo + step * (idx + 1).to(tl.int64)
        real = piv <= hi
        p32 = tl.minimum(piv, hi).to(tl.int32)
        acc = tl.zeros([PIVOTS, BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            x, valid = _tile(row_ptr, start, cols, V)
            if MASS:
                w = tl.where(valid & (x >= floor), tl.exp((x - m) * inv_t), 0.0)
            else:
                w = tl.where(valid, 1.0, 0.0)
            # pivots down the rows: a thread holds an element's 16 sums, so its key and
            # probability are computed once (pivots across threads took 16 copies of each)
            above = _key(x, SHIFT)[None, :] >= p32[:, None]
            acc += tl.where(above, w[None, :], 0.0)
        f = tl.sum(acc, axis=1)
        j = tl.max(tl.where(real & (f >= target), idx, -1))
        new_lo = tl.where(j >= 0, tl.sum(tl.where(idx == j, piv, 0)), lo)
        nxt = tl.sum(tl.where(idx == j + 1, piv, 0))
        hi = tl.where(j + 1 < PIVOTS, tl.minimum(nxt - 1, hi), hi)
        lo = new_lo
    return lo


@_jit(do_not_specialize=["sx"])
def _threshold_kernel(x_ptr, sx, inv_t_ptr, k_ptr, p_ptr, minp_ptr, out_ptr, V: tl.constexpr, SHIFT: tl.constexpr,
                      PASSES: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, LO: tl.constexpr,
                      HI: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = x_ptr + row.to(tl.int64) * sx
    cols = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        x, _ = _tile(row_ptr, start, cols, V)
        top = tl.maximum(top, x)
    m = tl.max(top)
    inv_t, k = tl.load(inv_t_ptr + row), tl.load(k_ptr + row)
    top_p, min_p = tl.load(p_ptr + row), tl.load(minp_ptr + row)
    tau = float("-inf")
    if min_p > 0:
        tau = m + tl.log(min_p) / inv_t
    if k < V:
        t = _largest_key(row_ptr, m, inv_t, tau, k.to(tl.float32), V, False, SHIFT, PASSES, BLOCK, PIVOTS,
                         LO, HI)
        tau = tl.maximum(tau, _value(t, SHIFT))
    if top_p < 1:
        kept = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            x, _ = _tile(row_ptr, start, cols, V)
            kept += tl.where(x >= tau, tl.exp((x - m) * inv_t), 0.0)
        target = top_p * tl.sum(kept)
        t = _largest_key(row_ptr, m, inv_t, tau, target, V, True, SHIFT, PASSES, BLOCK, PIVOTS, LO, HI)
        tau = tl.maximum(tau, _value(t, SHIFT))
    tl.store(out_ptr + row, tau)


def filter_threshold_triton(logits, inv_temps, top_k, top_p, min_p):
    r, v = logits.shape
    out = torch.empty(r, dtype=torch.float32, device=logits.device)
    shift = KEY_SHIFT[logits.dtype]
    passes = -(-(32 - shift) // 4)
    _threshold_kernel[(r,)](logits, logits.stride(0), inv_temps, top_k, top_p, min_p, out, V=v, SHIFT=shift,
                            PASSES=passes, BLOCK=BLOCK, PIVOTS=PIVOTS, LO=-(1 << 31) >> shift,
                            HI=((1 << 31) - 1) >> shift, num_warps=8)
    return out


def filter_threshold(logits, inv_temps, top_k, top_p, min_p):
    """See filter_threshold_ref. top_k int32, the rest fp32, all [R] on the logits' device."""
    fast = (logits.is_cuda and triton is not None and logits.dtype in KEY_SHIFT and logits.stride(-1) == 1
            and logits.shape[0] >= KERNEL_MIN_ROWS)
    return (filter_threshold_triton if fast else filter_threshold_ref)(logits, inv_temps, top_k, top_p, min_p)


def warmup_filter_threshold(vocab: int, dtype, device):
    """Compiles the kernel at start-up for the model's logits and the fp32 ones that penalties,
    a bias or allowed tokens make."""
    if device.type != "cuda" or triton is None:
        return
    ones = torch.ones(1, device=device)
    for dt in {dtype, torch.float32}:
        filter_threshold_triton(torch.zeros(1, vocab, dtype=dt, device=device), ones,
                                torch.ones(1, dtype=torch.int32, device=device), ones / 2, ones / 2)
