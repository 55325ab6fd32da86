"""A sampled row's draw: the argmax, over the logits its filters keep, of x / T + Gumbel noise
(-log(-log(u)) for u uniform), which draws from softmax(x / T) over the kept logits. Greedy rows
(T = 0) take the argmax of their logits, first index of the largest.

The noise is counter-based (Philox 4x32-10, as Triton's tl.randint4x and curand compute it):
a row's uniforms are a function of its key, its counter and the column, so a seeded sequence
(key from its seed, counter its output position) draws the same tokens alone or in any batch,
on a CPU or a GPU, and no generator state is kept. A per-sequence torch.Generator drew each
seeded row's noise in its own launch: 2.8 ms a 256-row step (H100, benchmarks/RESULTS.md). The
kernel reads each row once, where the torch ops (temperature, mask, softmax, noise, division,
argmax) went over [rows, vocab] in fp32 about six times."""
import torch

from asynct.ops._triton import cached_launch, cdiv, jit as _jit, tl, triton
from asynct.ops.argmax import MAX_CHUNKS, _best, _pick_kernel

NOISE_BLOCK = 2048          # columns one Philox block covers: its four outputs a quarter each
CHUNK = 4 * NOISE_BLOCK     # columns a program draws from
NUM_WARPS = 8     # H100, 256 rows: 153 us against 165 with 4; 1 row: 17 against 24
BIG = 2**31 - 1
# Philox 4x32's multipliers and key increments (Salmon et al. 2011)
ROUND_A, ROUND_B, KEY_A, KEY_B = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
UNIFORM_SCALE = 4.6566127342e-10   # the largest with (2**31 - 1) * it < 1 in fp32 (Triton's)
M32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit halves of a * b for a constant a and uint32 values b held in int64: b
    times a's 16-bit halves stays under 2**49."""
    lo_part, hi_part = b * (a & 0xFFFF), b * (a >> 16)
    return (hi_part + (lo_part >> 16)) >> 16, (((hi_part & 0xFFFF) << 16) + lo_part) & M32


def philox_ref(key: torch.Tensor, counter: torch.Tensor):
    """Philox 4x32-10 of counters (counter's low and high 32 bits, 0, 0) under 64-bit keys:
    int64 [R, 1] and [R, N] -> four int64 [R, N] of uint32 values."""
    k0, k1 = key & M32, (key >> 32) & M32
    c0, c1 = counter & M32, (counter >> 32) & M32
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & M32, (k1 + KEY_B) & M32
    return c0, c1, c2, c3


