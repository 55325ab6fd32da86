"""A sequence: one completion of one request, with its tokens, cache blocks and outputs; and
the request: its n sequences."""
from dataclasses import dataclass, field
from enum import Enum, auto

from asynct.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, block_size: int):
        self.seq_id, self.request_id, self.index = seq_id, request_id, index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.table_row = -1               # its row of the block manager's HostBlockTables
        self.block_hashes: list[bytes] = []   # chained hashes of its full blocks, published once scheduled
        self.num_computed_tokens = 0      # tokens whose K/V are in the cache (or queued to be)
        self.num_cached_tokens = 0        # tokens the prefix cache served at its first scheduling
        self.num_preemptions = 0
        # async scheduling: tokens sampled on the device that the host has not seen yet (at most
        # one at scheduling time), and the row of the last step's samples that holds the newest
        self.num_pending_tokens = 0
        self.sample_row = -1
        # prompt positions whose logprobs a step computes (the logits of position p score token
        # p + 1, so prompt_logprobs_start needs positions from start - 1 on)
        start = min(max(params.prompt_logprobs_start, 1), self.num_prompt_tokens)
        self.num_prompt_logprobs_scheduled = start - 1
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] * start if params.prompt_logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.text = ""
        self.detok_prefix_offset = self.detok_read_offset = self.num_prompt_tokens
        self.detok_stream = None          # the tokenizer's incremental decoder, made on first use; False: failed
        # logit_bias and allowed_token_ids on the device, sent on first use
        self.bias_device = self.allowed_ids_device = None

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens including those still on the device."""
        return self.num_output_tokens + self.num_pending_tokens

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading prompt tokens whose K/V the prefix cache may hold: never the last (its logits
        sample the first output token), nor any whose logits a prompt logprob needs."""
        n = self.num_prompt_tokens - 1
        if self.prompt_logprobs is not None:
            n = min(n, self.num_prompt_logprobs_scheduled)
        return max(0, n)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)

    def reset_for_recompute(self):
        """Preempted: drop the cache state; prompt and generated tokens are recomputed later
        (a token still on the device joins them when its step is finished)."""
        self.status = SequenceStatus.WAITING
        self.block_table, self.block_hashes = [], []
        self.num_computed_tokens = 0
        self.num_preemptions += 1


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    stream: bool = False

    @property
    def finished(self) -> bool:
        # newest first: the n sequences are admitted, so mostly finish, in order, and each one
        # that finishes asks this (in order it was O(n) a call: 2.7 s of an n=3,000 request's 8 s)
        return all(s.is_finished for s in reversed(self.seqs))

    @property
    def incremental(self) -> bool:
        return self.params.detokenize and (self.stream or bool(self.params.stop_list))
