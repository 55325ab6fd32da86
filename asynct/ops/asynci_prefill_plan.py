"""The launch plan of paged AsyncI prefill (asynci_prefill.py): which tile config and how many key
splits a step's shape gets, from host ints alone, so that a plan never picks a kernel variant
the warm-up did not compile."""
import math
from collections import namedtuple

from asynct.ops._triton import cdiv, next_power_of_2

PrefillConfig = namedtuple("PrefillConfig", "block_m block_n num_warps num_stages")

# The tile configs the launch plan picks from. 32-key tiles, three deep, whether or not the keys
# are split (H200, x SDPA flash against 64-key tiles two deep, queries' tiles in the kernel's
# longest-first order: 8 x 512 1.27 / 1.16, 1 x 4K 1.61 / 1.57, 16 x 1K 1.01 / 0.97; split at 2K
# 1.42 / 1.32); a pool wider than 33 keys needs the 64-key tile (the band products reach back one
# key tile only). Since the kernel finds a tile's cache rows one tile ahead, stages past two
# buffer deeper.
PREFILL_CONFIGS = (PrefillConfig(64, 32, 4, 3), PrefillConfig(64, 64, 4, 2))
# Long walks where the 128-query tiles still fill the SMs: 8 warps, three deep, unsplit. H200, x
# SDPA flash against the 32-key config: 1 x 4K 1.75 / 1.61, 1 x 8K 1.40 / 1.28, 2 x 4K 1.39 / 1.30,
# 4 x 2K 1.28 / 1.24; at 1K keys equal (8 x 1K 1.19 / 1.20), at 512 it loses (8 x 512 1.19 / 1.27),
# and with one program an SM or fewer too (1 x 2K unsplit 1.06, against 1.42 split). It needs 160 KB
# of shared memory at head_dim 128 in bf16: not at 256 (288 KB) nor with fp32 queries (320 KB);
# past a GQA group of 4 its tile holds no more queries than the 64-query configs'.
WIDE_CONFIG = PrefillConfig(128, 64, 8, 3)
WIDE_MIN_KEYS = 2048
# The K/V of a group of sequences whose query tiles run longest first, groups one after another
# (H200, x SDPA flash, groups of <= 16 MB against all sequences in one: 64 x 512 0.98 / 0.88,
# 128 x 256 1.02 / 0.92, 32 x 1K 0.93 / 0.89, 16 x 2K 0.99 / 0.95; one group is what <= 16 MB
# gets: 8 x 512 1.27, 4 x 1K 1.41; equal groups, not a short last one: an engine's prefill
# steps of ~16 x 500 tokens 29.5 against 33.8 ms of attention, benchmarks/RESULTS.md)
GROUP_KV_BYTES = 16 << 20
MAX_SPLITS = 8
MIN_SPLIT_TILES = 2     # key tiles per split at least: a halo costs about one tile


def key_config(pool_size):
    """The 64-query config whose key tiles the pool's band reaches back over."""
    short, long_ = PREFILL_CONFIGS
    return short if pool_size - 1 <= short.block_n else long_


def wide_fits(q, kv_cache):
    """Whether WIDE_CONFIG serves these queries [T, Hq, D] and cache [2, blocks, BS, Hkv, D]: 16-bit
    both (measured only so: an FP8 cache reads its keys otherwise), D <= 128, groups <= 4."""
    group = q.shape[1] // kv_cache.shape[3]
    return (q.shape[2] <= 128 and q.element_size() == kv_cache.element_size() == 2
            and next_power_of_2(group) <= 4)


def plan_prefill(batch, max_query_len, max_seq_len, num_kv_heads, group, sms=132, pool_size=1, wide=False):
    """(config, splits) for a step, from host ints only (a plan never compiles anything the
    warm-up did not): the wide config where it fits (`wide`, from wide_fits), the walks are long
    and its query tiles give 1.5 programs an SM, else the pool's 64-query config: unsplit where
    its tiles give two programs an SM, else with enough key splits that the longest program (all
    keys) takes no longer than the average program's share of an SM, causal triangle and cached
    prefix counted."""
    cfg, g_pad = key_config(pool_size), next_power_of_2(group)
    n_keys = max(max_seq_len or 0, max_query_len)
    programs = lambda c: batch * num_kv_heads * cdiv(max_query_len, _block_m(c.block_m, g_pad) // g_pad)  # noqa: E731
    if wide and n_keys >= WIDE_MIN_KEYS and programs(WIDE_CONFIG) >= 1.5 * sms:
        return WIDE_CONFIG, 1
    if programs(cfg) >= 2 * sms:
        return cfg, 1
    mean_keys = n_keys - max_query_len / 2       # a query tile sees its prefix + half the chunk
    want = math.ceil(sms * n_keys / (programs(cfg) * mean_keys))
    by_len = max(1, n_keys // (MIN_SPLIT_TILES * cfg.block_n))
    splits = max(1, min(want, by_len, MAX_SPLITS))
    # the kernel rounds a slice up to whole key tiles, which can leave the last slices empty:
    # count only those that hold keys (1 x 512: 5 slices of 128 keys, the fifth empty, ran
    # 0.95x SDPA flash; 4 ran 1.07x, H200, benchmarks/RESULTS.md)
    return cfg, cdiv(n_keys, _slice_keys(n_keys, splits, cfg.block_n))


def seqs_per_group(batch, q_tiles, seq_kv_bytes):
    """Sequences the prefill kernel takes as one group (its grid's first axis): groups of equal
    size (no short last group) whose K/V (`seq_kv_bytes` a sequence at most) fits in
    GROUP_KV_BYTES, one sequence at least, and few enough that the grid's last axis (groups x
    query tiles) stays within CUDA's 65,535."""
    fits = max(1, GROUP_KV_BYTES // max(seq_kv_bytes, 1))
    group = cdiv(batch, cdiv(batch, fits))
    return min(batch, max(group, cdiv(batch, max(1, 65535 // q_tiles))))


def _slice_keys(n_keys, splits, block_n):
    """Keys of one split's slice, as _prefill_kernel cuts them (`per`)."""
    return cdiv(cdiv(n_keys, splits), block_n) * block_n


def _block_m(block_m, g_pad):
    return max(block_m, 16 * g_pad if g_pad <= 8 else g_pad)  # >= 16 query tokens a tile
