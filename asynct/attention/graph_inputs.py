"""A decode graph's host-written inputs in one device buffer, sent in one copy a step.

A graph reads fixed addresses, so before each replay a step's positions, slots, sequence lengths,
shared-prefix length and block-table rows must be there. Built as metadata tensors and then
copied into the static buffers, they were seven memcpys on the stream between two batch-1
steps, ~2 us each (H200, benchmarks/RESULTS.md). Here the host packs them into one pinned
buffer: one host-to-device copy, then one device copy of the block-table rows into the graph's
wide table (its rows are max_blocks apart; the step's are only as wide as its longest).
Rows past the step's are empty sequences: length 0, slot -1, position 0; the rows' decode order
(triton_backend.DECODE_ORDER_MIN_ROWS) is sent only for graphs that read it."""
import numpy as np
import torch

from asynct.attention.base import StepInputs

# (name, dtype, one entry or one a row); each part starts 16-byte aligned: Triton specialises a
# pointer on its 16-byte alignment
_PARTS = (("positions", np.int64, False), ("slot_mapping", np.int64, False), ("seq_lens", np.int32, False),
          ("decode_order", np.int32, False), ("prefix_len", np.int32, True))
_TORCH = {np.int64: torch.int64, np.int32: torch.int32}


def longest_first(seq_lens, num_rows: int) -> np.ndarray:
    """The rows [0, num_rows) by length, longest first (ties in row order): the step's sequences
    are the first len(seq_lens) of them, the rest (a graph's empty rows) keep their places."""
    order = np.arange(num_rows, dtype=np.int32)
    order[:len(seq_lens)] = np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable")
    return order


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


class GraphStepInputs:
    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device):
        self.layout, offset = {}, 0
        for name, dtype, single in _PARTS:
            count = 1 if single else max_batch_size
            self.layout[name] = (offset, count, dtype)
            offset = _aligned(offset + count * np.dtype(dtype).itemsize)
        self.table_offset = offset          # the step's block-table rows are staged after the parts
        self.buffer = torch.zeros(offset + max_batch_size * max_blocks_per_seq * 4, dtype=torch.uint8,
                                  device=device)
        for name, (start, count, dtype) in self.layout.items():
            view = self.buffer[start:start + count * np.dtype(dtype).itemsize].view(_TORCH[dtype])
            setattr(self, name, view)
        self.slot_mapping.fill_(-1)
        self.decode_order.copy_(torch.arange(max_batch_size, dtype=torch.int32))
        self.block_table = torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device)

    def send(self, step: StepInputs, table: np.ndarray, prefix_len: int, order: np.ndarray | None = None):
        """Packs a decode-only step (`table`: its block tables as one int32 array; `order`: the
        graph's rows in decode order, longest_first) and queues the copies without waiting for
        the device."""
        n, width = table.shape
        staged = torch.empty(self.table_offset + table.nbytes, dtype=torch.uint8, pin_memory=self.buffer.is_cuda)
        host = staged.numpy()       # packed in place: no second copy into pinned memory
        host[:self.table_offset] = 0
        part = self._host_views(host)
        part["seq_lens"][:n] = step.seq_lens
        part["positions"][:n] = part["seq_lens"][:n] - 1     # a decode token's position
        part["slot_mapping"][:] = -1
        part["slot_mapping"][:n] = step.slot_mapping
        part["prefix_len"][0] = prefix_len
        if order is not None:
            part["decode_order"][:len(order)] = order
        host[self.table_offset:] = table.reshape(-1).view(np.uint8)
        self.buffer[:host.nbytes].copy_(staged, non_blocking=True)
        rows = self.buffer[self.table_offset:host.nbytes].view(torch.int32).view(n, width)
        self.block_table[:n, :width].copy_(rows, non_blocking=True)

    def _host_views(self, host: np.ndarray) -> dict:
        return {name: host[start:start + count * np.dtype(dtype).itemsize].view(dtype)
                for name, (start, count, dtype) in self.layout.items()}
