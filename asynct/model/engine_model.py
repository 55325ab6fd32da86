"""The engine's AsyncT: the same function as the reference model, built from the fused ops, over a
flat token batch. Per-step attention metadata comes from the context, so forward is
(input_ids, positions) only."""
import contextlib

import torch
from torch import nn

from asynct import ops
from asynct.config import AsyncTConfig
from asynct.engine.context import get_context


class DyHTParams(nn.Module):
    """Holds a DyHT's parameters; the fused ops apply them."""

    def __init__(self, alpha_size: int, weight_size: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(alpha_size), requires_grad=False)
        self.weight = nn.Parameter(torch.ones(weight_size), requires_grad=False)


def make_norm(config: AsyncTConfig, name: str, dim: int) -> DyHTParams:
    shapes = getattr(config, "dyht_shapes", None) or {}
    return DyHTParams(shapes.get(f"{name}.alpha", 1), shapes.get(f"{name}.weight", dim))


class Attention(nn.Module):
    """AsyncI through the engine's attention backend; the cache is bound by the model runner."""

    def __init__(self, config: AsyncTConfig, impl_cls):
        super().__init__()
        hq = config.num_attention_heads
        self.sigma = nn.Parameter(torch.ones(hq), requires_grad=False)
        self.impl = impl_cls(hq, config.head_dim, config.num_key_value_heads, config.scale, self.sigma,
                             config.asynci_pool_size, config.asynci_relu_pre)
        self.kv_cache = torch.empty(0)

    def cache_target(self, slot_mapping=None) -> dict:
        """Where this step's keys and values go: the layer's cache, the tokens' slots (the
        step's metadata's, unless given), its FP8 scales (the QKV projection's kernels store
        them there themselves)."""
        if slot_mapping is None:
            slot_mapping = get_context().attn_metadata.slot_mapping
        return dict(kv_cache=self.kv_cache, slot_mapping=slot_mapping, **self.impl.kv_scales)

    def attn_sums(self, rows: int) -> torch.Tensor | None:
        """Where the backend's attention of this step adds up (`accumulates`): fp32 [rows, Hq, D]
        for the QKV projection to zero; None where it writes a fresh output."""
        if not self.impl.accumulates(get_context().attn_metadata):
            return None
        return torch.empty(rows, self.impl.num_heads, self.impl.head_dim, device=self.sigma.device)

    def forward(self, q, k, v, sums=None):
        """k and v None: already in the cache. `sums`: attn_sums, zeroed."""
        out = torch.empty_like(q) if sums is None else sums
        self.impl.forward(q, k, v, self.kv_cache, get_context().attn_metadata, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: AsyncTConfig, i: int, impl_cls):
        super().__init__()
        p, c, d = f"model.layers.{i}", config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads,
                                                            config.num_key_value_heads, d)
        self.qkv_proj = nn.Linear(c, (self.num_heads + 2 * self.num_kv_heads) * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, c, bias=False)
        self.gate_up_proj = nn.Linear(c, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, c, bias=False)
        self.q_norm = make_norm(config, f"{p}.self_attn.q_norm", d)
        self.k_norm = make_norm(config, f"{p}.self_attn.k_norm", d)
        self.post_attention_layernorm = make_norm(config, f"{p}.post_attention_layernorm", c)
        self.pre_feedforward_layernorm = make_norm(config, f"{p}.pre_feedforward_layernorm", c)
        self.attn = Attention(config, impl_cls)

    def forward(self, positions, n, residual, next_norm, cos_sin):
        """n = this layer's input norm of `residual`; returns (next residual, its next norm)."""
        sums = self.attn.attn_sums(n.shape[0])
        q, k, v = self.attention_inputs(positions, n, cos_sin, attn_sums=sums)
        return self.after_attention(self.attn(q, k, v, sums), residual, next_norm)

    def attention_inputs(self, positions, n, cos_sin, attn_sums=None, out=None, slot_mapping=None):
        """q, k, v of the tokens, normed and rotated: everything of the layer before attention.
        k and v come back None where they went to the cache (the layer's, when bound), at
        `slot_mapping` where given (a piecewise graph's static slots), else the step's. A
        captured piece hands its static buffers as `out` (ops.linear_qk_norm_rope's).
        `attn_sums` comes back zeroed (Attention.attn_sums)."""
        qn, kn = self.q_norm, self.k_norm
        target = self.attn.cache_target(slot_mapping)
        return ops.linear_qk_norm_rope(n, self.qkv_proj.weight, positions, self.num_heads,
                                       self.num_kv_heads, qn.alpha, qn.weight, kn.alpha, kn.weight, cos_sin,
                                       attn_sums=attn_sums, out=out, **target)

    def after_attention(self, attn_out, residual, next_norm, out=None):
        """Everything of the layer after attention, through the next layer's input norm; the
        next residual goes into `out` where given (it may be `residual` itself)."""
        post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
        h, m = ops.linear_dyht_add(attn_out.view(attn_out.shape[0], -1), self.o_proj.weight, residual,
                                   pre.alpha, pre.weight, post.alpha, post.weight)
        mlp = ops.linear_reglu(m, self.gate_up_proj.weight)
        return ops.linear_dyht_add(mlp, self.down_proj.weight, h, next_norm.alpha, next_norm.weight, out=out)


