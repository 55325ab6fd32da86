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
# No 128-query config: 128 x 64 tiles of 8 warps three deep led at walks of 2K keys or more
# (H200, x SDPA flash: 1 x 8K 1.40 against 1.28) until the pool took its scores as an exact pair;
# since then the 64 x 32 config beats them there (H100, x SDPA flash: 1 x 8K 1.05 / 1.01, 2 x 4K
# 1.03-1.08 / 1.00-1.02, 4 x 2K 1.02-1.03 / 0.97-0.98; benchmarks/RESULTS.md).

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


def plan_prefill(batch, max_query_len, max_seq_len, num_kv_heads, group, sms=132, pool_size=1):
    """(config, splits) for a step, from host ints only (a plan never compiles anything the
    warm-up did not): the pool's 64-query config, unsplit where its tiles give two programs an
    SM, else with enough key splits that the longest program (all keys) takes no longer than
    the average program's share of an SM, causal triangle and cached prefix counted."""
    cfg, g_pad = key_config(pool_size), next_power_of_2(group)
    n_keys = max(max_seq_len or 0, max_query_len)
    programs = batch * num_kv_heads * cdiv(max_query_len, _block_m(cfg.block_m, g_pad) // g_pad)
    if programs >= 2 * sms:
        return cfg, 1
    mean_keys = n_keys - max_query_len / 2       # a query tile sees its prefix + half the chunk
    want = math.ceil(sms * n_keys / (programs * mean_keys))
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
