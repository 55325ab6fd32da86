"""Top-k, min-p and top-p as one threshold a row: the sampler keeps the logits >= it.

vLLM's rules: top-k keeps the logits at or above the k-th largest (its ties too), min-p those
whose probability is at least min_p times the top one's, and top-p the nucleus of what those two
leave, renormalised: the tokens, largest first, whose mass strictly before them is under top_p.
Each is a threshold on the logits, and so is their intersection. Ties at the nucleus' edge all
stay (a sort keeps whichever of them it put first).

Sorting a 152k vocabulary's rows took 3.1 ms at 256 rows and the whole filter 6.6 (H100): a
sampled decode step of 256 rows ran 2.65x a greedy one's time (benchmarks/RESULTS.md). The kernel
finds each threshold without sorting, by bisecting the logits' order-preserving integer keys, 16
pivots a pass: each pass counts (top-k) or adds the probabilities (top-p) of the logits at or
above every pivot. A bf16 logit's key has 16 bits: four passes a threshold.

A pass is a launch: chunks of CHUNK logits are summed side by side, and every program of the next
launch adds the row's chunk sums up (in one order, so all agree) before its own pass. A bisection
starts from bounds the row's state holds (see _first_range), and a pass over one key reads
nothing: top-k 20 with top-p then read the logits half as often (256 rows: 1.26 ms, not 2.43).
One program streaming a whole row took ~0.55 ms for a top-p threshold of a 152k row, slower than
a sort at one row; chunks spread a row over the SMs. The chunks are the same at any batch size,
so a row's threshold, rounding included, does not depend on the rows beside it."""
import torch

from asynct.ops._triton import cached_launch, cdiv, jit as _jit, next_power_of_2, tl, triton
from asynct.ops.asynci_common import sm_count

