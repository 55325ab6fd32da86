"""KV-cache blocks: reference counts and prefix caching by chained hashes of full blocks."""
import hashlib
from array import array
from collections import OrderedDict

from asynct.engine.block_table import HostBlockTables
from asynct.engine.sequence import Sequence


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: tuple = ()


NO_HASH = b""   # the key before a sequence's first block, and a block holding no cached prefix


def chain_hash(prev_hash: bytes, token_ids) -> bytes:
    """SHA-256 of the previous block's key and this block's tokens. A block is served by its own
    tokens and this key of everything before it, so a collision would hand one prompt another's
    KV: Python's 64-bit tuple hash can be forced to collide (ints are reduced mod 2**61 - 1), a
    256-bit digest cannot."""
    return hashlib.sha256(prev_hash + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.capacity = num_blocks
        # made as first taken, in id order, before any freed one: a small model's cache on a big
        # GPU is millions of blocks (a tiny one on an H200: 15M, 12 s and 4 GB of objects)
        self.blocks: list[Block] = []
        # the freed blocks, an insertion-ordered set: O(1) removal of a cached block that gets
        # reused, and the oldest is taken first, so recently freed prefixes stay cached longest
        self.free_block_ids: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block_id: dict[bytes, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queries = self.num_hits = 0      # prefix-cache hit rate, in blocks
        self.tables = HostBlockTables()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + self.num_never_taken

    @property
    def num_never_taken(self) -> int:
        return self.capacity - len(self.blocks)

    @property
    def num_blocks(self) -> int:
        return self.capacity

    def _take_free_block(self) -> Block:
        if self.num_never_taken:
            self.blocks.append(Block(len(self.blocks)))
            self.blocks[-1].ref_count = 1
            return self.blocks[-1]
        bid, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[bid]
        if block.hash and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]   # evict the cached contents it held
        block.hash, block.token_ids, block.ref_count = NO_HASH, (), 1
        return block

    def _cached_block(self, h: bytes, token_ids) -> Block | None:
        bid = self.hash_to_block_id.get(h)
        if bid is None or self.blocks[bid].token_ids != tuple(token_ids):
            return None
        return self.blocks[bid]

    def match_prefix(self, seq: Sequence) -> list[Block]:
        """Cached full blocks of the prompt's cacheable tokens (Sequence.num_cacheable_tokens)."""
        if not self.enable_prefix_caching:
            return []
        hits, h = [], NO_HASH
        for i in range(seq.num_cacheable_tokens // self.block_size):
            h = chain_hash(h, seq.block(i))
            block = self._cached_block(h, seq.block(i))
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_needed(self, seq: Sequence, num_tokens: int, hits: list[Block]) -> int:
        """Free blocks that computing `num_tokens` more tokens takes (hits sitting in the free
        list count too: taking them removes them from it)."""
        computed = seq.num_computed_tokens + len(hits) * self.block_size
        total = (computed + num_tokens + self.block_size - 1) // self.block_size
        new = total - len(seq.block_table) - len(hits)
        return new + sum(1 for b in hits if b.ref_count == 0)

    def holds(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the sequence's blocks already hold `num_tokens` more (15 of a decode's 16 steps)."""
        return seq.num_computed_tokens + num_tokens <= len(seq.block_table) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[Block] = ()) -> bool:
        return self.blocks_needed(seq, num_tokens, hits) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[Block] = ()):
        """Takes the prefix hits (first scheduling only), then fresh blocks for `num_tokens`."""
        start = len(seq.block_table)
        if hits:
            for block in hits:
                if block.ref_count == 0:
                    del self.free_block_ids[block.block_id]
                block.ref_count += 1
                seq.block_table.append(block.block_id)
                seq.block_hashes.append(block.hash)
            seq.num_computed_tokens = len(hits) * self.block_size
            if not seq.num_preemptions:   # a recompute's hits are mostly its own blocks, no shared prefix
                seq.num_cached_tokens = seq.num_computed_tokens
        need = (seq.num_computed_tokens + num_tokens + self.block_size - 1) // self.block_size
        while len(seq.block_table) < need:
            seq.block_table.append(self._take_free_block().block_id)
        if len(seq.block_table) > start:
            self.tables.extend(seq, start)

    def record_prefix_query(self, seq: Sequence, hits: list[Block]):
        """The hit rate counts a request's first scheduling only, as vLLM's: a recompute mostly
        re-takes its own blocks, and counted, memory pressure read as prefix sharing."""
        if seq.num_preemptions:
            return
        self.num_queries += seq.num_cacheable_tokens // self.block_size
        self.num_hits += len(hits)

    def commit_full_blocks(self, seq: Sequence, num_scheduled: int = 0):
        """Publishes the hashes of blocks that are full once the computed tokens and the
        `num_scheduled` more of the step being scheduled are, so later prompts can share them,
        even in the same step: a step writes every row's K/V before any row's attention reads
        it (vLLM's parallel samples share their prompt so). A step that fails to launch takes
        them back (retract_uncomputed)."""
        # tokens still on the device wait; called twice for every row of every step (at launch
        # and at finish), so the common case (no block newly full) returns before anything else
        full = min(seq.num_computed_tokens + num_scheduled, len(seq.token_ids)) // self.block_size
        if full <= len(seq.block_hashes) or not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), full):
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else NO_HASH, seq.block(i))
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if not block.hash:
                block.hash, block.token_ids = h, tuple(seq.block(i))
                self.hash_to_block_id.setdefault(h, block.block_id)

    def retract_uncomputed(self, seq: Sequence) -> set[int]:
        """Takes back the hashes published for blocks past the computed tokens (a step that
        failed to launch was to fill them); returns their ids."""
        keep = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        retracted = set()
        for i in range(keep, len(seq.block_hashes)):
            block = self.blocks[seq.block_table[i]]
            if self.hash_to_block_id.get(block.hash) == block.block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = NO_HASH, ()
            retracted.add(block.block_id)
        del seq.block_hashes[keep:]
        return retracted

    def free(self, seq: Sequence):
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[bid] = None
        self.tables.release(seq)
        seq.block_table = []
        seq.block_hashes = []

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0
