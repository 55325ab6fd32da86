"""The reference AsyncT model: docs/model.md in plain, eager PyTorch, as a transformers model.

It is the accuracy baseline and the "HF eager" speed baseline, so it is vectorised the way
transformers' own eager attention is (batched matmuls over heads and positions) and nothing more.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from asynct.config import AsyncTConfig
from asynct.ops.asynci import asynci_attention

# transformers renamed `past_key_values` to `cache` in 5.2x; accept and return either spelling.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class DyHT(nn.Module):
    """weight * clamp(alpha * x, -1, 1), element-wise, fp32 inside."""

    def __init__(self, dim: int, alpha_size: int = 1, weight_size: int | None = None, alpha_init=1.0):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((alpha_size,), float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(weight_size or dim))

    def forward(self, x):
        y = (self.alpha.float() * x.float()).clamp(-1.0, 1.0) * self.weight.float()
        return y.to(x.dtype)


def make_dyht(config: AsyncTConfig, name: str, dim: int, alpha_init: float) -> DyHT:
    """A DyHT whose parameter shapes follow the checkpoint (`alpha` [1] or [C], `weight` [C] or [1])."""
    shapes = getattr(config, "dyht_shapes", None) or {}
    default_alpha = dim if getattr(config, "dyht_alpha_per_channel", False) else 1
    return DyHT(dim, shapes.get(f"{name}.alpha", default_alpha), shapes.get(f"{name}.weight", dim), alpha_init)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: AsyncTConfig):
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, x, position_ids):
        """x [B, H, T, D], position_ids [B, T] -> x rotated (NeoX rotate_half), fp32 inside."""
        freqs = position_ids[:, None, :, None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        xf = x.float()
        return (xf * emb.cos() + rotate_half(xf) * emb.sin()).to(x.dtype)


class AsyncTAttention(nn.Module):
    def __init__(self, config: AsyncTConfig, layer_idx: int, prefix: str):
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        c, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads,
                                                            config.num_key_value_heads, d)
        self.q_proj = nn.Linear(c, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(c, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(c, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, c, bias=False)
        self.q_norm = make_dyht(config, f"{prefix}.q_norm", d, 1.0)
        self.k_norm = make_dyht(config, f"{prefix}.k_norm", d, 1.0)
        self.sigma = nn.Parameter(torch.ones(self.num_heads))

    def forward(self, x, rotary, position_ids, key_mask, cache):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, -1)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, -1)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, -1).transpose(1, 2)
        q, k = rotary(q, position_ids), rotary(k, position_ids)
        past = 0
        if cache is not None:
            past = cache.get_seq_length(self.layer_idx)
            k, v = cache.update(k, v, self.layer_idx)
            if key_mask is not None:   # a static cache returns all its slots, the unwritten ones too
                key_mask = F.pad(key_mask, (0, k.shape[2] - key_mask.shape[1]))
        cfg = self.config
        o = asynci_attention(q, k, v, self.sigma, cfg.scale, cfg.asynci_pool_size,
                             cfg.asynci_relu_pre, key_mask=key_mask, q_offset=past)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class AsyncTDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: AsyncTConfig, layer_idx: int):
        super().__init__()
        p, c = f"model.layers.{layer_idx}", config.hidden_size
        self.self_attn = AsyncTAttention(config, layer_idx, f"{p}.self_attn")
        self.mlp = AsyncTMLP(config)
        self.input_layernorm = make_dyht(config, f"{p}.input_layernorm", c, 1.0)
        self.post_attention_layernorm = make_dyht(config, f"{p}.post_attention_layernorm", c, 1.0)
        self.pre_feedforward_layernorm = make_dyht(config, f"{p}.pre_feedforward_layernorm", c, 1.0)

    def forward(self, x, rotary, position_ids, key_mask, cache):
        attn = self.self_attn(self.input_layernorm(x), rotary, position_ids, key_mask, cache)
        h = x + self.post_attention_layernorm(attn)
        return h + self.mlp(self.pre_feedforward_layernorm(h))


class AsyncTMLP(nn.Module):
    def __init__(self, config: AsyncTConfig):
        super().__init__()
        c, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(c, i, bias=False)
        self.up_proj = nn.Linear(c, i, bias=False)
        self.down_proj = nn.Linear(i, c, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


class AsyncTPreTrainedModel(PreTrainedModel):
    config_class = AsyncTConfig
    config: AsyncTConfig
    base_model_prefix = "model"
    _no_split_modules = ["AsyncTDecoderLayer"]
    supports_gradient_checkpointing = True
    _supports_cache_class = True

    def _init_weights(self, module):
        """Random weights that give a non-degenerate model at any width: every projection keeps
        unit-scale activations (std 1/sqrt(fan_in)), so after DyHT and the 1/sqrt(hidden) scale
        the AsyncI scores are ~0.1-0.2 and the gate is neither all 0 nor all 1."""
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=module.in_features ** -0.5)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=1.0)
        elif isinstance(module, DyHT):
            module.weight.data.fill_(1.0)
            module.alpha.data.fill_(1.0)
        elif isinstance(module, AsyncTAttention):
            n = module.num_heads
            module.sigma.data.copy_(torch.linspace(0.5, 1.5, n) if n > 1 else torch.ones(1))
        elif isinstance(module, RotaryEmbedding):
            d = self.config.head_dim
            inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            module.inv_freq.copy_(inv.float())


class AsyncTModel(AsyncTPreTrainedModel):
    def __init__(self, config: AsyncTConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(AsyncTDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_dyht(config, "model.norm", config.hidden_size, 1.0)
        self.rotary_emb = RotaryEmbedding(config)
        self.post_init()

    @can_return_tuple  # return_dict=False: a tuple, as transformers' models return
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, past_key_values=None, output_hidden_states=None,
                output_attentions=None, **kwargs):
        if output_attentions or (output_attentions is None and self.config.output_attentions):
            raise ValueError("output_attentions: the AsyncT reference model does not return AsyncI's weights")
        cache = cache if cache is not None else past_key_values
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t = x.shape[:2]
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = _positions(attention_mask, b, past, t, x.device)
        key_mask = attention_mask.bool() if attention_mask is not None else None
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        hidden = []      # only when asked: under no_grad each layer's output is freed by the next
        for layer in self.layers:
            if output_hidden_states:
                hidden.append(x)
            # the cache by keyword: a checkpointed layer drops it, else its recompute appends again
            x = layer(x, self.rotary_emb, position_ids, key_mask, cache=cache)
        x = self.norm(x)
        # as transformers' models: the last hidden state is the one after the final norm
        hidden_states = (*hidden, x) if output_hidden_states else None
        return BaseModelOutputWithPast(last_hidden_state=x, hidden_states=hidden_states, **{_CACHE_FIELD: cache})


def _positions(attention_mask, b, past, t, device):
    """Positions count real tokens only, so left-padded rows start at 0 (as generate() expects)."""
    if attention_mask is None:
        return torch.arange(past, past + t, device=device).expand(b, t)
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)[:, -t:]


class AsyncTForCausalLM(AsyncTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AsyncTConfig):
        super().__init__(config)
        self.model = AsyncTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                past_key_values=None, output_hidden_states=None, output_attentions=None, **kwargs):
        # return_dict: the config's False is for this forward's caller, not for reading `out`
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache if cache is not None else past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, return_dict=True,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions)
        # an int keeps the last positions (0: all), a tensor names them, as in Llama
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(out.last_hidden_state[:, keep])
        loss = None
        if labels is not None:
            # transformers' causal LM loss: Trainer passes num_items_in_batch (the sum is divided by
            # it) and then leaves the loss unscaled for gradient accumulation
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)})

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """generate() would turn the padding mask into a 4D one for a static cache; positions and
        AsyncI's key mask are read from the 2D one."""
        return attention_mask

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Checks the checkpoint against docs/model.md's format first, so that a bad one fails with one error
        naming every problem, and sizes DyHT parameters from the tensors ([1] or [C])."""
        from asynct.model.checkpoint import prepare_config_for_load
        kwargs["config"] = prepare_config_for_load(pretrained_model_name_or_path, kwargs.get("config"))
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


def register_with_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM
    AutoConfig.register("asynct", AsyncTConfig, exist_ok=True)
    AutoModelForCausalLM.register(AsyncTConfig, AsyncTForCausalLM, exist_ok=True)


register_with_transformers()
