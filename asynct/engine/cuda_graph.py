"""CUDA graphs for decode-only steps: one graph per batch size of a ladder up to max_num_seqs;
a step replays the smallest graph that holds it, padded with empty sequences. The attention
backend owns the static buffers of metadata and positions (init_capture / prepare_for_capture /
prepare_for_replay), which it sends from the host's step inputs: no metadata tensors are built.

Graphs of up to SAMPLING_MAX_BS sequences also run the LM head and the greedy argmax, into static
buffers: at such sizes a step is bound by launches, and eagerly the two cost the host ~100 us of
launch work a step and the GPU the gaps between them (H200, benchmarks/RESULTS.md). The argmax
goes into the graph's input ids, so a step whose rows continue the step before reads them
there, with no copy. Larger graphs leave the hidden states: their logits would hold
[max_num_seqs, vocab] for good."""
from typing import NamedTuple

import torch

from asynct import ops
from asynct.attention.base import host_to_device, host_to_device_many
from asynct.engine.context import reset_context, set_context

SAMPLING_MAX_BS = 32


class GraphLogits(NamedTuple):
    """A sampling graph's outputs: the rows' logits and their argmax (static buffers, which the
    next replay of any sampling graph overwrites)."""
    logits: torch.Tensor
    greedy: torch.Tensor


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def sampling_buffer_bytes(max_num_seqs: int, vocab_size: int, dtype: torch.dtype) -> int:
    """The static logits and argmax of the sampling graphs (the start-up profile counts them)."""
    return min(max_num_seqs, SAMPLING_MAX_BS) * (vocab_size * dtype.itemsize + 8)


def capture_graph(owner, fn) -> torch.cuda.CUDAGraph:
    """fn's launches as a graph in `owner.pool` (then the pool of every graph captured after),
    on `owner.stream`. capture_begin/end, not torch.cuda.graph: that one synchronises and
    empties the allocator's cache around every capture, which made most of the capture time of
    ~600 piecewise graphs (engine start 5.6 -> 3.5 s warm)."""
    graph = torch.cuda.CUDAGraph()
    owner.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(owner.stream):
        graph.capture_begin(*(() if owner.pool is None else (owner.pool,)))
        try:
            fn()
        finally:        # a failed fn must not leave the stream capturing
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(owner.stream)
    owner.pool = graph.pool()
    return graph


class CudaGraphRunner:
    def __init__(self, runner, max_num_seqs: int):
        self.backend, self.model = runner.backend, runner.model   # not the runner: no cycle
        self.sizes = batch_size_ladder(max_num_seqs)
        self.max_bs = self.sizes[-1]
        dev = self.device = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        rows = min(self.max_bs, SAMPLING_MAX_BS)
        self.logits = torch.empty(rows, runner.config.vocab_size, dtype=runner.dtype, device=dev)
        max_blocks = (runner.max_model_len + runner.block_size - 1) // runner.block_size
        runner.backend.init_capture(self.max_bs, max_blocks, runner.max_model_len, runner.block_size, dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # each graph's own output, written in place by every replay: copying it into one shared
        # buffer was a graph node of its own (2.6 us of a batch-1 step, H200)
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture()

    def forward(self, bs: int):
        """A graph's work: the model over the static inputs, then (sampling graphs) the LM head
        and the argmax, into the input ids."""
        hidden = self.model(self.input_ids[:bs], self.backend.graph_positions(bs))
        if bs > SAMPLING_MAX_BS:
            self.outputs[bs] = hidden
        else:
            ops.argmax(self.model.compute_logits(hidden, out=self.logits[:bs]), out=self.input_ids[:bs])

    @torch.inference_mode()
    def capture(self):
        self.pool, self.stream = None, torch.cuda.Stream()
        for bs in reversed(self.sizes):
            set_context(self.backend.prepare_for_capture(bs))
            self.forward(bs)   # warm-up
            # the capture's own metadata: the warm-up's keeps launches planned outside the graph's
            # memory pool (split partials, triton_backend's `launches`), which the graph would
            # go on reading and writing after they are freed
            set_context(self.backend.prepare_for_capture(bs))
            self.graphs[bs] = capture_graph(self, lambda bs=bs: self.forward(bs))
            reset_context()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()            # the warm-ups' blocks; the graphs keep their pool

    def replay(self, bs: int, metadata):
        """The graph reads `metadata` through its backend's static buffers; a runner that runs
        the work eagerly instead (the CPU tests of the sampling graphs) sets it as the context."""
        self.graphs[bs].replay()

    def can_run(self, step) -> bool:
        """A decode-only step (StepInputs) that a graph holds."""
        return step.num_decodes == len(step.query_lens) and 0 < step.num_decodes <= self.max_bs

    def run(self, step, ids: list[int], pending: list, last_sampled):
        """Replays the step (`ids` and `pending` as ModelRunner.step_inputs gives them); returns
        its final hidden states, or GraphLogits."""
        n = step.num_decodes
        bs = next(b for b in self.sizes if b >= n)
        self._send_input_ids(ids, pending, last_sampled)
        self.replay(bs, self.backend.prepare_for_replay(step, bs))
        if bs > SAMPLING_MAX_BS:
            return self.outputs[bs][:n]
        return GraphLogits(self.logits[:n], self.input_ids[:n])

    def _send_input_ids(self, ids, pending, last_sampled):
        """Rows that continue in their row of the step before take its samples (already in
        place where the graph's argmax made them); other rows' pending tokens are gathered
        before the host's ids overwrite a buffer they may be read from."""
        n = len(ids)
        dst, src = zip(*pending) if pending else ((), ())
        if dst == src == tuple(range(n)):
            if last_sampled.data_ptr() != self.input_ids.data_ptr():
                self.input_ids[:n].copy_(last_sampled[:n], non_blocking=True)
            return
        if pending:
            dst, src = host_to_device_many([(dst, torch.int64), (src, torch.int64)], self.device)
            tokens = last_sampled[src]
        self.input_ids[:n].copy_(host_to_device(ids, torch.int64, self.device), non_blocking=True)
        if pending:
            self.input_ids[dst] = tokens
