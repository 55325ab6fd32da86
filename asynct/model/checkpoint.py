"""Checkpoint I/O: validate a spec checkpoint against its config, and make random ones from presets."""
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from asynct.config import AsyncTConfig, preset_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DYHT_NAMES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")


class CheckpointError(ValueError):
    """A checkpoint that does not match docs/model.md's format; the message lists every problem."""

    def __init__(self, path, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"checkpoint {path} has {len(self.problems)} problem(s):\n{lines}")


def read_json(path, name: str):
    """A checkpoint's JSON file; json's own error named neither the file nor the checkpoint."""
    try:
        return json.loads((Path(path) / name).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(path, [f"{name} is not valid JSON: {e}"]) from None


def safetensors_files(path) -> list[Path]:
    path = Path(path)
    if (path / INDEX_FILE).exists():
        index = read_json(path, INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):   # a KeyError or AttributeError came from here
            raise CheckpointError(path, [f"{INDEX_FILE} has no weight_map object (tensor name -> shard file)"])
        bad = sorted(name for name, f in weight_map.items() if not isinstance(f, str))
        if bad:   # sorting the shard names raised a TypeError (str < int)
            raise CheckpointError(path, [f"{INDEX_FILE} maps {n} to {weight_map[n]!r}, not a shard file name"
                                         for n in bad])
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    raise CheckpointError(path, [f"no {SINGLE_FILE} or {INDEX_FILE} found"])


def is_floating(safetensors_dtype: str) -> bool:
    """F32, F16, BF16, F8_E4M3, ... as a safetensors header names them (I8, U8, BOOL are not)."""
    return safetensors_dtype.startswith(("F", "BF"))


def tensor_shapes(path, problems: list) -> dict[str, tuple]:
    """Name -> shape of every tensor, read from the safetensors headers only; what the headers
    alone show wrong goes into `problems` (_header_problems)."""
    shapes, file_of = {}, {}
    for f in safetensors_files(path):
        if not f.exists():
            raise CheckpointError(path, [f"shard {f.name} named in {INDEX_FILE} is missing"])
        try:
            sf = safe_open(f, framework="pt")
        except SafetensorError as e:   # its message ("header too large") names no file
            raise CheckpointError(path, [f"{f.name} is not a readable safetensors file: {e}"]) from None
        with sf:
            for name in sf.keys():
                header = sf.get_slice(name)
                shapes[name] = tuple(header.get_shape())
                problems += _header_problems(name, header.get_dtype(), file_of.get(name), f.name)
                file_of[name] = f.name
    return shapes


def _header_problems(name: str, dtype: str, earlier_file: str | None, file: str) -> list[str]:
    """A tensor that is not floating point (an int8-quantised weight was cast to float and
    loaded silently, and the model wrote garbage), and one in two shards (the last file in name
    order won, silently)."""
    problems = [f"tensor {name} is stored twice, in {earlier_file} and {file}"] if earlier_file else []
    if not is_floating(dtype):
        problems.append(f"tensor {name} has dtype {dtype}; AsyncT weights are floating point (quantised "
                        "checkpoints are not supported)")
    return problems


def checked_shapes(path, config: AsyncTConfig) -> dict[str, tuple]:
    """tensor_shapes, after one CheckpointError listing every problem of the headers and of the
    tensors against `config` (the engine's load and the vLLM plugin's)."""
    problems = []
    shapes = tensor_shapes(path, problems)
    problems += check_tensors(config, shapes)
    if problems:
        raise CheckpointError(path, problems)
    return shapes


def dyht_modules(config: AsyncTConfig) -> dict[str, int]:
    """Prefix of every DyHT in the model -> its channel count."""
    mods = {"model.norm": config.hidden_size}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        mods.update({f"{p}.{n}": config.hidden_size for n in DYHT_NAMES})
        mods.update({f"{p}.self_attn.q_norm": config.head_dim, f"{p}.self_attn.k_norm": config.head_dim})
    return mods


def expected_tensors(config: AsyncTConfig) -> dict[str, list[tuple]]:
    """Name -> the shapes docs/model.md allows for it."""
    c, i, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    hq, hkv = config.num_attention_heads * d, config.num_key_value_heads * d
    exp = {"model.embed_tokens.weight": [(v, c)]}
    if not config.tie_word_embeddings:
        exp["lm_head.weight"] = [(v, c)]
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}"
        exp.update({f"{p}.self_attn.q_proj.weight": [(hq, c)], f"{p}.self_attn.k_proj.weight": [(hkv, c)],
                    f"{p}.self_attn.v_proj.weight": [(hkv, c)], f"{p}.self_attn.o_proj.weight": [(c, hq)],
                    f"{p}.self_attn.sigma": [(config.num_attention_heads,)],
                    f"{p}.mlp.gate_proj.weight": [(i, c)], f"{p}.mlp.up_proj.weight": [(i, c)],
                    f"{p}.mlp.down_proj.weight": [(c, i)]})
    for prefix, ch in dyht_modules(config).items():
        exp[f"{prefix}.alpha"] = [(1,), (ch,)]
        exp[f"{prefix}.weight"] = [(ch,), (1,)]
    return exp


