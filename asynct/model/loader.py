"""Loads a spec checkpoint's tensors into the engine model (fused QKV and gate/up)."""
import re

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from asynct.model.checkpoint import safetensors_files

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# checkpoint projection -> (the engine's fused parameter, shard index)
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def engine_param_name(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (engine parameter name, shard index or None)."""
    if name.startswith("lm_head."):
        return name, None
    m = _LAYER.fullmatch(name)
    if not m:
        return name.removeprefix("model."), None
    i, rest = m.groups()
    rest = rest.removeprefix("self_attn.").removeprefix("mlp.")
    proj = rest.split(".")[0]
    if proj in PACKED:
        fused, shard = PACKED[proj]
        return f"layers.{i}.{fused}.weight", shard
    if proj == "input_layernorm":
        return f"input_norms.{i}.{rest.split('.')[1]}", None
    if rest == "sigma":
        return f"layers.{i}.attn.sigma", None
    return f"layers.{i}.{rest}", None


def shard_rows(config, fused: str, shard: int) -> slice:
    d = config.head_dim
    if fused.endswith("qkv_proj.weight"):
        sizes = [config.num_attention_heads * d] + [config.num_key_value_heads * d] * 2
    else:
        sizes = [config.intermediate_size] * 2
    start = sum(sizes[:shard])
    return slice(start, start + sizes[shard])


@torch.no_grad()
def load_weights(model, path):
    params = dict(model.named_parameters())
    loaded = set()
    files = safetensors_files(path)
    with tqdm(total=sum(f.stat().st_size for f in files), desc="Loading weights", unit="B", unit_scale=True,
              disable=None) as bar:  # disable=None: only on a terminal
        for f in files:
            bar_at_file = bar.n
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    target, shard = engine_param_name(name)
                    param = params[target]
                    dst = param if shard is None else param[shard_rows(model.config, target, shard)]
                    tensor = sf.get_tensor(name)
                    dst.copy_(tensor.to(param.dtype))
                    loaded.add(target)
                    bar.update(tensor.numel() * tensor.element_size())
            bar.update(bar_at_file + f.stat().st_size - bar.n)  # the file's header
    missing = set(params) - loaded
    if missing:  # the checkpoint's tensors were checked first, so this is a bug here
        raise RuntimeError(f"engine parameters not loaded: {sorted(missing)}")
