"""vLLM V1's logit adjustments, made on the raw logits before temperature and the filters, so
that greedy rows take the argmax of what they leave: allowed_token_ids, bad_words
(asynct.engine.bad_words) and logit_bias, then the repetition penalty (over prompt and output
tokens), then the frequency and presence penalties (over output tokens, as OpenAI defines them).
Rows without any are not touched."""
import numpy as np
import torch

from asynct.attention.base import host_to_device, host_to_device_many
from asynct.engine.bad_words import ban_bad_words


def adjust_logits(logits: torch.Tensor, seqs, prev_sampled: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] -> an fp32 copy with each row's adjustments, or `logits` itself where no row
    has any. A copy, as the logprobs are the raw logits'. `prev_sampled`: the previous step's
    samples, where a sequence's pending token is (async scheduling)."""
    rows = [i for i, s in enumerate(seqs) if s.params.adjusts_logits]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    if len(rows) == len(seqs):
        return _adjust(out, seqs, prev_sampled)
    idx = host_to_device(rows, torch.long, logits.device)
    out[idx] = _adjust(out[idx], [seqs[i] for i in rows], prev_sampled)
    return out


def _adjust(logits, seqs, prev_sampled):
    _allow(logits, seqs)
    if any(s.params.bad_words for s in seqs):
        ban_bad_words(logits, seqs, prev_sampled)
    _bias(logits, seqs)
    if any(s.params.penalised for s in seqs):
        logits = _penalise(logits, seqs, prev_sampled)
    return logits


def _allow(logits, seqs):
    rows = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    blocked = torch.zeros(logits.shape, dtype=torch.bool, device=dev)
    blocked[host_to_device(rows, torch.long, dev)] = True
    blocked.view(-1)[_flat_index([_allowed_ids(seqs[i], dev) for i in rows], rows, vocab, dev)] = False
    logits.masked_fill_(blocked, float("-inf"))


def _bias(logits, seqs):
    rows = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    if not rows:
        return
    biases = [_device_bias(seqs[i], logits.device) for i in rows]
    flat = _flat_index([ids for ids, _ in biases], rows, logits.shape[1], logits.device)
    logits.view(-1).index_add_(0, flat, torch.cat([values for _, values in biases]))


def _allowed_ids(seq, dev) -> torch.Tensor:
    """A sequence's allowed_token_ids on the device, sent once (not a host list every step)."""
    if seq.allowed_ids_device is None:
        seq.allowed_ids_device = host_to_device(seq.params.allowed_token_ids, torch.long, dev)
    return seq.allowed_ids_device


def _device_bias(seq, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's logit_bias as (token ids, biases) on the device, sent once."""
    if seq.bias_device is None:
        ids, values = zip(*seq.params.logit_bias.items())
        seq.bias_device = host_to_device(ids, torch.long, dev), host_to_device(values, torch.float32, dev)
    return seq.bias_device


def _flat_index(ids: list[torch.Tensor], rows: list[int], vocab: int, dev) -> torch.Tensor:
    """Flat indices into [R, V] of each row's token ids (device tensors): the host sends an
    offset and a size per row, never a list per token."""
    sizes = [x.shape[0] for x in ids]
    offsets, counts = host_to_device_many([([i * vocab for i in rows], torch.int64), (sizes, torch.int64)], dev)
    return torch.cat(ids) + offsets.repeat_interleave(counts, output_size=sum(sizes))


def _penalise(logits, seqs, prev_sampled):
    """As vLLM: a seen token's positive logit is divided by the repetition penalty, a negative one
    multiplied; then the frequency penalty per output occurrence, the presence penalty once. Only
    the seen tokens' logits are read and written (a dense [rows, vocab] count, as before, wrote and
    read ~1.5 GB a step at 256 rows of a 152k vocabulary); same arithmetic, same bits."""
    rows, vocab = logits.shape
    dev, flat = logits.device, logits.view(-1)
    rep, freq, pres = host_to_device_many(
        [([getattr(s.params, name) for s in seqs], torch.float32)
         for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")], dev)
    out = torch.cat([_output_index(seqs, vocab, dev), _pending_index(seqs, vocab, prev_sampled, dev)])
    seen = torch.cat([_prompt_index(seqs, vocab, dev), out])
    v, r = flat[seen], rep[seen // vocab]
    flat[seen] = torch.where(v > 0, v / r, v * r)     # repeats write the same value
    token, count = _occurrences(out)
    row = token // vocab
    flat[token] = flat[token] - freq[row] * count - pres[row]
    return logits


def _occurrences(index):
    """(each index, how often it occurs) for every entry of a flat index list, in fixed shapes:
    no data-dependent size (torch.unique's) that would make the host wait for the device."""
    token = index.sort().values
    first = torch.ones_like(token, dtype=torch.bool)
    first[1:] = token[1:] != token[:-1]
    run = first.cumsum(0) - 1
    count = torch.zeros(token.shape, device=token.device).index_add_(0, run, torch.ones(token.shape, device=token.device))
    return token, count[run]


def _prompt_index(seqs, vocab, dev):
    """Flat indices of the prompt's tokens, for the rows with a repetition penalty (only it reads
    the prompt); each sequence's distinct prompt ids go to the device once, not every step."""
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1]
    if not rows:
        return torch.zeros(0, dtype=torch.long, device=dev)
    return _flat_index([_prompt_ids(seqs[i], dev) for i in rows], rows, vocab, dev)


def _prompt_ids(seq, dev) -> torch.Tensor:
    if seq.prompt_ids_device is None:
        seq.prompt_ids_device = host_to_device(sorted(set(seq.token_ids[:seq.num_prompt_tokens])), torch.long, dev)
    return seq.prompt_ids_device


def _output_index(seqs, vocab, dev):
    """Flat indices of the output tokens the host has."""
    parts = [np.asarray(s.output_token_ids, dtype=np.int64) + i * vocab
             for i, s in enumerate(seqs) if s.params.penalised]
    return host_to_device(np.concatenate(parts or [np.zeros(0, np.int64)]), torch.long, dev)


def _pending_index(seqs, vocab, prev_sampled, dev):
    """A sequence's newest output token may be on the device only (sampled by the step before,
    async scheduling): it is read from `prev_sampled` there, without waiting for the host copy."""
    pending = [(i, s.sample_row) for i, s in enumerate(seqs) if s.num_pending_tokens and s.params.penalised]
    if not pending:
        return torch.zeros(0, dtype=torch.long, device=dev)
    dst, src = zip(*pending)
    offsets, src = host_to_device_many([([i * vocab for i in dst], torch.int64), (src, torch.int64)], dev)
    return prev_sampled[src] + offsets
