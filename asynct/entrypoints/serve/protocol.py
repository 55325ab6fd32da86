"""Request bodies of the OpenAI-compatible API and their translation to `SamplingParams`.
Unknown fields are ignored (clients send vendor extras); known ones that asynct cannot honour
are refused with a 400 rather than silently dropped. Types are strict, as OpenAI's API: "3" is not
a number, 1 is not a bool, and NaN, Infinity and lone surrogates ("\ud800") are refused."""
import json
from typing import Annotated, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag, model_validator

from asynct.engine.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

MAX_TEMPERATURE = 2.0      # OpenAI's cap
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

TokenIds = list[StrictInt]


def _prompt_form(v) -> str | None:
    """Which of the four prompt forms a value takes, by its first item: pydantic then checks that
    form alone (trying each form of a plain union over a million prompts took it a second)."""
    if isinstance(v, list):
        first = v[0] if v else 0
        return "texts" if isinstance(first, str) else "token lists" if isinstance(first, list) else "token ids"
    return "text" if isinstance(v, str) else None


Prompt = Annotated[Union[Annotated[str, Tag("text")], Annotated[list[str], Tag("texts")],
                         Annotated[TokenIds, Tag("token ids")], Annotated[list[TokenIds], Tag("token lists")]],
                   Discriminator(_prompt_form, custom_error_type="prompt_type", custom_error_message=(
                       "Input should be a string, a list of strings, a list of token ids or a list of them"))]
# the request's sampling fields that may be null
NULLABLE = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class Body(BaseModel):
    """A whole request body: every string in it, keys and unknown fields included, is checked
    once for valid Unicode (a lone surrogate cannot be tokenised, nor written back as UTF-8)."""
    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        bad = first_invalid_unicode(data)
        if bad is not None:
            raise ValueError(f"{bad} is not valid Unicode (it holds a lone surrogate)")
        return data


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False      # vLLM's: with include_usage, usage in every chunk too


