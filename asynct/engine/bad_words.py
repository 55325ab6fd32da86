"""vLLM's `bad_words`: each word's token ids, and at each step the -inf that keeps a row from
finishing one. As vLLM V1, a word is tokenised as written (less leading spaces) and with one
leading space (a word inside a text), the second kept only where it is another token sequence of
the same length; a row's output tokens (never the prompt's) that end with all but a word's last
token make that last token impossible, and a one-token word is never drawn."""
import torch

from asynct.attention.base import host_to_device_many
from asynct.engine.detokenizer import check_unicode


MAX_NUM_BAD_WORDS = 128   # token sequences, as vLLM's VLLM_MAX_NUM_BAD_WORDS


def bad_words_token_ids(detokenizer, words: list[str], vocab_size: int) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer; ValueError naming bad_words where a word has
    no token, or a token the model's vocabulary lacks, or past MAX_NUM_BAD_WORDS token sequences
    (each word is one or two; every step checks each). Refused before the tokenizer runs where
    the words alone are too many: a server's 400,000 words held its tokenising threads a minute."""
    if len(words) > MAX_NUM_BAD_WORDS:
        raise ValueError(f"{len(words)} bad_words; at most {MAX_NUM_BAD_WORDS} (as vLLM)")
    out = []
    for word in words:
        check_unicode(word, "bad_words entry")
        plain = detokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r:.40}")
        out.append(plain)
        spaced = detokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    if len(out) > MAX_NUM_BAD_WORDS:
        raise ValueError(f"bad_words tokenize to {len(out)} token sequences (a word and its spaced form); at "
                         f"most {MAX_NUM_BAD_WORDS} (as vLLM)")
    bad = sorted({t for ids in out for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"bad_words tokenize to ids outside the vocabulary (size {vocab_size}): {bad[:8]}")
    return out


def ban_bad_words(logits: torch.Tensor, seqs, prev_sampled: torch.Tensor | None):
    """-inf in place at each row's banned tokens. A row's newest output token may be on the device
    only (async scheduling): a word whose prefix ends with it is banned there, where that token
    equals the prefix's last, so that the host never waits for the step in flight."""
    rows, banned, needed, src = [], [], [], []
    for i, s in enumerate(seqs):
        out = None       # the row's output, copied once a step (not once a word)
        for ids in s.params.bad_words_token_ids or ():
            if out is None and len(ids) > 1:
                out = s.output_token_ids
            need = _needs(s, out, ids)
            if need is not None:
                rows.append(i)
                banned.append(ids[-1])
                needed.append(need)
                # only a pending token's row is read: another row's sample_row may be that of
                # a step long gone (preempted, or left out of a step), past the newest samples
                src.append(s.sample_row if need >= 0 else 0)
    if rows:
        _apply(logits, rows, banned, needed, src, prev_sampled)


def _needs(seq, out: list[int] | None, ids: list[int]) -> int | None:
    """None: the word cannot end at this step; -1: it can; a token id: it can where the row's
    pending token (on the device) is that id. `out`: the row's output tokens on the host."""
    prefix = ids[:-1]
    if not prefix:
        return -1
    if not seq.num_pending_tokens:
        return -1 if len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix else None
    known = prefix[:-1]      # the pending token must be the prefix's last
    if len(out) < len(known) or out[len(out) - len(known):] != known:
        return None
    return prefix[-1]


def _apply(logits, rows, banned, needed, src, prev_sampled):
    dev = logits.device
    rows_d, banned_d, needed_d, src_d = host_to_device_many(
        [(rows, torch.int64), (banned, torch.int64), (needed, torch.int64), (src, torch.int64)], dev)
    hit = needed_d < 0
    if prev_sampled is not None and max(needed) >= 0:
        hit |= prev_sampled[src_d] == needed_d
    # accumulated: two words may end in one token, only one of them here (an assignment of
    # repeated indices keeps either write)
    add = torch.where(hit, float("-inf"), 0.0).to(logits.dtype)
    logits.index_put_((rows_d, banned_d), add, accumulate=True)
