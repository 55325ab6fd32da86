"""`AsyncTConfig`: the checkpoint's config.json, with docs/model.md's defaults (presets: asynct/presets.py)."""
import json
import math
import sys

import torch

from transformers import PretrainedConfig

from asynct.presets import PRESETS


ARCHITECTURE = "AsyncTForCausalLM"
AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")


def _is_positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _is_token_ids(x) -> bool:
    ids = x if isinstance(x, (list, tuple)) else [] if x is None else [x]
    return all(isinstance(i, int) and not isinstance(i, bool) for i in ids)   # -1: none (some converters)


def _is_flag(x) -> bool:
    """true or false, or 0 or 1 as some converters write them: those read right, a string does
    not ("false" is true)."""
    return isinstance(x, int) and x in (0, 1)


def _default_head_dim(hidden_size, num_attention_heads):
    """hidden_size / num_attention_heads, or None (validate_asynct names the bad one) where
    either is no positive integer: dividing raised ZeroDivisionError or TypeError."""
    if _is_positive_int(hidden_size) and _is_positive_int(num_attention_heads):
        return hidden_size // num_attention_heads
    return None


def _is_floating_dtype(dtype) -> bool:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


class AsyncTConfig(PretrainedConfig):
    model_type = "asynct"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_scale=None,
        asynci_pool_size=3,
        asynci_relu_pre=True,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        torch_dtype=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or _default_head_dim(hidden_size, num_attention_heads)
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.attention_scale = attention_scale
        self.asynci_pool_size = asynci_pool_size
        self.asynci_relu_pre = asynci_relu_pre
        self.initializer_range = initializer_range
        kwargs["dtype"] = kwargs.get("dtype") or torch_dtype or "bfloat16"
        # vLLM picks its model class by `architectures` ("No model architectures are specified"
        # without one), but docs/model.md requires only the sizes: a config.json may lack it
        kwargs["architectures"] = kwargs.get("architectures") or [ARCHITECTURE]
        if not _is_floating_dtype(kwargs["dtype"]):   # transformers' getattr(torch, ...) raised AttributeError
            raise ValueError(f"invalid AsyncT config: torch_dtype={kwargs['dtype']!r} is not a floating dtype "
                             "(use bfloat16, float16 or float32)")
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_asynct()

    def to_dict(self):
        # `dyht_shapes` is derived from the tensors at load time; it is not part of config.json.
        d = super().to_dict()
        d.pop("dyht_shapes", None)
        return d

    def to_json_string(self, use_diff: bool = True) -> str:
        # config.json also names the dtype `torch_dtype`, docs/model.md's (and converters') field
        d = json.loads(super().to_json_string(use_diff))
        if d.get("dtype") is not None:
            d["torch_dtype"] = d["dtype"]
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @property
    def weights_dtype(self) -> torch.dtype:
        dt = self.dtype
        return dt if isinstance(dt, torch.dtype) else getattr(torch, str(dt).replace("torch.", ""))

    @property
    def scale(self) -> float:
        """The AsyncI score scale: 1/sqrt(model width) unless the checkpoint says otherwise."""
        if self.attention_scale is not None:
            return float(self.attention_scale)
        return 1.0 / math.sqrt(self.hidden_size)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def validate_asynct(self):
        # a size of the wrong type failed deep in loading ("arange() received an invalid
        # combination of arguments"), a zero built an engine that takes no prompt
        problems = [f"{name}={getattr(self, name)!r} must be a positive integer" for name in SIZE_FIELDS
                    if not _is_positive_int(getattr(self, name))]
        if problems:
            raise ValueError("invalid AsyncT config: " + "; ".join(problems))
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        if not isinstance(self.asynci_pool_size, int) or self.asynci_pool_size < 1:
            problems.append(f"asynci_pool_size={self.asynci_pool_size!r} must be an integer >= 1")
        for name in ("asynci_relu_pre", "tie_word_embeddings"):   # the string "false" would read as true
            if not _is_flag(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        if not _is_token_ids(self.eos_token_id):   # the string "256" matched no token: nothing stopped at EOS
            problems.append(f"eos_token_id={self.eos_token_id!r} must be a token id, a list of them, or null")
        if problems:
            raise ValueError("invalid AsyncT config: " + "; ".join(problems))


def preset_config(name: str, **overrides) -> AsyncTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return AsyncTConfig(**{**PRESETS[name], **overrides})


def register_with_transformers():
    from transformers.models.auto.configuration_auto import AutoConfig
    AutoConfig.register("asynct", AsyncTConfig, exist_ok=True)


# Only where transformers has loaded AutoConfig already; else asynct/__init__.py's import hook calls
# this when it loads. Loading it here indexed every model family transformers has: 0.45 s of every
# engine process's start on an H200's host, and the engine never asks AutoConfig.
if AUTO_CONFIG_MODULE in sys.modules:
    register_with_transformers()
