"""The model runner's start-up half: the KV cache, the warm-up that compiles every kernel before
serving (in parallel, on a fresh machine), the activation-memory profile and the CUDA-graph
captures. ModelRunner (model_runner.py) is the step half."""
import logging
import os
import time

import torch

from asynct import ops
from asynct.attention import StepInputs
from asynct.engine.cuda_graph import CudaGraphRunner, sampling_buffer_bytes
from asynct.engine.piecewise_graph import PiecewiseGraphRunner
from asynct.engine.sampling_profile import profiled_row_counts, sample_dummy_rows
from asynct.ops.argmax import warmup_argmax
from asynct.ops.sampling_draw import warmup_draw
from asynct.ops.sampling_filters import warmup_filter_threshold
from asynct.ops.penalties import warmup_penalties

log = logging.getLogger("asynct")

# the warm-up's last forward: just past the decode-sized fused linears (a cache smaller than
# this can never hold such a step, so the warm-up stops at its size)
WARMUP_TOKENS = ops.SMALL_M + 1


def warmup_token_counts() -> list[int]:
    """The warm-up's forwards, in tokens: every count the fused linears' CUDA-core path may take
    (1 to GEMV_MAX_ROWS: each has its warps), the first past it and each larger row tile's size
    (every op's dot tiles at every row tile; an op the GEMV serves at fewer rows reaches its
    16-row tiles at that first count too), one past SMALL_M (the unfused ops). Every step stores
    its keys in the QKV projection's kernels, piecewise graphs' pieces too: no QKV call without
    the store is made."""
    first_dot = ops.GEMV_MAX_ROWS + 1
    gemv_and_dots = [*range(1, first_dot + 1), *(t for t in ops.ROW_TILES if t > first_dot)]
    return sorted({*gemv_and_dots, WARMUP_TOKENS})


def warmup_decode_counts() -> list[int]:
    """The warm-up's decode-only steps, in sequences: every count the fused linears' CUDA-core
    path serves, where a backend may take a decode its own way (the Triton backend's adds into
    fp32 sums that the QKV projection zeroes and o_proj reads: DECODE_SUMS_MAX_ROWS)."""
    return list(range(1, ops.GEMV_MAX_ROWS + 1))


