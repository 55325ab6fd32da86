"""Batched sampling with per-row parameters: greedy, temperature, top-k, top-p, min-p, seeds.

A row draws the argmax of its kept logits / T plus Gumbel noise from a counter-based generator
(asynct.ops.sampling_draw): a seeded sequence's noise is a function of its seed, its index in
the request and its output position, so it gets the same tokens in any batch; the others share
one key a step, drawn from torch's default generator (LLM(seed=...) seeds it)."""
import torch

from asynct.attention.base import host_to_device
from asynct.engine.penalties import adjust_logits
from asynct.engine.sequence import Sequence
from asynct.ops.sampling_draw import draw
from asynct.ops.sampling_filters import filter_threshold

FP32_TINY = torch.finfo(torch.float32).tiny


def _filter_threshold(logits, seqs, inv_temps):
    """Per row, the logit that top-k, min-p and top-p keep the logits at or above
    (asynct.ops.sampling_filters, without a sort on CUDA); None where no row filters. Greedy
    rows filter nothing: their argmax stays whatever the filters."""
    vocab = logits.shape[1]
    top_k = [vocab if s.params.greedy else min(s.params.top_k or vocab, vocab) for s in seqs]
    top_p = [1.0 if s.params.greedy else s.params.top_p for s in seqs]
    min_p = [0.0 if s.params.greedy else s.params.min_p for s in seqs]
    use_top_k, use_top_p = any(k < vocab for k in top_k), any(p < 1 for p in top_p)
    if not (use_top_k or use_top_p or any(min_p)):
        return None
    dev = logits.device
    return filter_threshold(logits, inv_temps, host_to_device(top_k, torch.int32, dev),
                            host_to_device(top_p, torch.float32, dev), host_to_device(min_p, torch.float32, dev),
                            use_top_k, use_top_p)


def _noise_keys(seqs, device) -> torch.Tensor:
    """int64 [2, R]: each row's Philox key and counter. A seeded sequence's key comes from its
    seed and index, its counter from its output position (the high 32 bits); the other rows
    share a key drawn for the step, each its own counter."""
    step_key = int(torch.empty((), dtype=torch.int64).random_())
    keys, counters = [], []
    for i, s in enumerate(seqs):
        if s.params.seed is None:
            keys.append(step_key)
            counters.append(i << 32)
        else:
            key = (s.params.seed + 7919 * s.index) % 2**64      # wraps into 64 bits
            keys.append(key - 2**64 if key >= 2**63 else key)
            counters.append(s.num_sampled_tokens << 32)
    return host_to_device([keys, counters], torch.int64, device)


def eos_ids(eos_token_id) -> list[int]:
    """A config's eos_token_id as a list: transformers configs hold one id, None, or a list of
    ids any of which ends a sequence (Llama 3's holds three)."""
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [] if eos_token_id is None else [eos_token_id]
    return [i for i in ids if i >= 0]   # converters write -1 for none: as an index it is the last token


def suppress_stops(logits, seqs, eos_token_ids=()):
    """Before min_tokens are out, EOS and stop tokens cannot be drawn (tokens still on the
    device count as out)."""
    rows, cols = [], []
    for i, s in enumerate(seqs):
        if s.num_sampled_tokens < s.params.min_tokens:
            banned = [*s.params.stop_token_ids, *eos_token_ids]
            banned = [t for t in banned if 0 <= t < logits.shape[1]]
            rows += [i] * len(banned)
            cols += banned
    if not rows:
        return logits
    # a contiguous copy: flat indices, since index_put_ (logits[rows, cols] = ...) waits for the device
    logits = logits.clone(memory_format=torch.contiguous_format)
    flat = [r * logits.shape[1] + c for r, c in zip(rows, cols)]
    return logits.view(-1).index_fill_(0, host_to_device(flat, torch.long, logits.device), float("-inf")).view_as(logits)


def takes_raw_argmax(seqs: list[Sequence]) -> bool:
    """Whether `sample` reduces to the argmax of the raw logits for every row: greedy, nothing
    adjusting the logits, no stop token held back by min_tokens. A decode graph's own argmax
    then stands for it."""
    return all(s.params.greedy and not s.params.adjusts_logits
               and (not s.params.min_tokens or s.num_sampled_tokens >= s.params.min_tokens) for s in seqs)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=(), prev_sampled=None,
           penalty_counts=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [R, V] of the rows that sample -> (token ids [R], rows left no token [R] bool or
    None), on the logits' device. Greedy rows take the argmax of the model-dtype logits (fp32
    where a row has penalties, a bias or allowed tokens); sampling runs in fp32. A row whose
    allowed tokens, bad words, bias and min_tokens ban every token draws token 0: the second
    tensor marks it, where any row's logits were adjusted (None where none were). `prev_sampled`:
    the step before's samples, which hold the output tokens still pending on the device (async
    scheduling), for the penalties; `penalty_counts`, the engine's penalty_counts.PenaltyCounts."""
    if takes_raw_argmax(seqs):     # one pass over the rows, not one a check (an evaluation's steps)
        return logits.argmax(-1), None
    adjusted = adjust_logits(suppress_stops(logits, seqs, eos_token_ids), seqs, prev_sampled, penalty_counts)
    blocked = None if adjusted is logits else adjusted.amax(-1) == float("-inf")
    return _draw(adjusted, seqs), blocked


def _draw(logits, seqs):
    if all(s.params.greedy for s in seqs):
        return logits.argmax(-1)
    # 1 / T at least fp32's smallest normal: under it (T past ~1e38, valid) it read as 0, greedy
    inv_temps = host_to_device([0.0 if s.params.greedy else max(1 / s.params.temperature, FP32_TINY) for s in seqs],
                               torch.float32, logits.device)
    return draw(logits, inv_temps, _filter_threshold(logits, seqs, inv_temps), _noise_keys(seqs, logits.device))


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    """Per row: the chosen token's logprob and rank (1 + the tokens above it: tied tokens share a
    rank), and the top `num_top` (ids, logprobs). Ties broken by token id, as argmax breaks them,
    took three more passes over [rows, vocab]: rolling loglikelihood, which ranks every position,
    1.2x slower on an H100 (benchmarks/RESULTS.md)."""
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    return chosen, ranks, top