class AsyncTEngineModel(nn.Module):
    def __init__(self, config: AsyncTConfig, impl_cls):
        super().__init__()
        self.config = config
        c = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, c)
        self.layers = nn.ModuleList(DecoderLayer(config, i, impl_cls) for i in range(config.num_hidden_layers))
        self.input_norms = nn.ModuleList(make_norm(config, f"model.layers.{i}.input_layernorm", c)
                                         for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, "model.norm", c)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(c, config.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", self.rope_cache(None), persistent=False)

    def rope_cache(self, device):
        c = self.config
        return ops.rope_cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_theta, device)

    @property
    def next_norms(self) -> list:
        """The norm that follows each layer: the next layer's input norm, then the final one."""
        return list(self.input_norms[1:]) + [self.norm]

    def layer_signature(self, i: int) -> tuple:
        """What layer i's kernels specialise on: the shapes, strides and dtypes of its tensors
        and of the norm after it (a checkpoint may give norms of different layers different
        alpha shapes)."""
        layer = self.layers[i]
        tensors = [*layer.parameters(), *layer.buffers(), *self.next_norms[i].parameters()]
        return tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)

    def distinct_layers(self) -> list[int]:
        """The first layer of each signature: together they launch every kernel the model does."""
        first = {}
        for i in range(len(self.layers)):
            first.setdefault(self.layer_signature(i), i)
        return sorted(first.values())

    @contextlib.contextmanager
    def only_layers(self, keep: list[int]):
        """Inside, forward runs layers `keep` alone, each followed by its own next norm: the
        compile pass, whose launches only compile, needs one layer of each signature, and its
        launches from Python are what it waits on (the compiler threads share the GIL)."""
        saved, after = (self.layers, self.input_norms, self.norm), self.next_norms
        self.layers = nn.ModuleList(saved[0][i] for i in keep)
        self.input_norms = nn.ModuleList([saved[1][0], *(after[i] for i in keep[:-1])])
        self.norm = after[keep[-1]]
        try:
            yield
        finally:
            self.layers, self.input_norms, self.norm = saved

    def embed(self, input_ids):
        """(residual stream, its first layer's input norm) of the tokens."""
        x = self.embed_tokens(input_ids)
        return x, ops.dyht(x, self.input_norms[0].alpha, self.input_norms[0].weight)

    def forward(self, input_ids, positions):
        """Returns the final-normed hidden state of every token."""
        residual, n = self.embed(input_ids)
        for layer, next_norm in zip(self.layers, self.next_norms):
            residual, n = layer(positions, n, residual, next_norm, self.cos_sin_cache)
        return n

    def compute_logits(self, hidden, out=None):
        """Logits [T, V] of final-normed hidden states, into `out` where given (a decode graph's
        static buffer)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if out is None:
            return torch.nn.functional.linear(hidden, weight)
        return torch.mm(hidden, weight.t(), out=out)
