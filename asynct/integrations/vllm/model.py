"""AsyncT (docs/model.md) as a vLLM model: vLLM's parallel layers, DyHT, ReGLU, AsyncI attention.

Loads the spec's checkpoint format as is: q/k/v and gate/up are stacked into vLLM's fused
projections at load time, DyHT `alpha` / `weight` of shape [1] are broadcast to their channels.
Tensor and pipeline parallel follow vLLM's Llama/Qwen3 (heads and `sigma` split across TP ranks).
"""
import copy
import os
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.sequence import IntermediateTensors

from asynct.integrations.vllm.backend import AsyncTAttentionBackend
from asynct.model.checkpoint import checked_shapes
from asynct.ops import dyht, reglu

# checkpoint name -> (vLLM fused parameter, shard id), as in vLLM's Llama.
STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)

# vLLM's load formats that read the directory's safetensors files, the ones the tensor check
# reads too ("auto" resolves to "hf"; the others are faster readers of the same files).
SAFETENSORS_LOAD_FORMATS = ("auto", "hf", "safetensors", "fastsafetensors", "instanttensor",
                            "runai_streamer")


def _broadcast_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """DyHT alpha/weight: the checkpoint may hold [1] (shared) or [C] (per channel)."""
    if loaded.numel() not in (1, param.numel()):
        raise ValueError(f"DyHT parameter of {param.numel()} channels got shape "
                         f"{tuple(loaded.shape)}; docs/model.md allows [1] or [{param.numel()}]")
    param.data.copy_(loaded.reshape(-1).expand(param.numel()).view(param.shape))


def _head_shard_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """sigma [Hq]: each TP rank keeps its own query heads."""
    n, rank = param.shape[0], get_tensor_model_parallel_rank()
    param.data.copy_(loaded[rank * n:(rank + 1) * n])


class DyHT(nn.Module):
    """weight * clamp(alpha * x, -1, 1); both stored per channel."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(dim))
        self.weight = nn.Parameter(torch.ones(dim))
        for p in (self.alpha, self.weight):
            set_weight_attrs(p, {"weight_loader": _broadcast_loader})

    def forward(self, x):
        return dyht(x, self.alpha, self.weight)


class AsyncTAttention(nn.Module):
    def __init__(self, config, cache_config, quant_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if hq % tp or (hkv % tp and tp % hkv):
            raise ValueError(f"{hq} query / {hkv} KV heads cannot be split over TP={tp}")
        self.num_heads, self.num_kv_heads, self.head_dim = hq // tp, max(1, hkv // tp), d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        c = config.hidden_size
        self.qkv_proj = QKVParallelLinear(c, d, hq, hkv, bias=False, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(hq * d, c, bias=False, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.q_norm, self.k_norm = DyHT(d), DyHT(d)
        self.sigma = nn.Parameter(torch.ones(self.num_heads))
        set_weight_attrs(self.sigma, {"weight_loader": _head_shard_loader})
        self.rotary_emb = get_rope(d, max_position=config.max_position_embeddings,
                                   is_neox_style=True,
                                   rope_parameters={"rope_type": "default",
                                                    "rope_theta": config.rope_theta})
        self.attn = Attention(self.num_heads, d, config.scale, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config,
                              prefix=f"{prefix}.attn", attn_backend=AsyncTAttentionBackend,
                              sigma=self.sigma, pool_size=config.asynci_pool_size,
                              relu_pre=config.asynci_relu_pre)

    def forward(self, positions, x):
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # qk-norm acts on each head's vector, then RoPE (docs/model.md: rope after the norm).
        q = self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class AsyncTMLP(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        c, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(c, [i, i], bias=False,
                                                       quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(i, c, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(reglu(gate_up))
        return out


class AsyncTDecoderLayer(nn.Module):
    def __init__(self, config, cache_config, quant_config, prefix: str):
        super().__init__()
        c = config.hidden_size
        self.self_attn = AsyncTAttention(config, cache_config, quant_config, f"{prefix}.self_attn")
        self.mlp = AsyncTMLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = DyHT(c)
        self.post_attention_layernorm = DyHT(c)  # on the attention output (Peri-LN style)
        self.pre_feedforward_layernorm = DyHT(c)

    def forward(self, positions, x):
        attn = self.self_attn(positions, self.input_layernorm(x))
        h = x + self.post_attention_layernorm(attn)
        return h + self.mlp(self.pre_feedforward_layernorm(h))


class AsyncTModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.config = config
        pp = get_pp_group()
        if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                       quant_config=quant_config,
                                                       prefix=f"{prefix}.embed_tokens")
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: AsyncTDecoderLayer(config, cache_config, quant_config, prefix),
            prefix=f"{prefix}.layers")
        self.norm = DyHT(config.hidden_size) if pp.is_last_rank else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states"], config.hidden_size)

    def embed_input_ids(self, input_ids):
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        else:
            x = intermediate_tensors["hidden_states"]
        for layer in self.layers[self.start_layer:self.end_layer]:
            x = layer(positions, x)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": x})
        return self.norm(x)


class AsyncTForCausalLM(nn.Module, SupportsPP):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        _check_max_model_len(vllm_config.model_config)
        # The checkpoint directory vLLM's loader reads, checked at the first load_weights: vLLM
        # checks no linear layer's weights, so a missing q/k/v, gate/up, o_proj or lm_head
        # tensor would leave uninitialised memory. Later calls (weight transfer) pass subsets.
        path, fmt = vllm_config.model_config.model, vllm_config.load_config.load_format
        self._unchecked = path if fmt in SAFETENSORS_LOAD_FORMATS and os.path.isdir(path) else None
        self._written_config = _as_written(vllm_config.model_config)
        self.model = AsyncTModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids):
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self._unchecked is not None:  # as asynct loads: one error listing every problem
            path, self._unchecked = self._unchecked, None
            checked_shapes(path, self._written_config)
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # the head is the embedding
            pname, shard = _vllm_name(name)
            if is_pp_missing_parameter(pname, self):
                continue
            if pname not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the AsyncT model "
                                 f"(is it an asynct checkpoint, docs/model.md?)")
            param = params[pname]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            loaded.add(pname)
        return loaded


def _check_max_model_len(model_config):
    """vLLM derives max_model_len from max_position_embeddings times a config's rope_scaling
    factor (or takes a longer one under VLLM_ALLOW_LONG_MAX_MODEL_LEN), but AsyncT's RoPE is
    unscaled and its table ends at max_position_embeddings: later positions read past it."""
    most, asked = model_config.hf_config.max_position_embeddings, model_config.max_model_len
    if asked > most:
        raise ValueError(f"max_model_len={asked} exceeds max_position_embeddings={most}, the "
                         f"longest position of an AsyncT model (docs/model.md: RoPE is unscaled; "
                         f"a config's rope_scaling is not part of the format); pass "
                         f"max_model_len<={most}")


def _as_written(model_config):
    """The config as config.json has it. vLLM unties a tied config whose checkpoint holds an
    lm_head before the model is built (`maybe_untie_word_embeddings`) and runs that head; asynct
    refuses such a checkpoint (docs/model.md: no lm_head when tied), and so must the check."""
    config = model_config.hf_config
    if not getattr(model_config, "word_embeddings_untied_by_checkpoint", False):
        return config
    written = copy.copy(config)
    written.tie_word_embeddings = True
    return written


def _vllm_name(name: str):
    """Checkpoint tensor name -> (vLLM parameter name, shard id or None)."""
    for old, new, shard in STACKED:
        if old in name:
            return name.replace(old, new), shard
    return name, None