def check_tensors(config: AsyncTConfig, shapes: dict[str, tuple]) -> list[str]:
    exp = expected_tensors(config)
    problems = [f"missing tensor {n} (expected shape {list(exp[n][0])})" for n in exp if n not in shapes]
    for n, shape in shapes.items():
        if n not in exp:
            why = " (config.json says tie_word_embeddings=true)" if n == "lm_head.weight" else ""
            problems.append(f"unexpected tensor {n} {list(shape)}{why}")
        elif shape not in exp[n]:
            allowed = " or ".join(str(list(s)) for s in exp[n])
            problems.append(f"tensor {n} has shape {list(shape)}, config.json implies {allowed}")
    return problems


def dyht_shapes(config: AsyncTConfig, shapes: dict[str, tuple]) -> dict[str, int]:
    return {f"{p}.{w}": shapes[f"{p}.{w}"][0] for p in dyht_modules(config) for w in ("alpha", "weight")
            if f"{p}.{w}" in shapes}


def prepare_config_for_load(path, config=None) -> AsyncTConfig:
    """Loads (or takes) the config, checks every tensor against it, and records the DyHT
    parameter shapes so the model is built to match them. Raises CheckpointError."""
    path = Path(path)
    if not path.exists():   # "not a directory" sent a user with a mistyped path looking for a file
        raise CheckpointError(path, ["no such directory (asynct loads local checkpoints only, never from the "
                                     "Hugging Face hub: download one first, e.g. `hf download ID --local-dir DIR`)"])
    if not path.is_dir():
        raise CheckpointError(path, ["a file, not a checkpoint directory"])
    if config is None:
        config = load_config(path)
    config.dyht_shapes = dyht_shapes(config, checked_shapes(path, config))
    return config


def load_config(path) -> AsyncTConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(path, ["config.json is missing"])
    raw = read_json(path, "config.json")
    if not isinstance(raw, dict):   # raw.get raised a bare AttributeError
        raise CheckpointError(path, ["config.json is not a JSON object"])
    if raw.get("model_type") != "asynct":
        raise CheckpointError(path, [f"config.json model_type is {raw.get('model_type')!r}, expected 'asynct'"])
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in raw]
    if missing:
        raise CheckpointError(path, [f"config.json lacks required field {k}" for k in missing])
    try:
        return AsyncTConfig.from_pretrained(path)
    except ValueError as e:
        raise CheckpointError(path, [str(e)]) from None


def make_checkpoint(preset: str, out_dir, seed: int = 0, dtype: str | None = None,
                    tokenizer: bool | None = None, max_shard_size=None, **overrides) -> Path:
    """Writes a random-weight checkpoint of a named preset (no network)."""
    from asynct.model.reference import AsyncTForCausalLM
    from asynct.model.tokenizer import save_byte_tokenizer
    config = preset_config(preset, **overrides)
    if dtype:
        config.dtype = dtype
    if tokenizer is None:
        tokenizer = config.vocab_size <= 1024
    if tokenizer:
        config.bos_token_id, config.eos_token_id, config.pad_token_id = 258, 256, 257
    # bench-0.6b takes half a minute on a CPU, mostly in the random init: say which stage runs
    stages = tqdm(["random weights", "writing"], desc=f"make-checkpoint {preset}", unit="stage",
                  bar_format="{desc}: {n_fmt}/{total_fmt} stages [{elapsed}] {postfix}", disable=None)
    with stages:
        stages.set_postfix_str(stages.iterable[0])
        torch.manual_seed(seed)
        model = AsyncTForCausalLM(config).to(config.weights_dtype)
        stages.update()
        stages.set_postfix_str(stages.iterable[1])
        out_dir = Path(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(out_dir, **kwargs)
        if tokenizer:
            save_byte_tokenizer(out_dir)
        stages.update()
    return out_dir
