"""Every sequence's block table as one row of an int32 array on the host, written as blocks are
taken. A step's tables are then one gather of rows, where converting each sequence's Python list
took 15 % of a gsm8k decode step's host time (220 rows of ~63 blocks, H100 host, py-spy)."""
import numpy as np

from asynct.engine.sequence import Sequence


class HostBlockTables:
    def __init__(self, rows: int = 64, width: int = 64):
        self.array = np.zeros((rows, width), dtype=np.int32)
        self.free_rows = list(range(rows - 1, -1, -1))   # popped from the end: low rows first

    def extend(self, seq: Sequence, start: int):
        """Writes seq.block_table[start:], the blocks just appended, into its row (taken now if
        it has none)."""
        if seq.table_row < 0:
            seq.table_row = self._take_row()
        n = len(seq.block_table)
        if n > self.array.shape[1]:
            self._grow(width=max(n, 2 * self.array.shape[1]))
        self.array[seq.table_row, start:n] = seq.block_table[start:]

    def release(self, seq: Sequence):
        """The sequence's blocks were freed: its row, zeroed, is free for another."""
        if seq.table_row >= 0:
            self.array[seq.table_row] = 0
            self.free_rows.append(seq.table_row)
            seq.table_row = -1

    def gather(self, seqs: list[Sequence]) -> np.ndarray:
        """The sequences' tables, zero-padded to the longest: [len(seqs), longest] int32."""
        width = max((len(s.block_table) for s in seqs), default=1) or 1
        return self.array[[s.table_row for s in seqs], :width]

    def _take_row(self) -> int:
        if not self.free_rows:
            rows = self.array.shape[0]
            self._grow(rows=2 * rows)
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def _grow(self, rows: int | None = None, width: int | None = None):
        old = self.array
        self.array = np.zeros((rows or old.shape[0], width or old.shape[1]), dtype=np.int32)
        self.array[:old.shape[0], :old.shape[1]] = old
