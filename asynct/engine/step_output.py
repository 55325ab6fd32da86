"""What a launched step carries until the host finishes it: the batch, and the device results
copied to pinned host memory without waiting (sampled tokens, logprobs), unpacked into vLLM's
logprob dicts once the step's event has fired."""
from dataclasses import dataclass

import torch

from asynct.engine.outputs import Logprob
from asynct.engine.sampler import token_logprobs
from asynct.engine.scheduler import ScheduledBatch


@dataclass
class StepOutput:
    tokens: list[int | None]                       # per scheduled seq; None while prefilling
    logprobs: list[dict[int, Logprob] | None]
    prompt_logprobs: list[list[dict[int, Logprob]]]  # per seq: entries for this chunk's positions
    blocked: list[bool]                            # per seq: its sampling settings banned every token


@dataclass
class LaunchedStep:
    """A step on the device, and what the host needs to finish it once the device is done."""
    batch: ScheduledBatch
    samplers: list[int]          # batch rows that sample, in the order of the sampled tensor
    prompt_rows: list            # (batch row, hidden row, target token) of prompt logprobs
    host: dict                   # pinned host copies, filled by non-blocking copies
    done: torch.cuda.Event | None
    kind: str                    # breakdown.KINDS: "graph" (decode replay), "piecewise mixed", ...
    events: tuple = ()           # (start, end) around the device work, when timed
    host_s: float = 0.0          # host time spent launching it
    kv_tokens: int = 0           # keys its attention reads


def to_host(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def logprob_parts(logprobs, tokens, num_top):
    """Per row on the device: the chosen token's logprob and rank, and (where num_top) the top
    `num_top` ids and logprobs."""
    chosen, ranks, top = token_logprobs(logprobs, tokens, num_top)
    return (chosen, ranks) + ((top.indices, top.values) if top is not None else ())


def logprob_tensors(logprobs, tokens, num_top):
    """logprob_parts on the host (non-blocking copies)."""
    return tuple(to_host(p) for p in logprob_parts(logprobs, tokens, num_top))


def entries(packed, tokens: list[int]) -> list:
    """vLLM's logprob dicts: the chosen token first, then the top `num_top[row]` by rank."""
    if packed is None:
        return [None] * len(tokens)
    want, parts = packed
    chosen, ranks = parts[0].tolist(), parts[1].tolist()
    top_ids, top_lps = (parts[2].tolist(), parts[3].tolist()) if len(parts) > 2 else ([], [])
    out = []
    for j, k in enumerate(want):
        if k is None:
            out.append(None)
            continue
        entry = {tokens[j]: Logprob(chosen[j], ranks[j])}
        for r in range(k):
            entry.setdefault(top_ids[j][r], Logprob(top_lps[j][r], r + 1))
        out.append(entry)
    return out
