"""Piecewise CUDA graphs for steps with prefill tokens (mixed and prefill steps).

Attention cannot be captured for these steps: its grids follow the batch's chunk lengths. Every
other kernel can, for a fixed token count. So, per bucket of a token ladder, the forward is
captured as one graph per gap between attentions (embedding + layer 0 up to its attention; the
end of layer i - 1 + the start of layer i; the end of the last layer), and a step replays the
smallest bucket that holds it, running each layer's attention eagerly between two replays:
35 layers of ~12 launches become 36 replays and 35 attention calls.

Graphs communicate through static buffers (the tokens' ids, positions and cache slots, q, the
attention output, the residual stream, the final hidden state), which the ops write in place:
the QKV projection into `qkv`, q normed and rotated into its buffer, k and v into the KV cache at
the static slots (the q/k kernel stores them: no KV-write launch between the pieces), each
layer's last op into the residual stream. Copies into them (four a layer, 7 % of a prefill
workload's GPU time on the H200: benchmarks/RESULTS.md) remain only where an op writes
elsewhere (the embedding). Everything else a piece allocates comes from one memory pool that
all pieces share, captured and replayed in the same order. Padding rows (bucket past the step's
tokens) compute garbage that nothing reads: their slots are -1 (no store), and attention sees
only real tokens."""
import functools

import torch

from asynct.engine.cuda_graph import capture_graph


def token_ladder(max_num_tokens: int) -> list[int]:
    """Buckets: powers of two up to 512 (padding stays small for short steps), then every 512."""
    sizes = [t for t in (16, 32, 64, 128, 256) if t < max_num_tokens]
    sizes += list(range(512, max_num_tokens, 512))
    return sizes + [max_num_tokens]


def _place(buf, x):
    """x into the static buffer, unless the op already wrote it there."""
    if x.data_ptr() != buf.data_ptr() or x.stride() != buf.stride():
        buf.copy_(x)


class PiecewiseGraphRunner:
    def __init__(self, runner, max_num_tokens: int):
        self.model = runner.model
        c, dev, dt = runner.config, runner.device, runner.dtype
        self.sizes = token_ladder(max_num_tokens)
        t = self.sizes[-1]
        self.input_ids = torch.zeros(t, dtype=torch.long, device=dev)
        self.positions = torch.zeros(t, dtype=torch.long, device=dev)
        nq, nkv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.slot_mapping = torch.full((t,), -1, dtype=torch.long, device=dev)
        self.qkv = torch.zeros(t, nq + 2 * nkv, dtype=dt, device=dev)
        self.q = torch.zeros(t, c.num_attention_heads, c.head_dim, dtype=dt, device=dev)
        self.attn_out = torch.zeros_like(self.q)
        self.residual = torch.zeros(t, c.hidden_size, dtype=dt, device=dev)
        self.hidden = torch.zeros_like(self.residual)
        self.graphs: dict[int, list] = {}     # bucket -> its pieces' replay functions
        self.capture()

    def _piece(self, i: int, t: int):
        """Piece i of a t-token forward: the rest of layer i - 1, then layer i up to attention."""
        m = self.model
        if i == 0:
            residual, n = m.embed(self.input_ids[:t])
        else:
            residual, n = m.layers[i - 1].after_attention(self.attn_out[:t], self.residual[:t],
                                                          m.next_norms[i - 1], out=self.residual[:t])
        if i == len(m.layers):
            self.hidden[:t].copy_(n)
            return
        q, k, _ = m.layers[i].attention_inputs(self.positions[:t], n, m.cos_sin_cache, slot_mapping=self.slot_mapping[:t],
                                               out=(self.qkv[:t], self.q[:t], None))
        if k is not None:
            raise RuntimeError(f"layer {i}'s keys did not go to the cache {tuple(m.layers[i].attn.kv_cache.shape)}")
        for buf, x in ((self.q, q), (self.residual, residual)):
            _place(buf[:t], x)

    @torch.inference_mode()
    def capture(self):
        """Off CUDA the pieces run eagerly through the same buffers (tests check the plumbing)."""
        pieces = range(len(self.model.layers) + 1)
        if not self.q.is_cuda:
            self.graphs = {t: [functools.partial(self._piece, i, t) for i in pieces] for t in self.sizes}
            return
        self.pool, self.stream = None, torch.cuda.Stream()
        for t in reversed(self.sizes):      # the largest first: later ones fit in its pool
            for i in pieces:                # warm-up outside the capture (cuBLAS, allocator)
                self._piece(i, t)
            self.graphs[t] = [capture_graph(self, functools.partial(self._piece, i, t)).replay
                              for i in pieces]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()            # the warm-ups' blocks; the graphs keep their pool

    def can_run(self, metadata) -> bool:
        return metadata.num_prefills > 0 and metadata.num_actual_tokens <= self.sizes[-1]

    def run(self, input_ids, positions, metadata):
        n = metadata.num_actual_tokens
        t = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping[:n], non_blocking=True)
        self.slot_mapping[n:t].fill_(-1)    # a larger step's slots before: padding stores nothing
        pieces = self.graphs[t]
        q, out = self.q[:n], self.attn_out[:n]
        for piece, layer in zip(pieces, self.model.layers):
            piece()
            layer.attn.impl.forward(q, None, None, layer.attn.kv_cache, metadata, out)
        pieces[-1]()
        return self.hidden[:n]
