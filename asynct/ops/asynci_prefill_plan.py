"""The launch plan of paged AsyncI prefill (asynci_prefill.py): which tile config and how many key
splits a step's shape gets, from host ints alone, so that a plan never picks a kernel variant
the warm-up did not compile."""
import math
from collections import namedtuple

from asynct.ops._triton import triton

PrefillConfig = namedtuple("PrefillConfig", "block_m block_n num_warps num_stages")

# The only tile configs the launch plan picks. Enough query tiles: the 64-key tile, unsplit; too
# few: 32-key tiles over key splits (H200, benchmarks/RESULTS.md: at 2K tokens 0.96 of SDPA flash
# against 0.83 for 64-key tiles split alike; unsplit, 32-key tiles lose, 0.67-0.81). A pool wider
# than 33 keys needs the 64-key tile split too. Since the kernel finds a tile's cache rows one
# tile ahead, stages past two buffer deeper, and the split tiles load three deep. Plans against
# the kernel before both (x SDPA flash): 1 x 512 1.09 against 1.05, 2K 1.17-1.18 against 1.24,
# 8K 1.25 both, 8 x 512 (unsplit, 64-key tiles) 0.98-0.99 against 0.94 (H200, RESULTS.md).
PREFILL_CONFIGS = (PrefillConfig(64, 64, 4, 2), PrefillConfig(64, 32, 4, 3))
# Where even 128-query tiles give two programs an SM: 8 warps, three deep, unsplit. H200, x SDPA
# flash against the 64-query whole-key config: 1 x 8K 1.40 / 1.25, 2 x 4K 1.40 / 1.28, 4 x 2K 1.30
# / 1.21, 8 x 1K 1.18 / 1.16, 16 x 1K 1.05 / 1.02 (RESULTS.md, twentieth session). It needs 160 KB
# of shared memory at head_dim 128 in bf16: not at 256 (288 KB) nor with fp32 queries (320 KB);
# past a GQA group of 4 its tile holds no more queries than the whole-key config's.
WIDE_CONFIG = PrefillConfig(128, 64, 8, 3)
MAX_SPLITS = 8
MIN_SPLIT_TILES = 2     # key tiles per split at least: a halo costs about one tile


def _split_config(pool_size):
    whole, split = PREFILL_CONFIGS
    return split if pool_size - 1 <= split.block_n else whole


def wide_fits(q, kv_cache):
    """Whether WIDE_CONFIG serves these queries [T, Hq, D] and cache [2, blocks, BS, Hkv, D]: 16-bit
    both (measured only so: an FP8 cache reads its keys otherwise), D <= 128, groups <= 4."""
    group = q.shape[1] // kv_cache.shape[3]
    return (q.shape[2] <= 128 and q.element_size() == kv_cache.element_size() == 2
            and triton.next_power_of_2(group) <= 4)


def plan_prefill(batch, max_query_len, max_seq_len, num_kv_heads, group, sms=132, pool_size=1, wide=False):
    """(config, splits) for a step, from host ints only (a plan never compiles anything the
    warm-up did not): the wide config where it fits (`wide`, from wide_fits) and its query tiles
    give two programs per SM, else the whole-key config where its tiles do, else the split config
    with enough key splits that the longest program (all keys) takes no longer than the average
    program's share of an SM, causal triangle and cached prefix counted."""
    whole, split = PREFILL_CONFIGS[0], _split_config(pool_size)
    g_pad = triton.next_power_of_2(group)
    n_keys = max(max_seq_len or 0, max_query_len)
    q_tiles = lambda cfg: triton.cdiv(max_query_len, _block_m(cfg.block_m, g_pad) // g_pad)  # noqa: E731
    if wide and batch * num_kv_heads * q_tiles(WIDE_CONFIG) >= 2 * sms:
        return WIDE_CONFIG, 1
    programs = batch * num_kv_heads * q_tiles(whole)
    if programs >= 2 * sms:
        return whole, 1
    mean_keys = n_keys - max_query_len / 2       # a query tile sees its prefix + half the chunk
    want = math.ceil(sms * n_keys / (programs * mean_keys))
    by_len = max(1, n_keys // (MIN_SPLIT_TILES * split.block_n))
    splits = max(1, min(want, by_len, MAX_SPLITS))
    # the kernel rounds a slice up to whole key tiles, which can leave the last slices empty:
    # count only those that hold keys (1 x 512: 5 slices of 128 keys, the fifth empty, ran
    # 0.95x SDPA flash; 4 ran 1.07x, H200, benchmarks/RESULTS.md)
    splits = triton.cdiv(n_keys, _slice_keys(n_keys, splits, split.block_n))
    return (split, splits) if splits > 1 else (whole, 1)


def _slice_keys(n_keys, splits, block_n):
    """Keys of one split's slice, as _prefill_kernel cuts them (`per`)."""
    return triton.cdiv(triton.cdiv(n_keys, splits), block_n) * block_n


def _block_m(block_m, g_pad):
    return max(block_m, 16 * g_pad if g_pad <= 8 else g_pad)  # >= 16 query tokens a tile
