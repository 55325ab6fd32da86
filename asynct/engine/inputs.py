"""What a request brings, checked against the model before it is queued: the prompt as token
ids, its length, and sampling values that must fit the vocabulary (also run by the server's
front end and by data parallel's dispatcher, which hold no engine)."""
from asynct.engine.bad_words import bad_words_token_ids
from asynct.engine.detokenizer import Detokenizer
from asynct.engine.sampling_params import SamplingParams, SamplingParamsError


def tokenize(detokenizer: Detokenizer | None, prompt) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text or token ids; ValueError if neither.
    Text gets the tokenizer's special tokens (BOS), as vLLM's generate; token ids go as given."""
    if isinstance(prompt, str):
        if detokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: give prompt_token_ids instead of text")
        return prompt, detokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    # exact ints only (bool and NumPy integers refused): the types' set, not an isinstance a
    # token, which took 51 ms of intake for an evaluation pass of 563K prompt tokens (CPU)
    if not set(map(type, ids)) <= {int}:
        raise ValueError("prompt token ids must be integers")
    return None, ids


def truncate_prompt(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """As vLLM: truncate_prompt_tokens keeps the prompt's last k tokens (-1: max_model_len), before
    the prompt is checked, so that a prompt too long for the context runs truncated."""
    params.recheck()     # a k set after the params were made (2.5) failed the slice with a TypeError
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    return ids[-(max_model_len if k == -1 else k):]


def check_stop_strings(detokenizer: Detokenizer | None, params: SamplingParams):
    """Stop strings are searched for in the output's text: without a tokenizer there is none,
    and they would be ignored silently (generation running on to max_tokens)."""
    if params.stop_list and detokenizer is None:
        raise SamplingParamsError("stop strings need a tokenizer and this checkpoint has none: use stop_token_ids",
                                  "stop")


def check_bad_words(detokenizer: Detokenizer | None, params: SamplingParams, vocab_size: int):
    """Tokenises bad_words into params (vLLM's update_from_tokenizer): they are text, so without
    a tokenizer they could not be kept out, and would be ignored silently."""
    if not params.bad_words:
        return
    if detokenizer is None:
        raise SamplingParamsError("bad_words need a tokenizer and this checkpoint has none: use logit_bias "
                                  "to ban token ids", "bad_words")
    # the words and the tokenizer they were tokenised with (params may serve two models)
    key = (getattr(detokenizer.tokenizer, "name_or_path", None), vocab_size, tuple(params.bad_words))
    if params.bad_words_tokenised == key:      # another prompt of these params did
        return
    try:
        params.bad_words_token_ids = bad_words_token_ids(detokenizer, params.bad_words, vocab_size)
    except ValueError as e:
        raise SamplingParamsError(str(e), "bad_words") from None
    params.bad_words_tokenised = key


def check_prompt(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int):
    """Raises ValueError naming what is wrong with a tokenized prompt or with sampling values
    that do not fit this model (also run by the server's front end, which holds no engine)."""
    params.recheck()       # fields set after the params were made
    params.check_model(vocab_size)
    if not ids:
        raise ValueError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {vocab_size})")
    if len(ids) > max_model_len:   # as vLLM's LLM: a whole-context prompt scores, then samples one token
        raise ValueError(f"the prompt has {len(ids)} tokens; this model takes at most "
                         f"{max_model_len} prompt tokens (max_model_len={max_model_len})")
    if params.prompt_logprobs is not None and params.prompt_logprobs > vocab_size:
        raise ValueError("prompt_logprobs exceeds the vocabulary size")
