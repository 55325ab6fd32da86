"""What the repetition, frequency and presence penalties read: each penalised sequence's
output-token counts in a row of one device buffer, kept for as long as the sequence lives, and
its prompt's tokens (the repetition penalty's) in a row of another.

A step adds only the output tokens the host received since the step before (one a step while
decoding) and, for that step alone, the token still pending on the device (async scheduling).
Rebuilding the counts every step from the host's token lists (a sort of every seen token, ~30
kernels, 3-4 uploads) took 0.77 ms of host time a step: a penalised batch-1 step ran 1.7 ms
against 0.86 (H200). Row 0 stays zero: it stands for the rows of a step without penalties."""
import weakref

import numpy as np
import torch

from asynct.attention.base import host_to_device


class PenaltyCounts:
    def __init__(self, rows_hint: int = 0):
        # the rows it grows to at once (max_num_seqs + 1 in an engine: every running sequence
        # penalised); doubling past it made 512 rows of 257 live (390 MB at a 152k vocabulary)
        self.rows_hint = rows_hint
        self.counts = None                 # int32 [slots, vocab]
        self.in_prompt = None              # bool [slots, vocab], made for the first repetition penalty
        # weak references to the sequence holding each row (row 0: nobody, ever): a finished
        # sequence's tokens and logprobs are not kept alive until another takes its row
        self.owner: list = [None]
        self.counted: list[int] = [0]      # how many of its output tokens the row holds
        self.row_of = weakref.WeakKeyDictionary()   # sequence -> row
        self._ones = None

    def full_bytes(self, vocab: int) -> int:
        """What the counts and prompt marks hold at rows_hint rows: once every running sequence
        was penalised they stay that size (rows never shrink)."""
        return self.rows_hint * vocab * (torch.int32.itemsize + torch.bool.itemsize)

    def rows(self, seqs, vocab: int, device) -> list[int]:
        """Each sequence's row (0 for those without penalties); a new one starts zeroed."""
        if self.counts is None:
            self._grow(8, vocab, device)
        return [self._row(s) if s.params.penalised else 0 for s in seqs]

    def new_tokens(self, seqs, rows: list[int]) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Flat indices (row * vocab + token) of the output tokens the host received since the
        step before, and (row, output tokens) for `add` to record: the rows hold them only once
        they are added (a step that raises before, then run one by one, sends them again)."""
        vocab, parts, upto = self.counts.shape[1], [], []
        for seq, row in zip(seqs, rows):
            start = seq.num_prompt_tokens + self.counted[row]
            if row and len(seq.token_ids) > start:
                parts.append(np.asarray(seq.token_ids[start:], dtype=np.int64) + row * vocab)
                upto.append((row, seq.num_output_tokens))
        return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), upto

    def add(self, flat: torch.Tensor, upto=()):
        """+1 at each flat index of the counts; repeats add up. `upto`: new_tokens' rows, which
        hold their tokens from now on."""
        self.counts.view(-1).index_add_(0, flat, self.ones(flat.shape[0]))
        for row, n in upto:
            self.counted[row] = n

    def ones(self, n: int) -> torch.Tensor:
        if self._ones is None or self._ones.shape[0] < n:
            self._ones = torch.ones(max(n, 256), dtype=torch.int32, device=self.counts.device)
        return self._ones[:n]

    def _row(self, seq) -> int:
        row = self.row_of.get(seq)
        if row is None:
            row = self._free_row()
            self.counts[row].zero_()
            # rows without a repetition penalty divide by 1: their prompt marks change nothing
            if seq.params.repetition_penalty != 1:
                self._mark_prompt(row, seq)
            # taken once ready: a step that raises before leaves the row free, to be made again
            self.owner[row], self.counted[row], self.row_of[seq] = weakref.ref(seq), 0, row
        return row

    def _free_row(self) -> int:
        for row, ref in enumerate(self.owner[1:], 1):
            seq = ref and ref()
            if seq is None or seq.is_finished:
                if seq is not None:
                    self.row_of.pop(seq, None)
                return row
        n = len(self.owner)
        more = min(2 * n, self.rows_hint) if n < self.rows_hint else n + max(8, n // 4)
        self._grow(more, self.counts.shape[1], self.counts.device)
        return n

    def _grow(self, n: int, vocab: int, device):
        def grown(old, dtype):
            new = torch.zeros(n, vocab, dtype=dtype, device=device)
            if old is not None:
                new[:old.shape[0]] = old
            return new
        self.counts = grown(self.counts, torch.int32)
        if self.in_prompt is not None:
            self.in_prompt = grown(self.in_prompt, torch.bool)
        self.owner += [None] * (n - len(self.owner))
        self.counted += [0] * (n - len(self.counted))

    def _mark_prompt(self, row: int, seq):
        if self.in_prompt is None:
            self.in_prompt = torch.zeros(self.counts.shape, dtype=torch.bool, device=self.counts.device)
        self.in_prompt[row].zero_()
        ids = host_to_device(sorted(set(seq.token_ids[:seq.num_prompt_tokens])), torch.long, self.counts.device)
        # index_fill_, not `[row, ids] = True`: a Python value goes to the device by a copy that
        # waits for the step in flight
        self.in_prompt[row].index_fill_(0, ids, True)
