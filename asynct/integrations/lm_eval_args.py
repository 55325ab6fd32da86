"""lm-eval's options for `AsyncTLM`, checked before anything runs: model_args (strings from the
command line) coerced to EngineArgs' field types, and gen_kwargs the engine has no knob for
refused rather than dropped."""

# lm-eval gen_kwargs that SamplingParams takes under the same name
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "repetition_penalty",
                  "presence_penalty", "frequency_penalty")

# gen_kwargs values that change nothing (tasks' YAMLs spell them out): taken
_NO_OPS = {"num_beams": 1}


def _refuse_unsupported(kw: dict):
    """gen_kwargs the engine has no knob for (num_beams=4, ...) were dropped,
    and the run scored plain sampling as if they had been applied (lm-eval's hf backend applies
    them, its vllm backend refuses them): refused before anything runs, but for values that
    change nothing (_NO_OPS)."""
    unsupported = sorted(k for k, v in kw.items()
                         if k not in (*_SAMPLING_KEYS, "do_sample") and not (k in _NO_OPS and v == _NO_OPS[k]))
    if unsupported:
        raise ValueError(f"gen_kwargs {', '.join(unsupported)} not supported by the asynct engine; it takes "
                         f"until, max_gen_toks, do_sample, {', '.join(_SAMPLING_KEYS)}")


def _engine_args(kw: dict) -> dict:
    """model_args arrive as strings from the command line ("max_num_seqs=64"): coerce them to
    the engine's field types, and drop lm-eval's own knobs that mean nothing here. A bad option
    is a ValueError, which `asynct eval` prints as one line (a TypeError was a traceback)."""
    from dataclasses import fields

    from asynct.engine.engine_args import EngineArgs
    types = {f.name: f.default for f in fields(EngineArgs) if f.name != "model"}
    out = {}
    for k, v in kw.items():
        if k in ("device", "dtype") and v in (None, "", "auto"):
            out[k] = None if k == "device" else "auto"
        elif k in types:
            try:
                out[k] = _coerce(v, types[k])
            except ValueError:
                kind = "bool (true/false, 1/0, yes/no, on/off)" if isinstance(types[k], bool) \
                    else type(types[k]).__name__
                raise ValueError(f"asynct model_args option {k}={v!r}: not a {kind}") from None
        elif k not in ("trust_remote_code", "parallelize"):
            raise ValueError(f"unknown asynct model_args option {k!r}; options: pretrained, max_gen_toks, add_bos_token, "
                             f"max_length, prefix_token_id, and the engine's {', '.join(sorted(types))}")
    return out


def _coerce(v, default):
    if isinstance(default, bool):
        from asynct.engine.engine_args import as_flag
        return as_flag("", v)
    if not isinstance(v, str):
        return v
    if isinstance(default, int) or (default is None and v.isdigit()):
        return int(v)
    if isinstance(default, float):
        return float(v)
    return None if v.lower() == "none" else v
