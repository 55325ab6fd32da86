"""Continuous batching: each step is one mixed batch, running decodes first, then prefill chunks
filling the token budget. When blocks run out, the newest sequences are preempted (recomputed)."""
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from asynct.engine.block_manager import BlockManager
from asynct.engine.block_table import HostBlockTables
from asynct.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]        # decodes (one token) first
    num_tokens: list[int]       # tokens each sequence computes this step
    num_decodes: int
    num_prompt_tokens: int = 0  # of those, prompt positions (a one-token prompt is a "decode" above)
    block_table: np.ndarray | None = None   # [len(seqs), longest] int32, zero-padded

    @classmethod
    def of(cls, picked: list[tuple[Sequence, int]], tables: HostBlockTables) -> "ScheduledBatch":
        """Sequences with the tokens each computes; one-token queries (decodes) first, stably."""
        picked = sorted(picked, key=lambda p: p[1] != 1)
        seqs = [s for s, _ in picked]
        prompt_tokens = sum(_prompt_part(s, n) for s, n in picked if s.num_computed_tokens < s.num_prompt_tokens)
        return cls(seqs, [n for _, n in picked], sum(1 for _, n in picked if n == 1), prompt_tokens,
                   tables.gather(seqs))

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == len(self.seqs)

    @property
    def sampling_rows(self) -> list[int]:
        """The rows that sample: those whose step reaches their last known token."""
        return [i for i, (s, n) in enumerate(zip(self.seqs, self.num_tokens))
                if s.num_computed_tokens + n >= len(s) + s.num_pending_tokens]


def _prompt_part(seq: Sequence, n: int) -> int:
    """How many of the next `n` tokens `seq` computes are prompt tokens."""
    return max(0, min(seq.num_computed_tokens + n, seq.num_prompt_tokens) - seq.num_computed_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 admission_batch: int = 1, max_model_len: int | None = None):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.admission_batch = admission_batch
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # an insertion-ordered set, not a deque: an abort takes a sequence from anywhere in it in
        # O(1) (a deque's remove scans: aborting 20,000 queued requests newest first took 5.9 s)
        self.waiting: OrderedDict[Sequence, None] = OrderedDict()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence):
        self.waiting[seq] = None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING or self._ends_with_pending(seq):
                continue   # preempted earlier in this loop, or its last token is on the device
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.holds(seq, n):    # most decode steps: no block to take
                if not self._make_room(seq, n):
                    continue
                self.block_manager.allocate(seq, n)
            picked.append((seq, n))
            if n > 1:   # a prompt's chunk: a prompt admitted below may share its blocks
                self.block_manager.commit_full_blocks(seq, n)
            budget -= n
        admitting = self._admitting()
        while admitting and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            n = self._admit(next(iter(self.waiting)), budget)
            if not n:
                break
            picked.append((self.running[-1], n))
            budget -= n
        return ScheduledBatch.of(picked, self.block_manager.tables)

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """A token still on the device that reaches max_tokens or max_model_len ends the
        sequence: scheduling another would compute a token no output may hold."""
        if not seq.num_pending_tokens:
            return False
        p, length = seq.params, len(seq.token_ids) + seq.num_pending_tokens
        return ((p.max_tokens is not None and length - seq.num_prompt_tokens >= p.max_tokens)
                or (self.max_model_len is not None and length >= self.max_model_len))

    def _admitting(self) -> bool:
        """New sequences join in groups: a step with prefill runs without a CUDA graph and costs
        several decode steps, so refilling one freed slot per step is the slow way to go."""
        free = self.max_num_seqs - len(self.running)
        return free >= min(self.admission_batch, len(self.waiting))

    def _admit(self, seq: Sequence, budget: int) -> int:
        if seq.num_pending_tokens:   # preempted with a token on the device: next step
            return 0
        bm = self.block_manager
        hits = bm.match_prefix(seq)
        n = min(len(seq) - len(hits) * bm.block_size, budget)
        if not bm.can_allocate(seq, n, hits):
            return 0
        del self.waiting[seq]
        bm.record_prefix_query(seq, hits)
        bm.allocate(seq, n, hits)
        bm.commit_full_blocks(seq, n)    # the n samples of a request, a repeated prompt: share them now
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return n

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Preempts the newest running sequences until `seq` can grow; False if `seq` itself went."""
        while not self.block_manager.can_allocate(seq, n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence):
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting[seq] = None
        self.waiting.move_to_end(seq, last=False)
        self.num_preemptions += 1

    def retract(self, batch: ScheduledBatch):
        """`batch` failed to launch, so the blocks it published while scheduled hold no K/V:
        their hashes are taken back, and the sequences that took them as hits wait again, to
        find them once their owners (run alone) have computed them."""
        bm = self.block_manager
        retracted = set().union(*(bm.retract_uncomputed(s) for s in batch.seqs))
        for seq in reversed(batch.seqs):    # each goes to the queue's front: kept in their order
            if retracted.intersection(seq.block_table[:seq.num_computed_tokens // bm.block_size]):
                self.preempt(seq)

    def finish(self, seq: Sequence, reason: str):
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if seq in self.waiting:
            del self.waiting[seq]
        elif seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