def compile_workers() -> int:
    """Compile processes (and threads) for the compile pass: the cores this process may run on
    (a container's affinity, not the host's count), at most 32 (a bench-0.6b start compiles 55
    kernels; each process is forked whether it gets one or not)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 4
    return max(1, min(cores, 32))


class RunnerStartup:
    """ModelRunner's start-up methods; they read its config, device, dtype, model, backend and
    block sizes."""

    # ---- KV cache -------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        c = self.config
        return (2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim
                * self.kv_dtype.itemsize)

    def allocate_kv_cache(self, num_blocks: int, capture: bool = True):
        c = self.config
        shape = self.backend.get_kv_cache_shape(num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        self.kv_cache = torch.empty(c.num_hidden_layers, *shape, dtype=self.kv_dtype, device=self.device)
        self.num_kv_blocks = num_blocks
        for i, layer in enumerate(self.model.layers):
            layer.attn.kv_cache = self.kv_cache[i]
        if capture and self.device.type == "cuda":
            self._warmup()
            self.warmup_logits()
        self.capture_seconds = {"decode_graphs": 0.0, "piecewise_graphs": 0.0}
        self.decode_graphs_pending = capture and self.cudagraph_mode != "none"
        if self.decode_graphs_pending and not self.lazy_decode_graphs:
            self.capture_decode_graphs()
        t0 = time.perf_counter()
        if capture and self.cudagraph_mode == "full_and_piecewise":
            self.piecewise = PiecewiseGraphRunner(self, self.max_num_batched_tokens)
        self.capture_seconds["piecewise_graphs"] = time.perf_counter() - t0

    def capture_decode_graphs(self):
        """At start-up, or (lazy_decode_graphs) before the first decode-only step. Capture writes
        no KV (its slots are -1), so the cache's live sequences are safe mid-run."""
        t0 = time.perf_counter()
        self.decode_graphs_pending = False       # one try: a failed capture is not retried each step
        try:
            self.graphs = CudaGraphRunner(self, self.max_num_seqs)
        except Exception:   # noqa: BLE001  (at start-up the start's error; mid-run, decode goes on eagerly)
            if not self.lazy_decode_graphs:
                raise
            log.warning("capturing the decode graphs failed; decode steps run eagerly", exc_info=True)
        self.capture_seconds["decode_graphs"] = time.perf_counter() - t0

    def _compile_ahead(self):
        """Compiles every kernel of the warm-up at once, in parallel (a fresh machine has no
        Triton cache: one by one, they were most of the engine's start-up), through one layer of
        each signature: the other layers' launches would compile nothing new."""
        from asynct.ops._triton import triton
        from asynct.ops.compile_pass import compile_only
        if triton is None:
            return
        with compile_only(compile_workers()), self.model.only_layers(self.model.distinct_layers()):
            self.allocate_kv_cache(-(-WARMUP_TOKENS // self.block_size), capture=False)
            self._warmup()
        self._release_kv_cache()

    @torch.inference_mode()
    def _warmup(self):
        """Every kernel compiles now, not in the middle of serving: the attention variants no
        forward reaches (first: in the compile pass, the longest compiles start first), forwards
        of warmup_token_counts, small decode steps, the penalties', the argmax's, the sampling
        filters' and the draw's kernels."""
        self.backend.warmup(self.model.layers[0].attn.impl, self.kv_cache[0], self.dtype)
        for n in warmup_token_counts():
            n = min(n, self.num_kv_blocks * self.block_size)
            blocks = list(range(-(-n // self.block_size)))
            step = StepInputs([n], [n], [blocks], list(range(n)), 0)
            positions = torch.arange(n, device=self.device) % self.config.max_position_embeddings   # RoPE's rows
            self._forward(torch.zeros(n, dtype=torch.long, device=self.device), positions, self.builder.build(step))
        for n in warmup_decode_counts():   # a backend may take small decode steps its own way
            step = StepInputs([1] * n, [1] * n, [[0]] * n, [-1] * n, n)
            self._forward(torch.zeros(n, dtype=torch.long, device=self.device),
                          torch.zeros(n, dtype=torch.long, device=self.device), self.builder.build(step))
        warmup_penalties(self.config.vocab_size, self.device)
        warmup_argmax(self.config.vocab_size, self.dtype, self.device)
        warmup_filter_threshold(self.config.vocab_size, self.dtype, self.device)
        warmup_draw(self.config.vocab_size, self.dtype, self.device)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def warmup_logits(self):
        """The LM head at every row count an eager step may give it: a mixed step samples 1 to
        max_num_seqs rows, prompt logprobs score slices of as many. cuBLAS picks its kernel by
        the count and CUDA loads a kernel at its first launch, where the host waited for the
        device: a process's first throughput run launched its mixed steps in their GPU time (H100:
        ~21 ms, 9 of it in that matmul, against 5-9 ms in a second run; benchmarks/RESULTS.md).
        The decode graphs' counts load at their capture. ~256 matmuls: tens of ms. Largest
        first, so that each count's logits fit in the first one's freed block (rising, every
        count took a new one: gigabytes held at a 152k vocabulary)."""
        most = min(self.max_num_seqs, self.max_num_batched_tokens)   # a step's rows at most
        hidden = torch.zeros(most, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for rows in range(most, 0, -1):
            self.model.compute_logits(hidden[:rows])
        del hidden
        torch.cuda.empty_cache()

    def profile_step(self) -> StepInputs:
        """The largest prefill step: the token budget as prompts of at most max_model_len tokens
        (at most max_num_seqs of them) on consecutive blocks; one-token prompts first, as the
        scheduler orders decode-sized queries."""
        per_seq, bs = self.max_model_len, self.block_size
        total = min(self.max_num_batched_tokens, self.max_num_seqs * per_seq)
        lens = sorted((min(per_seq, total - a) for a in range(0, total, per_seq)), key=lambda n: n != 1)
        tables, slots, first = [], [], 0
        for n in lens:
            tables.append(list(range(first, first + -(-n // bs))))
            slots.extend(first * bs + i for i in range(n))
            first += len(tables[-1])
        return StepInputs(lens, lens, tables, slots, lens.count(1))

    @torch.inference_mode()
    def profile_activation_memory(self) -> int:
        """Peak bytes a full-budget step needs beyond the weights (over a scratch cache): its
        prefill's forward, beside the penalty counts a run keeps once penalised, or the sampling
        of a full batch of rows from its hidden states, which stay alive meanwhile; and the
        decode graphs' static logits, allocated after the cache."""
        step = self.profile_step()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        self.allocate_kv_cache(sum(len(t) for t in step.block_tables), capture=False)
        torch.cuda.reset_peak_memory_stats(self.device)
        positions = [p for n in step.query_lens for p in range(n)]
        hidden = self._forward(torch.zeros(len(positions), dtype=torch.long, device=self.device),
                               torch.tensor(positions, device=self.device), self.builder.build(step))
        forward = torch.cuda.max_memory_allocated(self.device) - base
        for rows in profiled_row_counts(min(self.max_num_seqs, self.max_num_batched_tokens)):
            sample_dummy_rows(self, hidden, rows)
        sampling = torch.cuda.max_memory_allocated(self.device) - base   # counts made in it
        del hidden      # before the cache is emptied: its block would stay reserved, counted as used
        self._release_kv_cache()
        graphs = (sampling_buffer_bytes(self.max_num_seqs, self.config.vocab_size, self.dtype)
                  if self.cudagraph_mode != "none" else 0)
        return max(forward + self.penalty_counts.full_bytes(self.config.vocab_size), sampling) + graphs

    def _release_kv_cache(self):
        self.kv_cache = None
        for layer in self.model.layers:
            layer.attn.kv_cache = torch.empty(0)
        torch.cuda.empty_cache()
