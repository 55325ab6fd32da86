"""`SamplingParams`, as in vLLM; every value is checked when it is made, before any work starts."""
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        problems = [msg for bad, msg in self._checks() if bad]
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    def _checks(self):
        return [
            (not isinstance(self.n, int) or self.n < 1, f"n must be an integer >= 1, got {self.n!r}"),
            (not _num(self.temperature) or self.temperature < 0, f"temperature must be >= 0, got {self.temperature!r}"),
            (not _num(self.top_p) or not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (not isinstance(self.top_k, int) or self.top_k < 0, f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}"),
            (not _num(self.min_p) or not 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1),
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (not isinstance(self.min_tokens, int) or self.min_tokens < 0, f"min_tokens must be >= 0, got {self.min_tokens!r}"),
            (self.max_tokens is not None and isinstance(self.min_tokens, int) and self.min_tokens > self.max_tokens,
             f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}"),
            (self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0),
             f"logprobs must be an integer >= 0, got {self.logprobs!r}"),
            (self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0),
             f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}"),
            (self.seed is not None and not isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
            (any(not isinstance(s, str) or not s for s in self.stop_list), "stop strings must be non-empty strings"),
            (any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids), "stop_token_ids must be token ids"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def max_logprobs(self) -> int:
        return max(self.logprobs or 0, self.prompt_logprobs or 0)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
