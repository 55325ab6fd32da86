"""Runs one scheduled batch: builds inputs and metadata once, runs the model, samples."""
from dataclasses import dataclass

import torch

from asynct.attention import StepInputs, resolve_backend
from asynct.engine.context import reset_context, set_context
from asynct.engine.cuda_graph import CudaGraphRunner
from asynct.engine.outputs import Logprob
from asynct.engine.sampler import sample, token_logprobs
from asynct.engine.scheduler import ScheduledBatch
from asynct.model.engine_model import AsyncTEngineModel
from asynct.model.kv_scales import is_fp8, resolve_kv_cache_dtype, set_kv_scales
from asynct.model.loader import load_weights


@dataclass
class StepOutput:
    tokens: list[int | None]                       # per scheduled seq; None while prefilling
    logprobs: list[dict[int, Logprob] | None]
    prompt_logprobs: list[list[dict[int, Logprob]]]  # per seq: entries for this chunk's positions


class ModelRunner:
    def __init__(self, config, model_path, device, dtype, attention_backend, block_size,
                 max_num_seqs, max_num_batched_tokens, max_model_len, enforce_eager, kv_cache_dtype="auto"):
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        self.eos_token_id = config.eos_token_id
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
        self.graphs = None
        self.use_graphs = (self.device.type == "cuda" and not enforce_eager
                           and self.backend.supports_cuda_graphs)
        self.max_num_seqs = max_num_seqs

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
        for i, layer in enumerate(self.model.layers):
            layer.attn.kv_cache = self.kv_cache[i]
        if self.use_graphs and capture:
            self.graphs = CudaGraphRunner(self, self.max_num_seqs)

    @torch.inference_mode()
    def profile_activation_memory(self) -> int:
        """Peak bytes a full-budget prefill needs beyond the weights (over a scratch cache)."""
        n = min(self.max_num_batched_tokens, self.max_model_len)
        blocks = (n + self.block_size - 1) // self.block_size
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        self.allocate_kv_cache(blocks, capture=False)
        torch.cuda.reset_peak_memory_stats(self.device)
        step = StepInputs([n], [n], [list(range(blocks))], list(range(n)), 0)
        self._forward(torch.zeros(n, dtype=torch.long, device=self.device),
                      torch.arange(n, device=self.device), self.builder.build(step))
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_cache = None
        for layer in self.model.layers:
            layer.attn.kv_cache = torch.empty(0)
        torch.cuda.empty_cache()
        return peak

    # ---- one step -------------------------------------------------------------------------
    def step_inputs(self, batch: ScheduledBatch):
        ids, pos, slots = [], [], []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        step = StepInputs(list(batch.num_tokens), [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_tokens)],
                          [s.block_table for s in batch.seqs], slots, batch.num_decodes)
        return ids, pos, step

    def _forward(self, input_ids, positions, metadata):
        set_context(metadata)
        try:
            return self.model(input_ids, positions)
        finally:
            reset_context()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        ids, pos, step = self.step_inputs(batch)
        metadata = self.builder.build(step)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        if self.graphs is not None and self.graphs.can_run(metadata):
            hidden = self.graphs.run(input_ids, positions, metadata)
        else:
            hidden = self._forward(input_ids, positions, metadata)
        return self._postprocess(batch, hidden, metadata.query_start_loc_cpu)

    def _postprocess(self, batch, hidden, qsl) -> StepOutput:
        samplers = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                    if s.num_computed_tokens + n == len(s)]
        prompt_rows = self._prompt_logprob_rows(batch, qsl)
        rows = [qsl[i + 1] - 1 for i in samplers] + [r for _, r, _ in prompt_rows]
        if rows == list(range(hidden.shape[0])):
            logits = self.model.compute_logits(hidden)          # decode steps: every row samples
        else:
            logits = self.model.compute_logits(hidden[rows]) if rows else None
        tokens: list = [None] * len(batch.seqs)
        logprobs: list = [None] * len(batch.seqs)
        if samplers:
            seqs = [batch.seqs[i] for i in samplers]
            sampled = sample(logits[:len(samplers)], seqs, self.eos_token_id)
            entries = self._logprob_entries(logits[:len(samplers)], sampled, seqs)
            for j, (i, t) in enumerate(zip(samplers, sampled.tolist())):
                tokens[i], logprobs[i] = t, entries[j]
        return StepOutput(tokens, logprobs, self._prompt_logprobs(batch, prompt_rows, logits, len(samplers)))

    def _logprob_entries(self, logits, sampled, seqs):
        want = [s.params.logprobs for s in seqs]
        if all(w is None for w in want):
            return [None] * len(seqs)
        entries = _entries(logits.log_softmax(-1, dtype=torch.float32), sampled, [w or 0 for w in want])
        return [e if w is not None else None for e, w in zip(entries, want)]

    def _prompt_logprob_rows(self, batch, qsl):
        """(seq index, hidden row, target token) for every prompt position this step that
        predicts a prompt token whose logprob is not recorded yet."""
        rows = []
        for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if s.prompt_logprobs is None:
                continue
            for p in range(max(s.num_computed_tokens, len(s.prompt_logprobs) - 1),
                           min(s.num_computed_tokens + n, s.num_prompt_tokens - 1)):
                rows.append((i, qsl[i] + p - s.num_computed_tokens, s.token_ids[p + 1]))
        return rows

    def _prompt_logprobs(self, batch, prompt_rows, logits, offset):
        out = [[] for _ in batch.seqs]
        if not prompt_rows:
            return out
        targets = torch.tensor([t for _, _, t in prompt_rows], device=logits.device)
        want = [batch.seqs[i].params.prompt_logprobs for i, _, _ in prompt_rows]
        for (i, _, _), e in zip(prompt_rows, _entries(logits[offset:].log_softmax(-1, dtype=torch.float32), targets, want)):
            out[i].append(e)
        return out


def _entries(logprobs, tokens, num_top) -> list[dict[int, Logprob]]:
    """vLLM's logprob dicts: the chosen token first, then the top `num_top[row]` by rank.
    Everything crosses to the host in one copy per tensor."""
    chosen, ranks, top = token_logprobs(logprobs, tokens, max(num_top))
    chosen, ranks, tokens = chosen.tolist(), ranks.tolist(), tokens.tolist()
    top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
    out = []
    for j, k in enumerate(num_top):
        entry = {tokens[j]: Logprob(chosen[j], ranks[j])}
        for r in range(k):
            entry.setdefault(top_ids[j][r], Logprob(top_lps[j][r], r + 1))
        out.append(entry)
    return out
