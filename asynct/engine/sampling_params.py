"""`SamplingParams`, as in vLLM; every value is checked when it is made, before any work starts.
Types are strict: a bool is not an integer and a string is not a number."""
import logging
import math
import operator
import re
from dataclasses import dataclass, field, fields

# vLLM's floor: below it logits / temperature can overflow float32 (inf, NaN), so a smaller
# positive temperature is raised to it (with a warning); only 0 means greedy
MIN_TEMPERATURE = 1e-2
INT64_MIN, UINT64_END = -2**63, 2**64     # what a torch.Generator seed can hold
INT64_END = 2**63
log = logging.getLogger("asynct")
MAX_PENALTY = 2.0      # presence and frequency penalties: OpenAI's and vLLM's [-2, 2]
# the sampler's logits are fp32, and an inf among them makes the row's softmax NaN, which drew
# token 0 whatever the row allowed (a bias of 1e300 is inf in fp32; a logit divided by a repetition
# penalty of 1e-40 overflows). At these bounds the worst case stays finite: a logit of 1e30
# (biased), / 1e-6 (penalty), / 0.01 (the temperature floor) is 1e38, below fp32's 3.4e38.
MAX_LOGIT_BIAS = 1e30
MIN_REPETITION_PENALTY = 1e-6      # and at most its inverse
# the server's default cap on logprobs and prompt_logprobs (--max-logprobs; vLLM's default
# max_logprobs), and what the start-up memory profile samples with; LLM takes up to the vocabulary
MAX_LOGPROBS = 20


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
    # as vLLM: -1 asks for every token's (num_logprobs gives the count)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # asynct's addition (SGLang's logprob_start_len): the first prompt position whose logprob is
    # wanted; earlier entries are None, and the prefix cache may hold those positions' K/V (it
    # serves no request with prompt_logprobs otherwise: each position's logits must be computed)
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    # vLLM's: accepted for its callers; the fast tokenizers asynct loads decode without it, as
    # vLLM's fast detokenizer does
    spaces_between_special_tokens: bool = True
    # vLLM's: False leaves the text (and logprobs' decoded tokens) out: token ids only, no
    # decoding work (lm-eval's vllm backend scores so)
    detokenize: bool = True
    # as vLLM V1, on the raw logits of greedy rows too (asynct.engine.penalties)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # as vLLM: no output may end with one of these words (asynct.engine.bad_words); needs a tokenizer
    bad_words: list[str] | None = None
    # as vLLM: keep the prompt's last k tokens (left truncation); -1: the last max_model_len
    truncate_prompt_tokens: int | None = None
    stop_list: list[str] = field(init=False, repr=False)
    # bad_words' token sequences, from the engine's tokenizer when a request is added (vLLM's
    # SamplingParams.update_from_tokenizer), and what they are of (the tokenizer, the words): the
    # prompts that share these params, and the engine process they travel to, tokenise them once
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    bad_words_tokenised: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        problems = [msg for bad, msg in self._type_checks() if bad]
        if not problems:
            self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
            self.stop_token_ids = list(self.stop_token_ids or [])
            if self.allowed_token_ids is not None:
                self.allowed_token_ids = list(self.allowed_token_ids)
            self.top_k = 0 if self.top_k == -1 else self.top_k
            self.seed = None if self.seed == -1 else self.seed     # as vLLM's: -1 asks for no seed
            problems = [msg for bad, msg in self._checks() if bad]
        if problems:
            raise SamplingParamsError.of("invalid SamplingParams: ", problems)
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.warning("temperature %s is below %s, which can overflow the logits; raised to %s (as vLLM)",
                        self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        self._checked = _field_values(self.__dict__)

    def recheck(self):
        """Raises SamplingParamsError where a field set after the params were made is bad, and
        remakes stop_list (vLLM's own examples set fields of get_default_sampling_params()). Taken
        unchecked, such a stop was ignored, an n of 0 failed LLM.generate with a KeyError and a
        NaN temperature drew token 0."""
        if _field_values(self.__dict__) != self.__dict__.get("_checked"):
            self.__post_init__()

    def _type_checks(self):
        """Wrong types, found before anything is converted (list(5) would raise TypeError)."""
        return [
            (not _is_int(self.n), f"n must be an integer, got {self.n!r:.40}"),
            (not _is_real(self.temperature), f"temperature must be a finite number, got {self.temperature!r:.40}"),
            (not _is_real(self.top_p), f"top_p must be a finite number, got {self.top_p!r:.40}"),
            (not _is_real(self.min_p), f"min_p must be a finite number, got {self.min_p!r:.40}"),
            (not _is_int(self.top_k), f"top_k must be an integer, got {self.top_k!r:.40}"),
            (not _is_int(self.min_tokens), f"min_tokens must be an integer, got {self.min_tokens!r:.40}"),
            (not _is_int(self.prompt_logprobs_start),
             f"prompt_logprobs_start must be an integer, got {self.prompt_logprobs_start!r:.40}"),
            *[(v is not None and not _is_int(v), f"{name} must be an integer or None, got {v!r:.40}")
              for name, v in (("seed", self.seed), ("max_tokens", self.max_tokens), ("logprobs", self.logprobs),
                              ("prompt_logprobs", self.prompt_logprobs),
                              ("truncate_prompt_tokens", self.truncate_prompt_tokens))],
            *[(not isinstance(v, bool), f"{name} must be a bool, got {v!r:.40}")
              for name, v in (("ignore_eos", self.ignore_eos), ("skip_special_tokens", self.skip_special_tokens),
                              ("include_stop_str_in_output", self.include_stop_str_in_output),
                              ("detokenize", self.detokenize),
                              ("spaces_between_special_tokens", self.spaces_between_special_tokens))],
            (not (self.stop is None or isinstance(self.stop, str) or _list_of(self.stop, str)),
             f"stop must be a string or a list of strings, got {self.stop!r:.40}"),
            (not (self.stop_token_ids is None or _list_of(self.stop_token_ids, int)),
             f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r:.40}"),
            *[(not _is_real(v), f"{name} must be a finite number, got {v!r:.40}")
              for name, v in (("presence_penalty", self.presence_penalty),
                              ("frequency_penalty", self.frequency_penalty),
                              ("repetition_penalty", self.repetition_penalty))],
            (not (self.logit_bias is None or isinstance(self.logit_bias, dict)
                  and _list_of(list(self.logit_bias), int) and all(map(_is_real, self.logit_bias.values()))),
             f"logit_bias must map token ids to finite numbers, got {self.logit_bias!r:.40}"),
            (not (self.allowed_token_ids is None or _list_of(self.allowed_token_ids, int)),
             f"allowed_token_ids must be a list of integers, got {self.allowed_token_ids!r:.40}"),
            (not (self.bad_words is None or _list_of(self.bad_words, str)),
             f"bad_words must be a list of strings, got {self.bad_words!r:.40}"),
        ]

    def _checks(self):
        return [
            (self.n < 1, f"n must be >= 1, got {self.n}"),
            (self.temperature < 0, f"temperature must be >= 0, got {self.temperature}"),
            (not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (not 0 <= self.top_k < INT64_END, f"top_k must be -1, 0 or a positive integer, got {self.top_k}"),
            (not 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is not None and self.max_tokens < 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens < 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is not None and 1 <= self.max_tokens < self.min_tokens,
             f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}"),
            *[(k is not None and k < -1, f"{name} must be >= 0 or -1 (the whole vocabulary), got {k}")
              for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs))],
            (self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens >= 1
                                                              or self.truncate_prompt_tokens == -1),
             f"truncate_prompt_tokens must be >= 1 (keep the prompt's last k tokens) or -1 (its last "
             f"max_model_len), got {self.truncate_prompt_tokens}"),
            (self.prompt_logprobs_start < 0, f"prompt_logprobs_start must be >= 0, got {self.prompt_logprobs_start}"),
            (self.seed is not None and not INT64_MIN <= self.seed < UINT64_END,
             f"seed must fit in 64 bits ([-2**63, 2**64)), got {self.seed}"),
            (any(not s for s in self.stop_list), "stop strings must be non-empty strings"),
            (self.stop_list and not self.detokenize, "stop strings need detokenize=True (they match the text)"),
            (any(not 0 <= t < INT64_END for t in self.stop_token_ids), "stop_token_ids must be token ids"),
            *[(not -MAX_PENALTY <= v <= MAX_PENALTY, f"{name} must be in [-2, 2], got {v}")
              for name, v in (("presence_penalty", self.presence_penalty),
                              ("frequency_penalty", self.frequency_penalty))],
            (self.repetition_penalty <= 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.repetition_penalty > 0 and not MIN_REPETITION_PENALTY <= self.repetition_penalty
             <= 1 / MIN_REPETITION_PENALTY, f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
             f"{1 / MIN_REPETITION_PENALTY:g}] (fp32 logits overflow), got {self.repetition_penalty}"),
            (any(not 0 <= t < INT64_END for t in self.logit_bias or ()), "logit_bias keys must be token ids"),
            (any(abs(b) > MAX_LOGIT_BIAS for b in (self.logit_bias or {}).values()),
             f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (fp32 logits overflow)"),
            (self.allowed_token_ids is not None and not self.allowed_token_ids, "allowed_token_ids must not be empty"),
            (any(not 0 <= t < INT64_END for t in self.allowed_token_ids or ()), "allowed_token_ids must be token ids"),
        ]

    def check_model(self, vocab_size: int):
        """Raises ValueError where a value does not fit the model's vocabulary."""
        problems = [
            (self.top_k > vocab_size, f"top_k={self.top_k} exceeds the vocabulary size {vocab_size}"),
            (any(t >= vocab_size for t in self.stop_token_ids),
             f"stop_token_ids must be below the vocabulary size {vocab_size}"),
            # each under its own name: prompt_logprobs=300 was reported as "logprobs=300"
            *[((k or 0) > vocab_size, f"{name}={k} exceeds the vocabulary size {vocab_size}")
              for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs))],
            (any(t >= vocab_size for t in self.logit_bias or ()),
             f"logit_bias token ids must be below the vocabulary size {vocab_size}"),
            (any(t >= vocab_size for t in self.allowed_token_ids or ()),
             f"allowed_token_ids must be below the vocabulary size {vocab_size}"),
        ]
        bad = [msg for is_bad, msg in problems if is_bad]
        if bad:
            raise SamplingParamsError.of("", bad)

    @staticmethod
    def num_logprobs(k: int | None, vocab_size: int) -> int | None:
        """How many top logprobs `logprobs` or `prompt_logprobs` k asks for: -1 is the vocabulary."""
        return vocab_size if k == -1 else k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias, allowed_token_ids or bad_words change the row's logits."""
        return bool(self.penalised or self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def output_text_buffer_length(self) -> int:
        """vLLM's: how many of a running stream's last characters wait, since a stop string
        may begin there and cut them. 0 where the stop is kept in the text: a cut then ends
        past every character shown before."""
        if not self.stop_list or self.include_stop_str_in_output:
            return 0
        return max(map(len, self.stop_list)) - 1


# the fields as given (a tuple, taken in C: a request's recheck costs about a microsecond)
_field_values = operator.itemgetter(*[f.name for f in fields(SamplingParams) if f.init])


class SamplingParamsError(ValueError):
    """Bad sampling values; `param` is the field of the first, so that the server's 400 can name
    it as OpenAI's errors do. Every problem's message starts with its field's name."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    @classmethod
    def of(cls, prefix: str, problems: list[str]) -> "SamplingParamsError":
        return cls(prefix + "; ".join(problems), re.match(r"\w+", problems[0]).group())

    def __reduce__(self):     # pickled whole (a process pool's worker raising it): message and param
        return type(self), (str(self), self.param)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    try:
        return (isinstance(x, float) or _is_int(x)) and math.isfinite(float(x))
    except OverflowError:      # an int beyond float range
        return False


def _list_of(xs, kind) -> bool:
    return isinstance(xs, (list, tuple)) and all(isinstance(x, kind) and not isinstance(x, bool) for x in xs)
