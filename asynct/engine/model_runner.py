"""Runs one scheduled batch: builds inputs and metadata once, launches the model and the sampler
without waiting for the device, and finishes the step (results to the host) when asked.

With async scheduling the engine launches step N+1 before it finishes step N: tokens sampled in
step N stay on the device and become step N+1's inputs there; only their copies to the host
(pinned, non-blocking) are waited for, one step later."""
import time

import numpy as np
import torch

from asynct.attention import StepInputs, resolve_backend
from asynct.attention.base import host_to_device, host_to_device_many
from asynct.engine.context import reset_context, set_context
from asynct.engine.cuda_graph import GraphLogits
from asynct.engine.penalty_counts import PenaltyCounts
from asynct.engine.runner_startup import RunnerStartup
from asynct.engine.sampler import sample, takes_raw_argmax
from asynct.engine.sampling_params import SamplingParams
from asynct.engine.scheduler import ScheduledBatch
from asynct.engine.step_output import (LaunchedStep, StepOutput, entries, logprob_parts, logprob_tensors,
                                       to_host)
from asynct.model.engine_model import AsyncTEngineModel
from asynct.model.kv_scales import is_fp8, resolve_kv_cache_dtype, set_kv_scales
from asynct.model.loader import load_weights


class ModelRunner(RunnerStartup):
    def __init__(self, config, model_path, device, dtype, attention_backend, block_size,
                 max_num_seqs, max_num_batched_tokens, max_model_len, cudagraph_mode="none",
                 kv_cache_dtype="auto", lazy_decode_graphs=False, eos_token_ids=()):
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        if is_fp8(self.kv_dtype) and self.device.type == "cuda" and dtype == torch.float32:
            # Triton 3.6 fails to compile the FP8 prefill for fp32 queries (a layout pass)
            raise ValueError("kv_cache_dtype='fp8' on CUDA needs a 16-bit model dtype: "
                             "pass dtype='bfloat16' or 'float16'")
        self.eos_token_ids = list(eos_token_ids)    # config's and the generation config's: min_tokens holds them back
        self.block_size = block_size
        self.max_num_batched_tokens, self.max_model_len = max_num_batched_tokens, max_model_len
        self.backend = resolve_backend(attention_backend, self.device)()
        self.builder = self.backend.get_builder_cls()(block_size, self.device)
        with torch.device(self.device):
            self.model = AsyncTEngineModel(config, self.backend.get_impl_cls()).to(dtype)
        for name, p in self.model.named_parameters():   # norms and sigma stay fp32: they are tiny
            if name.endswith(("alpha", "sigma")) or ("norm" in name and name.endswith("weight")):
                p.data = p.data.float()
        self.model.cos_sin_cache = self.model.rope_cache(self.device)   # fp32: .to(dtype) cast it
        load_weights(self.model, model_path)
        if is_fp8(self.kv_dtype):
            set_kv_scales(self.model)
        self.model.eval()
        self.kv_cache = None
        self.graphs = self.piecewise = None
        self.lazy_decode_graphs, self.decode_graphs_pending = lazy_decode_graphs, False
        graphs_possible = self.device.type == "cuda" and self.backend.supports_cuda_graphs
        self.cudagraph_mode = cudagraph_mode if graphs_possible else "none"
        self.compile_seconds = 0.0       # a fresh machine compiles every kernel here (empty Triton cache)
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            self._compile_ahead()
            self.compile_seconds = time.perf_counter() - t0
        self.max_num_seqs = max_num_seqs
        # the previous step's sampled tokens, on the device. A sampling graph's input ids (its
        # argmax), which the next replay overwrites, only after a step whose every row took the
        # raw argmax: no row of the next step then has penalties or bad words that read them
        self.last_sampled = None
        self.penalty_counts = PenaltyCounts(rows_hint=max_num_seqs + 1)
        self.timed = False           # record device time per step (benchmarks)

    # ---- one step -------------------------------------------------------------------------
    def step_inputs(self, batch: ScheduledBatch):
        """Host inputs for the step; a token still on the device (sampled by the step before)
        is a placeholder in `ids`, listed in `pending` as (input row, row of last_sampled).
        Positions and slots come from the batch's block table as arrays: a generator of slots
        a token cost an 8K-token prefill step milliseconds."""
        ids, pending, starts = [], [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            starts.append(start)
            ids.extend(seq.token_ids[start:start + n])
            if start + n > len(seq.token_ids):         # at most its last token
                ids.append(0)
                pending.append((len(ids) - 1, seq.sample_row))
        counts = np.asarray(batch.num_tokens, dtype=np.int64)
        rows = np.repeat(np.arange(len(counts)), counts)
        first = np.cumsum(counts) - counts                       # each row's first token
        pos = np.asarray(starts, dtype=np.int64)[rows] + np.arange(len(ids)) - first[rows]
        slots = batch.block_table[rows, pos // self.block_size] * np.int64(self.block_size) + pos % self.block_size
        step = StepInputs(list(batch.num_tokens), [a + n for a, n in zip(starts, batch.num_tokens)],
                          batch.block_table, slots, batch.num_decodes)
        return ids, pos, step, pending

    def _forward(self, input_ids, positions, metadata):
        set_context(metadata)
        try:
            return self.model(input_ids, positions)
        finally:
            reset_context()

    def _inputs(self, ids, pos, pending):
        """(input ids, positions) on the device in one copy, the pending tokens filled in there.
        A decode step whose every row is the same row of the step before takes the samples
        themselves: no upload of ids, no gather (two kernels, 5.5 us of a batch-1 step, H200;
        the step's time moved within noise)."""
        dst, src = zip(*pending) if pending else ((), ())
        if dst == src == tuple(range(len(ids))):
            return self.last_sampled[:len(ids)], host_to_device(pos, torch.int64, self.device)
        input_ids, positions, dst, src = host_to_device_many(
            [(ids, torch.int64), (pos, torch.int64), (dst, torch.int64), (src, torch.int64)], self.device)
        if pending:
            input_ids[dst] = self.last_sampled[src]
        return input_ids, positions

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queues the step's forward and sampling on the device; returns without waiting."""
        if self.decode_graphs_pending and batch.is_decode_only:
            self.capture_decode_graphs()
        t0 = time.perf_counter()
        ids, pos, step, pending = self.step_inputs(batch)
        events = self._events()
        samplers = batch.sampling_rows
        # a step of one-token rows may hold a one-token prefill chunk mid-prompt (a token budget's
        # last): it neither samples nor, in a sampling graph, keeps the hidden state its prompt
        # logprob needs, so such a step takes no decode graph
        if self.graphs is not None and self.graphs.can_run(step) and len(samplers) == len(batch.seqs):
            # no metadata built: the backend sends the step's host inputs to the graph's buffers
            hidden, kind = self.graphs.run(step, ids, pending, self.last_sampled), "graph"
            qsl = tuple(range(len(ids) + 1))
        else:
            metadata = self.builder.build(step)
            hidden, kind = self._run_model(self._inputs(ids, pos, pending), metadata, batch)
            qsl = metadata.query_start_loc_cpu
        prompt_rows, host = self._sample(batch, samplers, hidden, qsl)
        if events:
            events[1].record()
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(batch, samplers, prompt_rows, host, done, kind,
                            events, time.perf_counter() - t0, sum(step.seq_lens))

    def _run_model(self, inputs, metadata, batch):
        """(final hidden states, step kind) of a step no decode graph holds: piecewise graphs,
        or eager."""
        input_ids, positions = inputs
        if self.piecewise is not None and self.piecewise.can_run(metadata):
            return self.piecewise.run(input_ids, positions, metadata), "piecewise " + _kind(batch)
        return self._forward(input_ids, positions, metadata), _kind(batch)

    def _events(self):
        if not (self.timed and self.device.type == "cuda"):
            return ()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _sample(self, batch, samplers, hidden, qsl):
        """Samples and logprobs of the rows that sample (`samplers`: batch.sampling_rows) or score
        prompt tokens (from the hidden states, or a sampling graph's GraphLogits), queued to the
        host. Returns (prompt-logprob rows, host copies)."""
        host = {}
        if isinstance(hidden, GraphLogits):    # a decode step: every row samples
            self._sample_rows(batch, samplers, hidden.logits, host, hidden.greedy)
            return [], host
        prompt_rows = self._prompt_logprob_rows(batch, qsl)
        rows = [qsl[i + 1] - 1 for i in samplers]
        if not prompt_rows and rows == list(range(hidden.shape[0])):
            # decode steps: every row samples
            self._sample_rows(batch, samplers, self.model.compute_logits(hidden), host)
        elif rows or prompt_rows:
            index = host_to_device(rows + [r for _, r, _ in prompt_rows], torch.long, self.device)
            if samplers:   # its logits are dropped on return, before the prompt rows' exist
                self._sample_rows(batch, samplers, self.model.compute_logits(hidden[index[:len(rows)]]), host)
            if prompt_rows:
                host["prompt"] = self._prompt_logprob_tensors(batch, prompt_rows, hidden, index[len(rows):])
        return prompt_rows, host

    def _sample_rows(self, batch, samplers, logits, host, greedy=None):
        """`greedy`: the logits' argmax, where a sampling graph made it."""
        seqs = [batch.seqs[i] for i in samplers]
        if greedy is not None and takes_raw_argmax(seqs):
            sampled = greedy
        else:   # before last_sampled is replaced: it holds the pending tokens the penalties count
            sampled, blocked = sample(logits, seqs, self.eos_token_ids, self.last_sampled, self.penalty_counts)
            if blocked is not None:
                host["blocked"] = to_host(blocked)
        self.last_sampled = sampled
        host["tokens"] = to_host(sampled)
        host["logprobs"] = self._logprob_tensors(logits, sampled, seqs)

    def _logprob_tensors(self, logits, sampled, seqs):
        if all(s.params.logprobs is None for s in seqs):
            return None
        want = [SamplingParams.num_logprobs(s.params.logprobs, logits.shape[1]) for s in seqs]
        return want, logprob_tensors(logits.log_softmax(-1, dtype=torch.float32), sampled,
                                      max(w or 0 for w in want))

    def _prompt_logprob_rows(self, batch, qsl):
        """(seq index, hidden row, target token) for every prompt position this step that
        predicts a prompt token whose logprob no step has computed yet."""
        rows = []
        for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if s.prompt_logprobs is None:
                continue
            for p in range(max(s.num_computed_tokens, s.num_prompt_logprobs_scheduled),
                           min(s.num_computed_tokens + n, s.num_prompt_tokens - 1)):
                rows.append((i, qsl[i] + p - s.num_computed_tokens, s.token_ids[p + 1]))
        return rows

    def _prompt_logprob_tensors(self, batch, prompt_rows, hidden, index):
        """A prefill step scores up to max_num_batched_tokens rows (loglikelihood_rolling), whose
        logits at once outgrow the start-up profile (15 GiB at 8192 rows of 152k, H200): slices
        of max_num_seqs rows, which it holds (sampling_profile), keep only per-row results. They
        equal one pass's bit for bit on an H200; on the CPU, MKL rounds a product of under ~4
        rows a ulp apart."""
        targets = host_to_device([t for _, _, t in prompt_rows], torch.long, self.device)
        vocab = self.config.vocab_size
        want = [SamplingParams.num_logprobs(batch.seqs[i].params.prompt_logprobs, vocab) for i, _, _ in prompt_rows]
        n = self.max_num_seqs
        parts = [self._prompt_slice(hidden[index[a:a + n]], targets[a:a + n], max(want))
                 for a in range(0, len(prompt_rows), n)]
        return want, tuple(to_host(torch.cat(p)) for p in zip(*parts))

    def _prompt_slice(self, hidden, targets, num_top):
        # the slice's [rows, vocab] tensors die here, before the next slice's logits
        logprobs = self.model.compute_logits(hidden).log_softmax(-1, dtype=torch.float32)
        return logprob_parts(logprobs, targets, num_top)

    # ---- finishing a step -----------------------------------------------------------------
    def finish(self, launched: LaunchedStep) -> StepOutput:
        """Waits for the step's copies to reach the host and unpacks them."""
        if launched.done is not None:
            launched.done.synchronize()
        batch, host = launched.batch, launched.host
        tokens: list = [None] * len(batch.seqs)
        logprobs: list = [None] * len(batch.seqs)
        blocked = [False] * len(batch.seqs)
        if launched.samplers:
            sampled = host["tokens"].tolist()
            lps = entries(host["logprobs"], sampled)
            for j, i in enumerate(launched.samplers):
                tokens[i], logprobs[i] = sampled[j], lps[j]
            if "blocked" in host:
                for j, no_token in enumerate(host["blocked"].tolist()):
                    blocked[launched.samplers[j]] = no_token
        prompt = [[] for _ in batch.seqs]
        if launched.prompt_rows:
            targets = [t for _, _, t in launched.prompt_rows]
            for (i, _, _), e in zip(launched.prompt_rows, entries(host["prompt"], targets)):
                prompt[i].append(e)
        return StepOutput(tokens, logprobs, prompt, blocked)

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Launch and finish at once (the synchronous loop, tests, benchmarks)."""
        return self.finish(self.launch(batch))


def _kind(batch: ScheduledBatch) -> str:
    if batch.is_decode_only:
        return "decode"
    return "mixed" if batch.num_decodes else "prefill"