# logits a program reads a loop iteration: each pass keeps [PIVOTS, BLOCK] sums in registers and
# reduces them once a chunk (a reduction a tile took ~0.45 ms a pass of a 152k row; H100)
BLOCK = 1024
CHUNK = 4 * BLOCK   # logits a partial sum covers
PIVOTS = 16         # keys a pass tries: 4 bits of the threshold's key
# a chunk's tiles, whose maxima bound top-k from below (k up to PARTS x the chunks: 149 at 152k)
PARTS = CHUNK // BLOCK
PROGRAMS_PER_SM = 4
NUM_WARPS = 8        # H100: BLOCK 512, or 8 programs an SM, were no faster (benchmarks/RESULTS.md)
# a chunk's partial sums (its PIVOTS sums or tile maxima, kept mass) and a row's state (m, tau, target,
# lo, hi, the k-th largest tile max), padded so that the second of each double buffer is
# 16-byte aligned at any row count: pointers specialise on it, and a launch aligned unlike the
# warm-up's compiled mid-run
PART, STATE = PIVOTS + 4, 8
# fp32 logits (penalties, a bias or allowed tokens) have 32-bit keys, 8 passes a bisection: with
# top-k and top-p, 18 launches, whose host work outweighed a sort at few rows (H100, Qwen's
# top-k 20 / top-p 0.8 / repetition penalty: steps of 1 row 2.30 ms against the sort's 1.80, 16
# rows 2.71 against 2.35, 256 rows 7.71 against 8.97; benchmarks/RESULTS.md). Fewer rows sort.
FP32_KERNEL_MIN_ROWS = 32
# low key bits that are zero for every value of the dtype (converted to fp32 exactly)
KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}
# what a launch sums (the next launch reads its sums by it): MAX the first (its own kernel), FINISH
# the last; flags of a bisection's passes
MAX, COUNT, MASS, FINISH = 0, 1, 2, 3
FIRST, LAST = 4, 8
if triton is not None:   # the kernel's copies: Triton reads only constexpr globals
    _MAX, _COUNT, _MASS, _FINISH, _FIRST, _LAST = map(tl.constexpr, (MAX, COUNT, MASS, FINISH, FIRST, LAST))


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
def _pivots(lo, hi, PIVOTS: tl.constexpr):
    """A pass's pivots, cutting [lo, hi] into PIVOTS parts (those past hi are not real)."""
    piv = lo + ((hi - lo) // PIVOTS + 1) * (tl.arange(0, PIVOTS) + 1).to(tl.int64)
    return piv, piv <= hi


@_jit
def _narrow(lo, hi, f, target, PIVOTS: tl.constexpr):
    """[lo, hi] after a pass whose pivots' sums are f: bisection keeps F(lo) >= target > F(hi + 1)."""
    idx = tl.arange(0, PIVOTS)
    piv, real = _pivots(lo, hi, PIVOTS)
    j = tl.max(tl.where(real & (f >= target), idx, -1))
    new_lo = tl.where(j >= 0, tl.sum(tl.where(idx == j, piv, 0)), lo)
    nxt = tl.sum(tl.where(idx == j + 1, piv, 0))
    return new_lo, tl.where(j + 1 < PIVOTS, tl.minimum(nxt - 1, hi), hi)


@_jit
def _store_tile_maxima(row_ptr, start, out, V: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Stores the maxima of the chunk's tiles of BLOCK logits where a pass's pivot sums go: the
    row's max is theirs, and they bound top-k from below."""
    cols = tl.arange(0, BLOCK)
    for i in range(CHUNK // BLOCK):
        x = tl.load(row_ptr + start + i * BLOCK + cols, mask=start + i * BLOCK + cols < V, other=float("-inf"))
        tl.store(out + i, tl.max(x.to(tl.float32)))


@_jit(do_not_specialize=["sx", "per_program"])
def _max_kernel(x_ptr, sx, part_out, per_program, V: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
                CHUNK: tl.constexpr, PART: tl.constexpr):
    """A threshold's first launch: each chunk's tile maxima. Its own kernel: in the pass kernel's
    loop, the tiles' reductions took its registers from 128 to ~200 a thread (sm_90), one
    program an SM for every pass."""
    row = tl.program_id(1)
    row_ptr = x_ptr + row.to(tl.int64) * sx
    chunk = tl.program_id(0) * per_program
    end = tl.minimum(chunk + per_program, C)
    while chunk < end:   # not range(): the interpreter takes no tensor bounds
        _store_tile_maxima(row_ptr, chunk * CHUNK, part_out + (row * C + chunk) * PART, V, BLOCK, CHUNK)
        chunk += 1


@_jit
def _chunk_sums(row_ptr, start, p32, m, scale, floor, counting, V: tl.constexpr, SHIFT: tl.constexpr,
                BLOCK: tl.constexpr, CHUNK: tl.constexpr, PIVOTS: tl.constexpr):
    """Over the chunk's logits at or above `floor`: per pivot, the count (`counting`) or the
    probabilities of those at or above it, and the kept probability."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([PIVOTS, BLOCK], dtype=tl.float32)
    kept = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(CHUNK // BLOCK):
        valid = start + i * BLOCK + cols < V
        x = tl.load(row_ptr + start + i * BLOCK + cols, mask=valid, other=float("-inf")).to(tl.float32)
        w = tl.where(valid & (x >= floor), tl.where(counting, 1.0, tl.exp((x - m) * scale)), 0.0)
        kept += w
        # pivots down the rows: a thread holds an element's 16 sums, so its key and
        # probability are computed once (pivots across threads took 16 copies of each)
        acc += tl.where(_key(x, SHIFT)[None, :] >= p32[:, None], w[None, :], 0.0)
    return tl.sum(acc, axis=1), tl.sum(kept)


@_jit
def _bisects(kind, k, top_p, V: tl.constexpr):
    """Whether a row takes part in a bisection pass of `kind`: its filter is on."""
    return ((kind == _COUNT) & (k < V)) | ((kind == _MASS) & (top_p < 1))


@_jit
def _kth_largest(maxima, k, C_POW2: tl.constexpr, PARTS: tl.constexpr):
    """The k-th largest of the chunks' tile maxima ([C_POW2, PARTS], -inf past the chunks), by a
    sort: at least k logits are at or above it. -inf where there are fewer than k tiles."""
    N: tl.constexpr = C_POW2 * PARTS
    ranked = tl.sort(tl.reshape(maxima, [N]), descending=True)
    at = tl.arange(0, N)
    return tl.max(tl.where(at == k.to(tl.int32) - 1, ranked, float("-inf")))


@_jit
def _state_after(prev, st, part, k, top_p, min_p, inv_t, V: tl.constexpr, C: tl.constexpr, C_POW2: tl.constexpr,
                 SHIFT: tl.constexpr, PIVOTS: tl.constexpr, PARTS: tl.constexpr, PART: tl.constexpr):
    """A row's (m, tau, target, lo, hi, kth) from the launch before's (`prev`: what it summed,
    + FIRST, + LAST) and its chunk sums, added up in chunk order: every program of the row alike.
    A pass whose range [lo, hi] was one key summed nothing."""
    kind = prev & 3
    had = (kind == _COUNT) | (kind == _MASS)    # the max launch leaves no state
    m = tl.load(st, mask=had, other=float("-inf")).to(tl.float32)
    tau = tl.load(st + 1, mask=had, other=float("-inf")).to(tl.float32)
    target = tl.load(st + 2, mask=had, other=0.0).to(tl.float32)
    lo, hi = tl.load(st + 3, mask=had, other=0.0).to(tl.int64), tl.load(st + 4, mask=had, other=0.0).to(tl.int64)
    kth = tl.load(st + 5, mask=had, other=float("-inf")).to(tl.float32)
    c = tl.arange(0, C_POW2)[:, None]
    chunks = part + c * PART
    if kind == _MAX:
        maxima = tl.load(chunks + tl.arange(0, PARTS)[None, :], mask=c < C, other=float("-inf"))
        m = tl.max(tl.max(maxima, axis=1))
        if k < V:
            kth = _kth_largest(maxima, k, C_POW2, PARTS)
        if min_p > 0:
            tau = m + tl.log(min_p) / inv_t
    if _bisects(kind, k, top_p, V):
        if lo < hi:
            if (kind == _MASS) & ((prev & _FIRST) != 0):
                # above 0, which every key's sum meets (a top_p under fp32's range, or flushed):
                # the bisection then ends on the top logit, as the sort's cut
                target = tl.maximum(top_p * tl.sum(tl.load(chunks + PIVOTS, mask=c < C, other=0.0)), 1.1754944e-38)
            f = tl.sum(tl.load(chunks + tl.arange(0, PIVOTS)[None, :], mask=c < C, other=0.0), axis=0)
            lo, hi = _narrow(lo, hi, f, tl.where(kind == _COUNT, k, target), PIVOTS)
        if (prev & _LAST) != 0:
            tau = tl.maximum(tau, _value(lo, SHIFT))
    return m, tau, target, lo, hi, kth


@_jit
def _first_range(kind, m, tau, kth, SHIFT: tl.constexpr, LO: tl.constexpr):
    """A bisection's starting [lo, hi]: no logit is above the max's key, and at least k logits
    (COUNT: the k-th largest tile max) or all the kept mass (MASS: the floor) are at or above lo.
    Bounds narrower than the whole key range take passes off: top-k's k-th largest and the
    nucleus after it or min-p lie a few keys below the max, and a pass over one key sums nothing."""
    floor = tl.where(kind == _COUNT, kth, tau)
    lo = tl.where(floor > float("-inf"), _key(floor, SHIFT).to(tl.int64), LO)
    return lo, _key(m, SHIFT).to(tl.int64)


@_jit(do_not_specialize=["sx", "op", "prev", "per_program"])
def _pass_kernel(x_ptr, sx, inv_t_ptr, k_ptr, p_ptr, minp_ptr, part_in, part_out, st_in, st_out, out_ptr,
                 op, prev, per_program, V: tl.constexpr, C: tl.constexpr, C_POW2: tl.constexpr,
                 SHIFT: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, PIVOTS: tl.constexpr,
                 PARTS: tl.constexpr, PART: tl.constexpr, STATE: tl.constexpr, LO: tl.constexpr):
    """One launch of a row's threshold: its state after the launch before, then this launch's
    chunk sums for `op` (a FIRST pass starts a bisection), or, FINISH, the threshold."""
    row = tl.program_id(1)
    inv_t, k = tl.load(inv_t_ptr + row), tl.load(k_ptr + row).to(tl.float32)
    top_p, min_p = tl.load(p_ptr + row), tl.load(minp_ptr + row)
    m, tau, target, lo, hi, kth = _state_after(prev, st_in + row * STATE, part_in + row * C * PART, k, top_p,
                                               min_p, inv_t, V, C, C_POW2, SHIFT, PIVOTS, PARTS, PART)
    kind = op & 3
    if (op & _FIRST) != 0:
        lo, hi = _first_range(kind, m, tau, kth, SHIFT, LO)
    if tl.program_id(0) == 0:   # the next launch's state (launches alternate two buffers)
        st = st_out + row * STATE
        tl.store(st, m)
        tl.store(st + 1, tau)
        tl.store(st + 2, target)
        tl.store(st + 3, lo.to(tl.float64))
        tl.store(st + 4, hi.to(tl.float64))
        tl.store(st + 5, kth)
        if kind == _FINISH:
            tl.store(out_ptr + row, tau)
    piv, _ = _pivots(lo, hi, PIVOTS)
    p32 = tl.minimum(piv, hi).to(tl.int32)
    floor = tl.where(kind == _MASS, tau, float("-inf"))
    row_ptr = x_ptr + row.to(tl.int64) * sx
    chunk = tl.program_id(0) * per_program
    end = tl.minimum(chunk + per_program, C)
    if not (_bisects(kind, k, top_p, V) & (lo < hi)):
        end = chunk
    while chunk < end:   # not range(): the interpreter takes no tensor bounds
        out = part_out + (row * C + chunk) * PART
        f, kept = _chunk_sums(row_ptr, chunk * CHUNK, p32, m, inv_t, floor, kind == _COUNT, V, SHIFT, BLOCK,
                              CHUNK, PIVOTS)
        tl.store(out + tl.arange(0, PIVOTS), f)
        tl.store(out + PIVOTS, kept)
        chunk += 1


def _plan(use_top_k: bool, use_top_p: bool, passes: int) -> list[int]:
    """A threshold's pass-kernel launches after the max's: a bisection for each filter some row
    sets, the finish."""
    plan = []
    for used, kind in ((use_top_k, COUNT), (use_top_p, MASS)):
        if used:
            plan += [kind | FIRST * (i == 0) | LAST * (i == passes - 1) for i in range(passes)]
    return plan + [FINISH]


def filter_threshold_triton(logits, inv_temps, top_k, top_p, min_p, use_top_k=True, use_top_p=True,
                            per_program=None):
    """`use_top_k` / `use_top_p` False: no row sets it (its bisection is skipped).
    `per_program`: chunks a program sums (tests; by default the SMs' fill)."""
    r, v = logits.shape
    out = torch.empty(r, dtype=torch.float32, device=logits.device)
    if r == 0:
        return out
    shift, chunks = KEY_SHIFT[logits.dtype], cdiv(v, CHUNK)
    per_program = per_program or min(chunks, max(1, cdiv(chunks * r, PROGRAMS_PER_SM * sm_count(logits))))
    part = torch.empty(2, r, chunks, PART, dtype=torch.float32, device=logits.device)
    state = torch.empty(2, r, STATE, dtype=torch.float64, device=logits.device)
    cached_launch(_max_kernel, (cdiv(chunks, per_program), r), (logits.dtype, logits.device), num_warps=NUM_WARPS)(
        logits, logits.stride(0), part[0], per_program, V=v, C=chunks, BLOCK=BLOCK, CHUNK=CHUNK, PART=PART)
    prev = MAX
    for t, op in enumerate(_plan(use_top_k, use_top_p, -(-(32 - shift) // 4)), 1):
        grid = (1, r) if op == FINISH else (cdiv(chunks, per_program), r)
        # a launch kept for each (op, prev): those integers specialise it
        cached_launch(_pass_kernel, grid, (op & ~LAST, prev, logits.dtype, logits.device), num_warps=NUM_WARPS)(
            logits, logits.stride(0), inv_temps, top_k, top_p, min_p, part[(t - 1) % 2], part[t % 2],
            state[(t - 1) % 2], state[t % 2], out, op & ~LAST, prev, per_program, V=v, C=chunks,
            C_POW2=next_power_of_2(chunks), SHIFT=shift, BLOCK=BLOCK, CHUNK=CHUNK, PIVOTS=PIVOTS, PARTS=PARTS,
            PART=PART, STATE=STATE, LO=-(1 << 31) >> shift)
        prev = op
    return out


def filter_threshold(logits, inv_temps, top_k, top_p, min_p, use_top_k=True, use_top_p=True):
    """See filter_threshold_ref. top_k int32, the rest fp32, all [R] on the logits' device;
    `use_top_k` / `use_top_p` False where no row sets it (the kernel then skips its passes)."""
    fast = (logits.is_cuda and triton is not None and logits.dtype in KEY_SHIFT and logits.stride(-1) == 1
            and (logits.dtype != torch.float32 or logits.shape[0] >= FP32_KERNEL_MIN_ROWS))
    if fast:
        return filter_threshold_triton(logits, inv_temps, top_k, top_p, min_p, use_top_k, use_top_p)
    return filter_threshold_ref(logits, inv_temps, top_k, top_p, min_p)


def warmup_filter_threshold(vocab: int, dtype, device):
    """Compiles the kernel at start-up for the model's logits and the fp32 ones that penalties,
    a bias or allowed tokens make."""
    if device.type != "cuda" or triton is None:
        return
    ones = torch.ones(1, device=device)
    for dt in {dtype, torch.float32}:
        filter_threshold_triton(torch.zeros(1, vocab, dtype=dt, device=device), ones,
                                torch.ones(1, dtype=torch.int32, device=device), ones / 2, ones / 2)
