"""A checkpoint's generation_config.json, read as vLLM reads it (`generation_config="auto"`).

Its sampling values are what the model's authors recommend: they become the defaults of requests
that leave them unset (`LLM.generate` without SamplingParams, the server's unset fields). Its
`eos_token_id` may list more ids than config.json's (Llama 3 and chat models put their end-of-turn
token only there): those stop generation too, as a request's stop_token_ids. "vllm" keeps the
engine's own sampling defaults (the EOS ids still count, as in vLLM); a folder reads that
folder's file instead of the model's."""
import logging
from pathlib import Path

log = logging.getLogger("asynct")
FILE = "generation_config.json"
# the fields vLLM takes as defaults; transformers' max_new_tokens is vLLM's max_tokens
SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                   "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def check_source(source):
    """A ValueError where `source` is neither "auto", "vllm" nor a folder holding the file."""
    if not isinstance(source, str):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r:.60}")
    if source not in ("auto", "vllm") and not (Path(source) / FILE).is_file():
        raise ValueError(f"generation_config={source!r}: no {FILE} there (use 'auto' for the model's own, "
                         "'vllm' for asynct's defaults, or a folder that holds one)")


def read(source: str, model: str) -> dict:
    """The file's values that differ from transformers' defaults (what vLLM reads); {} without one."""
    folder = Path(model if source in ("auto", "vllm") else source)
    if not (folder / FILE).is_file():
        return {}
    from transformers import GenerationConfig
    try:
        values = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except Exception as e:   # transformers' OSError or ValueError, from deep in its loader
        raise ValueError(f"{folder / FILE} is not a valid generation config: {e}") from None
    ids = values.get("eos_token_id")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in _as_list(ids)):
        raise ValueError(f"{folder / FILE}: eos_token_id must be a token id or a list of them, got {ids!r:.60}")
    return values


def sampling_defaults(values: dict, overrides: dict | None = None) -> dict:
    """SamplingParams keyword arguments from the file's values, `overrides` over them."""
    unknown = sorted(set(overrides or {}) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: {unknown} are not sampling defaults; "
                         f"known: {sorted(SAMPLING_FIELDS)}")
    values = {**values, **(overrides or {})}
    return {SAMPLING_FIELDS[k]: v for k, v in values.items() if k in SAMPLING_FIELDS and v is not None}


def request_defaults(args) -> dict:
    """EngineArgs' sampling defaults ("vllm": none but the overrides), checked: a bad value in the
    file fails before a model loads."""
    from asynct.engine.sampling_params import SamplingParams
    values = read(args.generation_config, args.model)
    defaults = sampling_defaults({} if args.generation_config == "vllm" else values, args.override_generation_config)
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"the generation config's sampling defaults: {e}") from None
    if defaults:
        log.warning("default sampling parameters from the model's generation config: %s "
                    "(generation_config='vllm' keeps asynct's own)", defaults)
    return defaults


def extra_eos_ids(source: str, model: str, eos_token_ids: list[int], vocab_size: int) -> list[int]:
    """The file's eos_token_id ids that config.json's do not hold (ids outside the vocabulary
    could never be sampled: dropped)."""
    ids = _as_list(read(source, model).get("eos_token_id"))
    return [i for i in dict.fromkeys(ids) if 0 <= i < vocab_size and i not in eos_token_ids]


def _as_list(ids) -> list:
    return list(ids) if isinstance(ids, (list, tuple)) else [] if ids is None else [ids]
