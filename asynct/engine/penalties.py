"""vLLM V1's logit adjustments, made on the raw logits before temperature and the filters, so
that greedy rows take the argmax of what they leave: allowed_token_ids, bad_words
(asynct.engine.bad_words) and logit_bias, then the repetition penalty (over prompt and output
tokens), then the frequency and presence penalties (over output tokens, as OpenAI defines them).
Rows without any are not touched."""
import torch

from asynct.attention.base import host_to_device, host_to_device_many
from asynct.engine.bad_words import ban_bad_words
from asynct.engine.penalty_counts import PenaltyCounts
from asynct.ops.penalties import apply_penalties


def adjust_logits(logits: torch.Tensor, seqs, prev_sampled: torch.Tensor | None = None,
                  counts: PenaltyCounts | None = None) -> torch.Tensor:
    """logits [R, V] -> an fp32 copy with each row's adjustments, or `logits` itself where no row
    has any. A copy, as the logprobs are the raw logits'. `prev_sampled`: the previous step's
    samples, where a sequence's pending token is (async scheduling). `counts`: the engine's
    penalty counts, kept between steps (a fresh one counts every output token again)."""
    rows = [i for i, s in enumerate(seqs) if s.params.adjusts_logits]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    counts = PenaltyCounts() if counts is None else counts
    if len(rows) == len(seqs):
        return _adjust(out, seqs, prev_sampled, counts)
    # index_select / index_copy_, not `out[idx] = ...`: index_put_ waited for the device (below)
    idx = host_to_device(rows, torch.long, logits.device)
    return out.index_copy_(0, idx, _adjust(out.index_select(0, idx), [seqs[i] for i in rows], prev_sampled, counts))


def _adjust(logits, seqs, prev_sampled, counts):
    _allow(logits, seqs)
    if any(s.params.bad_words for s in seqs):
        ban_bad_words(logits, seqs, prev_sampled)
    _bias(logits, seqs)
    if any(s.params.penalised for s in seqs):
        logits = _penalise(logits, seqs, prev_sampled, counts)
    return logits


def _allow(logits, seqs):
    rows = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    _send_allowed_ids([seqs[i] for i in rows], dev)
    # the allowed logits kept, the rows filled, the kept put back: no index_put_ (a bool mask set
    # by `blocked[rows] = True` synchronised with the device twice a step, so a step of
    # lm-eval's forced tokens could not be prepared while the one before ran: rolling
    # loglikelihood 1.05x slower on an H100, benchmarks/RESULTS.md)
    flat = _flat_index([seqs[i].allowed_ids_device for i in rows], rows, vocab, dev)
    kept = logits.view(-1).index_select(0, flat)
    logits.index_fill_(0, host_to_device(rows, torch.long, dev), float("-inf"))
    logits.view(-1).index_copy_(0, flat, kept)


def _bias(logits, seqs):
    rows = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    if not rows:
        return
    _send_biases([seqs[i] for i in rows], logits.device)
    biases = [seqs[i].bias_device for i in rows]
    flat = _flat_index([ids for ids, _ in biases], rows, logits.shape[1], logits.device)
    logits.view(-1).index_add_(0, flat, torch.cat([values for _, values in biases]))


def _send_allowed_ids(seqs, dev):
    """Each sequence's allowed_token_ids on the device, sent once (not a host list every step),
    and those of a step's new sequences in one copy: one copy each cost a loglikelihood step
    (lm-eval's, each request forcing its last token) a copy a row."""
    new = [s for s in seqs if s.allowed_ids_device is None]
    if new:
        for s, ids in zip(new, host_to_device_many([(s.params.allowed_token_ids, torch.long) for s in new], dev)):
            s.allowed_ids_device = ids


def _send_biases(seqs, dev):
    """Each sequence's logit_bias as (token ids, biases) on the device, sent once; a step's new
    sequences' in one copy."""
    new = [s for s in seqs if s.bias_device is None]
    if new:
        parts = []
        for s in new:
            ids, values = zip(*s.params.logit_bias.items())
            parts += [(ids, torch.long), (values, torch.float32)]
        sent = host_to_device_many(parts, dev)
        for k, s in enumerate(new):
            s.bias_device = sent[2 * k], sent[2 * k + 1]


def _flat_index(ids: list[torch.Tensor], rows: list[int], vocab: int, dev) -> torch.Tensor:
    """Flat indices into [R, V] of each row's token ids (device tensors): the host sends an
    offset and a size per row, never a list per token."""
    sizes = [x.shape[0] for x in ids]
    offsets, counts = host_to_device_many([([i * vocab for i in rows], torch.int64), (sizes, torch.int64)], dev)
    return torch.cat(ids) + offsets.repeat_interleave(counts, output_size=sum(sizes))


def _penalise(logits, seqs, prev_sampled, counts: PenaltyCounts):
    """As vLLM: a seen token's positive logit is divided by the repetition penalty, a negative one
    multiplied; then the frequency penalty per output occurrence, the presence penalty once
    (ops.apply_penalties). Rows without penalties read the zero row with penalties (1, 0, 0):
    the same bits."""
    vocab, dev = logits.shape[1], logits.device
    rows = counts.rows(seqs, vocab, dev)
    # each row's token still on the device, for this step only (the host adds it later): its
    # row of prev_sampled, read by the kernel; -1: none
    pending = [s.sample_row if s.num_pending_tokens and s.params.penalised else -1 for s in seqs]
    new, upto = counts.new_tokens(seqs, rows)
    rows_d, new, pending, rep, freq, pres = host_to_device_many(
        [(rows, torch.int64), (new, torch.int64), (pending, torch.int64)]
        + [([getattr(s.params, name) for s in seqs], torch.float32)
           for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")], dev)
    counts.add(new, upto=upto)
    return apply_penalties(logits.contiguous(), counts.counts, rows_d, counts.in_prompt, pending, prev_sampled,
                           rep, freq, pres)