def uniform_ref(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [R, vocab] in [0, 1): row r's noise under keys[:, r] = (key, counter). Column c is
    output c // (NOISE_BLOCK / 4) % 4 of Philox block c // NOISE_BLOCK's counter c % (NOISE_BLOCK / 4)."""
    quarter, blocks = NOISE_BLOCK // 4, cdiv(vocab, NOISE_BLOCK)
    lanes = torch.arange(blocks * quarter, dtype=torch.int64, device=keys.device)
    outs = philox_ref(keys[0, :, None], keys[1, :, None] + lanes)
    bits = torch.stack([o.view(-1, blocks, quarter) for o in outs], 2).flatten(1)[:, :vocab]
    x = torch.where(bits >= 2**31, bits - 2**32, bits)      # the int32 the bits read as
    x = torch.where(x < 0, -x - 1, x).float()
    return x * torch.tensor(UNIFORM_SCALE, dtype=torch.float32)


def draw_ref(logits, inv_temps, threshold, keys):
    """int64 [R]. logits [R, V]; inv_temps fp32 [R] (0: greedy); threshold fp32 [R] (keep the
    logits >= it) or None; keys int64 [2, R]: each row's Philox key and counter."""
    x = logits.float()
    noise = -torch.log(-torch.log(uniform_ref(keys, x.shape[1])))
    score = x * inv_temps[:, None] + noise
    # kept: x >= threshold, as the kernel's test (a NaN logit of a sampled row is dropped)
    tau = float("-inf") if threshold is None else threshold[:, None]
    score = score.masked_fill(~(x >= tau), float("-inf"))
    return torch.where(inv_temps[:, None] > 0, score, x).argmax(-1)


@_jit
def _lane_score(row_ptr, cols, V, bits, inv_t, tau, best, at, BIG: tl.constexpr):
    """A lane's best (score, column) after one more column: columns rise, so a strictly larger
    score, a lane's first NaN or its first column replaces it."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    u = tl.uint_to_uniform_float(bits)
    scaled = tl.where(inv_t > 0, x, 0.0) * inv_t     # no -inf * 0 for greedy rows
    s = tl.where(inv_t > 0, tl.where(x >= tau, scaled - tl.log(-tl.log(u)), float("-inf")), x)
    better = ((s > best) | ((s != s) & (best == best)) | (at == BIG)) & (cols < V)
    return tl.where(better, s, best), tl.where(better, cols, at)


@_jit(do_not_specialize=["sx", "V", "R"])
def _draw_kernel(x_ptr, sx, V, inv_t_ptr, tau_ptr, key_ptr, R, val_ptr, idx_ptr, HAS_TAU: tl.constexpr,
                 NOISE_BLOCK: tl.constexpr, CHUNK: tl.constexpr, BIG: tl.constexpr):
    c, row = tl.program_id(0), tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    tau = float("-inf")
    if HAS_TAU:
        tau = tl.load(tau_ptr + row)
    key, counter = tl.load(key_ptr + row), tl.load(key_ptr + R + row)
    QUARTER: tl.constexpr = NOISE_BLOCK // 4
    lane = tl.arange(0, QUARTER)
    row_ptr = x_ptr + row.to(tl.int64) * sx
    best = tl.full([QUARTER], float("-inf"), dtype=tl.float32)
    at = tl.full([QUARTER], BIG, dtype=tl.int32)
    for b in range(CHUNK // NOISE_BLOCK):
        block = c * (CHUNK // NOISE_BLOCK) + b
        r0, r1, r2, r3 = tl.randint4x(key, counter + block * QUARTER + lane)
        cols = block * NOISE_BLOCK + lane
        best, at = _lane_score(row_ptr, cols, V, r0, inv_t, tau, best, at, BIG)
        best, at = _lane_score(row_ptr, cols + QUARTER, V, r1, inv_t, tau, best, at, BIG)
        best, at = _lane_score(row_ptr, cols + 2 * QUARTER, V, r2, inv_t, tau, best, at, BIG)
        best, at = _lane_score(row_ptr, cols + 3 * QUARTER, V, r3, inv_t, tau, best, at, BIG)
    v, i = _best(best, at, BIG)
    tl.store(val_ptr + row * tl.num_programs(0) + c, v)
    tl.store(idx_ptr + row * tl.num_programs(0) + c, i)


def draw_triton(logits, inv_temps, threshold, keys):
    r, v = logits.shape
    chunks = cdiv(v, CHUNK)
    out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r == 0:
        return out
    vals = torch.empty(r, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(r, chunks, dtype=torch.int32, device=logits.device)
    tau = inv_temps if threshold is None else threshold    # any fp32 [R]: not read
    cached_launch(_draw_kernel, (chunks, r), (threshold is not None, logits.dtype, logits.device),
                  num_warps=NUM_WARPS)(
        logits, logits.stride(0), v, inv_temps, tau, keys, r, vals, idx, HAS_TAU=threshold is not None,
        NOISE_BLOCK=NOISE_BLOCK, CHUNK=CHUNK, BIG=BIG)
    cached_launch(_pick_kernel, (r,), (logits.device,), num_warps=1, launch_pdl=False)(
        vals, idx, out, chunks, MAX_C=MAX_CHUNKS, BIG=BIG, PDL=False)
    return out


def draw(logits, inv_temps, threshold, keys):
    """See draw_ref: the kernel on CUDA, the same noise and draws (up to rounding) in torch elsewhere."""
    fast = (logits.is_cuda and triton is not None and logits.stride(-1) == 1
            and cdiv(logits.shape[1], CHUNK) <= MAX_CHUNKS)
    return (draw_triton if fast else draw_ref)(logits, inv_temps, threshold, keys)


def warmup_draw(vocab: int, dtype, device):
    """Compiles the kernel at start-up for the model's logits and fp32 ones, with and without
    a threshold."""
    if device.type != "cuda" or triton is None:
        return
    keys = torch.zeros(2, 1, dtype=torch.int64, device=device)
    ones = torch.ones(1, device=device)
    for dt in {dtype, torch.float32}:
        for threshold in (None, ones):
            draw_triton(torch.zeros(1, vocab, dtype=dt, device=device), ones, threshold, keys)