class SamplingFields(Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = Field(None, le=MAX_TEMPERATURE)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None        # OpenAI's: token ids as strings ("50256")
    allowed_token_ids: TokenIds | None = None
    response_format: dict | None = None
    return_token_ids: bool = False        # extension: token ids in each choice (benchmarks)
    user: str | None = None
    truncate_prompt_tokens: int | None = None     # vLLM's: keep the prompt's last k tokens
    prompt_logprobs: int | None = None            # vLLM's: each prompt token's logprob and the top k
    bad_words: list[str] | None = None            # vLLM's: words no output may end with
    # vLLM's fields that change the output and that asynct cannot apply: known, so that a value
    # other than vLLM's no-op is a 400 rather than an unknown field dropped
    use_beam_search: bool = False
    logprob_token_ids: TokenIds | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_tokens_as_token_ids: bool | None = None
    priority: int = 0
    thinking_token_budget: int | None = None
    repetition_detection: dict | None = None
    NOT_APPLIED: ClassVar[dict] = {  # field: its values that change nothing
        "use_beam_search": (False,), "logprob_token_ids": (None,), "structured_outputs": (None,),
        "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
        "return_tokens_as_token_ids": (None, False), "priority": (0,), "thinking_token_budget": (None, -1),
        "repetition_detection": (None,)}
    # SamplingParams' fields (and the engine's "prompt") that this request calls otherwise: an
    # error names the field the client sent
    RENAMED: ClassVar[dict] = {}
    # fields OpenAI's API (and vLLM's server) take as null, meaning their default: the client sends
    # a caller's `n=None` as null
    NULL_IS_DEFAULT: ClassVar[tuple] = ("n", "stream", "return_token_ids")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls.NULL_IS_DEFAULT):
            return {k: v for k, v in data.items() if not (k in cls.NULL_IS_DEFAULT and v is None)}
        return data

    def api_param(self, field: str) -> str:
        return self.RENAMED.get(field, field)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None = None,
                        prompt_logprobs: int | None = None, defaults: dict | None = None,
                        max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        """Raises ValueError (a 400) for values the engine rejects or cannot honour. `defaults`:
        the generation config's values for the fields left unset (null), as vLLM's server.
        `max_logprobs`: the server's --max-logprobs."""
        defaults = defaults or {}
        cap = defaults.get("max_tokens")
        if cap is not None and (max_tokens is None or max_tokens > cap):
            # as vLLM: the generation config's max_new_tokens caps every request
            max_tokens = cap
            if self.min_tokens > cap:
                raise Unsupported("min_tokens", f"min_tokens={self.min_tokens} exceeds max_tokens={cap}, the "
                                                "most this model's generation config allows (max_new_tokens)")
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options is only allowed with stream: true (as OpenAI's "
                                                "and vLLM's servers)")
        for name, noops in self.NOT_APPLIED.items():
            if getattr(self, name) not in noops:
                raise Unsupported(name, f"{name} is not supported (only {' or '.join(map(json.dumps, noops))})")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise Unsupported("response_format", f"response_format {self.response_format.get('type')!r} is not "
                                                 'supported (no guided decoding; only {"type": "text"})')
        for field, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            check_logprobs(self.api_param(field), k, max_logprobs)
        # a field sent as null (or not at all) takes the generation config's value, else SamplingParams' default
        unset = {k: v for k, v in defaults.items() if k in NULLABLE}
        given = {k: getattr(self, k) for k in NULLABLE if getattr(self, k) is not None}
        try:
            return SamplingParams(
                **{**unset, **given}, n=self.n, seed=self.seed, max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
                logit_bias=self._logit_bias(),
                allowed_token_ids=self.allowed_token_ids, truncate_prompt_tokens=self.truncate_prompt_tokens,
                bad_words=self.bad_words)
        except SamplingParamsError as e:
            raise Unsupported(self.api_param(e.param), str(e)) from None

    def _logit_bias(self) -> dict[int, float] | None:
        """As vLLM's server: keys are token ids written as strings, biases clamped to OpenAI's [-100, 100]."""
        if self.logit_bias is None:
            return None
        bad = next((k for k in self.logit_bias if not _is_int_string(k)), None)
        if bad is not None:
            raise Unsupported("logit_bias", 'logit_bias keys must be token ids written as strings ("50256"), '
                                            f"got {bad!r:.40}")
        return {int(k): min(100.0, max(-100.0, b)) for k, b in self.logit_bias.items()}

    def prompt_logprobs_k(self, max_logprobs: int = MAX_LOGPROBS) -> int | None:
        """The prompt_logprobs the response returns (None: no field), capped as logprobs. As
        vLLM's, a stream carries none, so asking for any there is a 400."""
        k = self.prompt_logprobs
        if k is not None and k < -1:
            raise Unsupported("prompt_logprobs", f"prompt_logprobs must be >= 0 (or -1: the vocabulary), got {k}")
        check_logprobs("prompt_logprobs", k, max_logprobs)
        if k and self.stream:
            raise Unsupported("prompt_logprobs", "prompt_logprobs are not available with stream: true (as vLLM's)")
        return None if self.stream else k

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True       # vLLM's: a text prompt gets the tokenizer's BOS
    RENAMED: ClassVar[dict] = {"prompt_logprobs": "logprobs"}      # echo's prompt logprobs: `logprobs` asks for them
    NULL_IS_DEFAULT: ClassVar[tuple] = ("n", "stream", "echo", "return_token_ids")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise Unsupported("prompt", "prompt is empty")
        return list(p)

    @property
    def requested_max_tokens(self) -> int | None:
        """max_tokens as the request asks (before the generation config's cap): what must fit
        in the context with the prompt, as vLLM checks it. Echo's 0 runs one step."""
        return 1 if self.max_tokens == 0 else self.max_tokens

    def to_params(self, defaults: dict | None = None, max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        if self.suffix:
            raise Unsupported("suffix", "suffix is not supported")
        if self.best_of not in (None, self.n):
            raise Unsupported("best_of", "best_of other than n is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise Unsupported("max_tokens", "max_tokens must be >= 1 (0 only with echo)")
        # echo with max_tokens 0 (scoring a prompt) still runs one step: that token is dropped
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        asked = self.prompt_logprobs_k(max_logprobs)
        # the engine computes the larger (-1, the vocabulary, above any); echo's rows and
        # prompt_logprobs each show their own k
        plp = echoed if asked is None else asked if echoed is None else -1 if -1 in (echoed, asked) else \
            max(echoed, asked)
        return self.sampling_params(self.requested_max_tokens, self.logprobs, plp, defaults, max_logprobs)


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: TokenIds


def check_logprobs(name: str, k: int | None, cap: int):
    """As vLLM's server: at most `cap` (--max-logprobs; -1: any), a request's -1 (the whole
    vocabulary) only where any is allowed."""
    if k is not None and cap >= 0 and (k == -1 or k > cap):
        raise Unsupported(name, f"{name} must be at most {cap} (--max-logprobs), got {k}")


class Unsupported(ValueError):
    """A known field with a value asynct refuses or cannot honour: a 400 that names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def first_invalid_unicode(data) -> str | None:
    """The path of the first string in parsed JSON that UTF-8 cannot encode, or None. Most bodies
    are valid: json's C encoder says so at once (walking a million prompts in Python held the
    event loop 3 s); only a body it refuses, or nests too deep for it, is walked for the path."""
    try:
        json.dumps(data, ensure_ascii=False, default=str).encode("utf-8")
        return None
    except (UnicodeEncodeError, RecursionError, ValueError):
        return _walk_for_invalid_unicode(data)


def _walk_for_invalid_unicode(data) -> str | None:
    """A stack, not recursion: the JSON may nest as deep as its parser allows."""
    stack = [("body", data)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(x, dict):
            # keys go on top: a path names only keys already found valid
            stack += [(f"{path}.{k}", v) for k, v in x.items()] + [(f"{path} key", k) for k in x]
        elif isinstance(x, list):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(x)]
    return None


def _is_int_string(s: str) -> bool:
    try:
        int(s)
    except ValueError:      # also one of over 4300 digits
        return False
    return True


def _or(value, default):
    return default if value is None else value
