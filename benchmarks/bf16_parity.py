"""bf16 parity: the engine's teacher-forced logprobs in bf16, Triton backend vs torch backend,
both against a float64 evaluation of the spec (tests/spec_oracle.py), over several model shapes.

    PYTHONPATH=. python benchmarks/bf16_parity.py            # CUDA, ~3 min on an H200
    PYTHONPATH=. python benchmarks/bf16_parity.py --smoke    # CPU, fp32, plumbing only
    PYTHONPATH=. python benchmarks/bf16_parity.py --cpu --shapes h80-g3-d16-relu-off --seeds 1
        # CPU, bf16, the Triton kernels interpreted (5-8 min a shape and seed): the Triton
        # engine's worst errors on h80 were the H100/H200's to four digits (seeds 0 and 1), so
        # attribution needs no GPU; the torch backend's bf16 matmuls may round otherwise on the
        # CPU (gqa2 seed 0: 0.079 against the GPU's 0.070)

Error of one logprob: |got - want| / (1 + |want|). Per shape and seed, every engine variant
runs the same requests:
  wave 1: prompts of 1-700 tokens with prompt_logprobs, chunked prefill, 8 generated tokens;
  wave 2: one 320-token prefix, then 20 prompts extending it (prefix-cache hits: prefill with
          cached keys left of the chunk) decoding 16 tokens together (>= 16 decodes sharing
          >= 128 keys: the cascade decode path).
Variants: the two backends, the Triton backend eager (no CUDA graphs), and the Triton backend
with ONE op swapped for its torch reference (elementwise ops), for the torch backend's own
numerics (attention: scores rounded to bf16 by the bf16 matmul), or for an fp32 evaluation.
The variant whose swap brings the Triton error down to the torch backend's names the op. A
noise control runs the torch backend again with its attention computed in fp32 from the same
bf16 q, k, v and rounded once at the end: more precise than the torch backend and otherwise the
same engine, as the Triton backend is (its kernels keep the scores and the sums in fp32); its
worst error over the torch backend's shows how far a ratio moves when only the attention's
rounding changes, for the better. (Prefill chunks of 96 tokens instead of 256, the control
before, changed no worst error at all: the torch backend rounds each row alike in any chunk.)

A kernel table follows: the attention calls of the Triton run, recorded and replayed on
identical bf16 inputs through the Triton kernels, the CUDA decode kernel (where it builds and
supports the shape) and the torch backend's computation, each against fp64, with the worst per
kernel over the shape's calls. It isolates the attention kernels from the rest of the model.
"""
import argparse
import contextlib
import gc
import importlib
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

if "--smoke" in sys.argv or "--cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import asynct.attention.base as attention_base  # noqa: E402
import asynct.attention.torch_backend as torch_backend  # noqa: E402
import asynct.attention.triton_backend as triton_backend  # noqa: E402
import asynct.model.engine_model as engine_model  # noqa: E402
import spec_oracle  # noqa: E402
from asynct import LLM, SamplingParams, ops  # noqa: E402
from asynct.config import AsyncTConfig  # noqa: E402
from asynct.model.checkpoint import dyht_modules, make_checkpoint  # noqa: E402
from asynct.ops.asynci import asynci_attention  # noqa: E402
from asynct.ops.cuda_ext import cuda_decode_supported  # noqa: E402

rope = importlib.import_module("asynct.ops.rope")   # the module: asynct.ops.rope is also a function
from asynct.ops.paged_ref import gather_kv  # noqa: E402

# Model shapes (overrides of the `tiny` preset). "issue13" is the one where Triton lost.
SHAPES = {
    "issue13-h96-d32": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            vocab_size=320, asynci_pool_size=3, asynci_relu_pre=True),
    "h80-g3-d16-relu-off": dict(hidden_size=80, intermediate_size=160, num_hidden_layers=2,
                                num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                vocab_size=300, asynci_pool_size=4, asynci_relu_pre=False),
    "gqa2-d64": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=512,
                     asynci_pool_size=3, asynci_relu_pre=True),
    "bench-like-d128": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                            vocab_size=1024, rope_theta=1e6, tie_word_embeddings=True,
                            asynci_pool_size=3, asynci_relu_pre=True),
}
SMOKE_SHAPE = {"smoke-h48-d16": dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     vocab_size=272, asynci_pool_size=3, asynci_relu_pre=True)}


# ---- checkpoints -------------------------------------------------------------------------
def build_checkpoint(out_dir, overrides, seed):
    """Random weights in bf16 (so the engine's bf16 load is exact), with random DyHT
    parameters (alpha per-channel on even-numbered DyHTs, scalar on odd ones; signed weights)
    and signed sigma. Returns the tensors as float64 for the oracle."""
    path = make_checkpoint("tiny", out_dir, seed=seed, dtype="bfloat16", tokenizer=False,
                           max_position_embeddings=2048, torch_dtype="bfloat16", **overrides)
    g = torch.Generator().manual_seed(1000 + seed)
    t = load_file(path / "model.safetensors")
    cfg = AsyncTConfig(**json.loads((path / "config.json").read_text()))
    for i, (prefix, ch) in enumerate(dyht_modules(cfg).items()):
        t[f"{prefix}.alpha"] = 0.5 + torch.rand(ch if i % 2 == 0 else 1, generator=g) * 2
        t[f"{prefix}.weight"] = torch.randn(ch, generator=g)
    for name in t:
        if name.endswith("sigma"):
            t[name] = torch.randn(t[name].shape, generator=g)
    t = {k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    return path, cfg, {k: v.double() for k, v in t.items()}


# ---- requests ----------------------------------------------------------------------------
def make_requests(vocab, seed, smoke):
    """[(prompt ids, SamplingParams)] for wave 1 and wave 2a/2b (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    lens = [1, 2, 3, 17, 64, 65, 130, 255, 256, 300, 511, 700]
    if smoke:
        lens = [1, 3, 17, 40]
    gen1 = SamplingParams(temperature=0, max_tokens=4 if smoke else 8, ignore_eos=True,
                          logprobs=0, prompt_logprobs=0)
    wave1 = [(rand(n), gen1) for n in lens]
    prefix = rand(40 if smoke else 320)
    gen2 = SamplingParams(temperature=0, max_tokens=4 if smoke else 16, ignore_eos=True, logprobs=0)
    n2 = 4 if smoke else 20
    tails = torch.randint(1, 61, (n2,), generator=g).tolist()
    wave2 = [(prefix + rand(k), gen2) for k in tails]
    return [wave1, [(prefix, gen2)], wave2]


def run_engine(path, dtype, waves, device, **kwargs):
    """[(full token ids, {position: engine logprob of full[position]})] over all waves."""
    llm = LLM(path, dtype=dtype, device=device, **(dict(max_num_batched_tokens=256, max_num_seqs=32,
                                                        num_kv_blocks=1024) | kwargs))
    got = []
    for wave in waves:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in wave], [s for _, s in wave],
                            use_tqdm=False)
        for (p, _), o in zip(wave, outs):
            c = o.outputs[0]
            full = p + list(c.token_ids)
            lp = {}
            for pos, e in enumerate(o.prompt_logprobs or []):
                if e is not None:
                    lp[pos] = e[full[pos]].logprob
            for i, e in enumerate(c.logprobs or []):
                lp[len(p) + i] = e[full[len(p) + i]].logprob
            got.append((full, lp))
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return got


# ---- the float64 oracle ------------------------------------------------------------------
def _asynci_fp64(q, k, v, sigma, scale, pool, relu_pre):
    """spec_oracle.asynci_loop, vectorised: the dense reference in float64 (test_reference
    checks the two agree to 1e-12)."""
    o = asynci_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                         v.transpose(0, 1)[None], sigma, scale, pool, relu_pre)
    return o[0].transpose(0, 1)


class Oracle:
    """The float64 spec on the CPU (spec_oracle builds its position tensors there)."""
    def __init__(self, cfg, tensors, device="cpu"):
        self.cfg, self.device = cfg, "cpu"
        self.t = {k: v.cpu() for k, v in tensors.items()}
        self.cache = {}

    def logprobs(self, full):
        key = tuple(full)
        if key not in self.cache:
            saved, spec_oracle.asynci_loop = spec_oracle.asynci_loop, _asynci_fp64
            try:
                ids = torch.tensor(full, device=self.device)
                logits = spec_oracle.forward(self.cfg, self.t, ids)
            finally:
                spec_oracle.asynci_loop = saved
            self.cache[key] = logits.log_softmax(-1).cpu()
        return self.cache[key]


def errors(got, oracle):
    """Scaled errors of every recorded logprob, as a 1-D float64 tensor."""
    errs = []
    for full, lp in got:
        want = oracle.logprobs(full)
        for pos, v in lp.items():
            w = want[pos - 1, full[pos]].item()
            errs.append(abs(v - w) / (1 + abs(w)))
    return torch.tensor(errs, dtype=torch.float64)


# ---- attention stand-ins: the torch backend's numerics on the paged cache ----------------
def prefill_torchlike(q, kv_cache, block_table, qsl, seq_lens, sigma, scale, pool, relu, out, **_):
    """What TorchAttentionImpl computes (bf16 matmuls, fp32 gate), one sequence at a time."""
    for b in range(seq_lens.shape[0]):
        lo, hi, n = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        if hi > lo:
            out[lo:hi] = _torchlike(q[lo:hi], kv_cache, block_table[b], n, sigma, scale, pool, relu)
    return out


def decode_torchlike(q, kv_cache, block_table, seq_lens, sigma, scale, pool, relu, out, **_):
    for b in range(q.shape[0]):
        out[b] = _torchlike(q[b:b + 1], kv_cache, block_table[b], int(seq_lens[b]), sigma, scale,
                            pool, relu)[0]
    return out


def _torchlike(q, kv_cache, row, n, sigma, scale, pool, relu, dtype=None):
    """q [Tq, Hq, D], the last Tq of n keys -> [Tq, Hq, D]; in `dtype` if given (fp64: the
    kernel table's reference), else in the cache's dtype as the torch backend does."""
    k, v = gather_kv(kv_cache, row, n)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    o = asynci_attention(q.transpose(0, 1)[None], k[None], v[None], sigma, scale, pool, relu,
                         q_offset=n - q.shape[0])
    return o[0].transpose(0, 1)


def prefill_fp32(q, kv_cache, block_table, qsl, seq_lens, sigma, scale, pool, relu, out, *a, **k):
    return ops.asynci_prefill_ref(q, kv_cache, block_table, qsl, seq_lens, sigma, scale, pool,
                                  relu, out)


def decode_fp32(q, kv_cache, block_table, seq_lens, sigma, scale, pool, relu, out, **_):
    return ops.asynci_decode_ref(q, kv_cache, block_table, seq_lens, sigma, scale, pool, relu, out)


def attention_fp32_scores(q, k, v, sigma, scale, *args, **kwargs):
    """The torch backend with the Triton kernels' score precision: q.k in fp32 from the bf16
    inputs (exact products, fp32 sums), the PV product in bf16 as before. The weights a come
    out of the reference itself, applied to an identity in place of V."""
    b, hkv, tk, _ = k.shape
    eye = torch.eye(tk, dtype=torch.float32, device=k.device).expand(b, hkv, tk, tk)
    a = asynci_attention(q.float(), k.float(), eye, sigma, scale, *args, **kwargs)
    return torch.matmul(a.to(v.dtype), v.repeat_interleave(q.shape[1] // hkv, dim=1))


def attention_fp32(q, k, v, sigma, scale, *args, **kwargs):
    """The torch backend's attention in fp32 from its bf16 inputs, rounded once at the end."""
    return asynci_attention(q.float(), k.float(), v.float(), sigma, scale, *args, **kwargs).to(v.dtype)


# ---- variants ----------------------------------------------------------------------------
NOISE = "torch attention=fp32"
ENGINE_OPS = "asynct.ops"   # engine_model calls ops.<name>: patch the package attribute
ELEMENTWISE = {"dyht": "dyht_ref", "dyht_add": "dyht_add_ref", "qk_norm_rope": "qk_norm_rope_ref",
               "reglu": "reglu_ref"}


@contextlib.contextmanager
def patched(pairs):
    """[(module, attribute name, replacement)]: set for the duration, then restored."""
    saved = [(m, n, getattr(m, n)) for m, n, _ in pairs]
    try:
        for m, n, f in pairs:
            setattr(m, n, f)
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


def interpreted_kernels():
    """Off CUDA the ops dispatch to their references: a CPU run sends the Triton backend's ops
    to the Triton kernels (under TRITON_INTERPRET) instead, so that they are exercised."""
    return [(ops, "dyht", ops.dyht_triton), (ops, "dyht_add", ops.dyht_add_triton),
            (ops, "qk_norm_rope", ops.qk_norm_rope_triton), (ops, "reglu", ops.reglu_triton),
            (attention_base, "write_kv_cache", ops.write_kv_cache_triton),
            (rope, "write_kv_cache", ops.write_kv_cache_triton),    # the q/k kernel's store off CUDA
            (triton_backend, "prefill_launch", as_launch(_prefill_triton)),
            (triton_backend, "decode_launch", as_launch(ops.asynci_decode_triton))]


def as_launch(fn):
    """A stand-in with asynci_decode's (asynci_prefill's) signature as the Triton backend's launch
    factory (decode_launch, prefill_launch): called a layer, with the step's rows and the layer's
    sigma (5th argument from the end) and output (last)."""
    def factory(q, kv_cache, *args, **kw):
        def launch(q, kv_cache, sigma, out, k_scale=None, v_scale=None):
            a = list(args)
            a[-5], a[-1] = sigma, out
            return fn(q, kv_cache, *a, **kw, k_scale=k_scale, v_scale=v_scale)
        return launch
    factory.fn = fn
    return factory


def _prefill_triton(*args, **kwargs):   # asynci_prefill's signature, always the kernel
    return ops.asynci_prefill_triton(*args, **kwargs)


def variants(attribution, interpret=False):
    """name -> (engine kwargs, patches); `interpret`: on the CPU, through interpreted kernels."""
    if interpret:
        base = interpreted_kernels()
        return {k: (kw, (base if kw["attention_backend"] == "triton" else []) + p)
                for k, (kw, p) in variants(attribution).items()}
    tri = dict(attention_backend="triton")
    eager = dict(attention_backend="triton", enforce_eager=True)
    # the noise control: the torch backend with more precise attention, nothing else changed
    out = {"triton": (tri, []), "torch": (dict(attention_backend="torch"), []),
           NOISE: (dict(attention_backend="torch"), [(torch_backend, "asynci_attention", attention_fp32)])}
    if not attribution:
        return out
    out["triton eager"] = (eager, [])
    for name, ref in ELEMENTWISE.items():
        out[f"triton {name}=ref"] = (tri, [(ops, name, getattr(ops, ref))])
    kv_ref = ops.write_kv_cache_ref
    # the reference write indexes with a mask (a host sync): no CUDA graphs; and the QKV kernel
    # leaves every step's write to the backend
    out["triton write_kv=ref"] = (eager, [(attention_base, "write_kv_cache", kv_ref),
                                          (engine_model.Attention, "cache_target", lambda self, slot_mapping=None: {})])
    out["triton prefill=torch-like"] = (tri, [(triton_backend, "prefill_launch", as_launch(prefill_torchlike))])
    # the stand-ins read lengths on the host: no CUDA graphs for decode swaps
    out["triton decode=torch-like"] = (eager, [(triton_backend, "decode_launch", as_launch(decode_torchlike))])
    out["triton attention=fp32"] = (eager, [(triton_backend, "prefill_launch", as_launch(prefill_fp32)),
                                            (triton_backend, "decode_launch", as_launch(decode_fp32))])
    out["torch scores=fp32"] = (dict(attention_backend="torch"),
                                [(torch_backend, "asynci_attention", attention_fp32_scores)])
    return out


# ---- the kernel table: recorded attention calls, replayed --------------------------------
class Recorder:
    """Wraps the Triton backend's attention ops and keeps copies of the inputs of every
    `stride`-th call that sees at least `min_keys` keys (warm-up and capture calls are empty or
    cannot be copied; decode steps replayed from CUDA graphs never reach Python)."""

    def __init__(self, min_keys, limit=8, stride=3):
        self.calls, self.min_keys, self.limit, self.stride = [], min_keys, limit, stride
        self.seen = {}

    def wrap(self, kind, fn):
        def call(*args, **kwargs):
            seq = args[4] if kind == "prefill" else args[3]
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if not capturing and int(seq.max()) >= self.min_keys:
                self.seen[kind] = self.seen.get(kind, -1) + 1
                taken = sum(c[0] == kind for c in self.calls)
                if self.seen[kind] % self.stride == 0 and taken < self.limit:
                    self.calls.append((kind, [a.clone() if torch.is_tensor(a) else a
                                              for a in args], dict(kwargs)))
            return fn(*args, **kwargs)
        return call


def cuda_decode():
    """The CUDA decode kernel where it can be built, else None (the dispatch picks Triton, so
    the engine runs never reach it: the table is where its error shows)."""
    if not torch.cuda.is_available():
        return None
    from asynct.ops import cuda_ext
    return cuda_ext.asynci_decode_cuda if cuda_ext.load_extension() is not None else None


def kernel_table(calls):
    """Per recorded call: worst |o - o64| / (1 + |o64|) of the Triton kernel, of the CUDA
    decode kernel (decode calls of the shapes it supports; else None) and of the torch
    backend's computation, on identical bf16 inputs."""
    prefill, decode, cuda = ops.asynci_prefill_triton, ops.asynci_decode_triton, cuda_decode()
    rows = []
    for kind, args, kwargs in calls:
        if kind == "prefill":
            q, cache, table, qsl, seq, sigma, scale, pool, relu, out = args
            lens = [(int(qsl[b]), int(qsl[b + 1]), int(seq[b])) for b in range(seq.shape[0])]
        else:
            q, cache, table, seq, sigma, scale, pool, relu, out = args
            lens = [(b, b + 1, int(seq[b])) for b in range(q.shape[0])]
        kern, by_cuda = out.clone(), None
        if kind == "prefill":
            prefill(q, cache, table, qsl, seq, sigma, scale, pool, relu, kern,
                    kwargs.get("max_query_len"), kwargs.get("max_seq_len"))
        else:
            decode(q, cache, table, seq, sigma, scale, pool, relu, kern,
                   max_seq_len=kwargs.get("max_seq_len"), prefix_len=kwargs.get("prefix_len"))
            if cuda is not None and cuda_decode_supported(q, cache, pool):
                by_cuda = cuda(q, cache, table, seq, sigma, scale, pool, relu, out.clone(),
                               max_seq_len=kwargs.get("max_seq_len"))
        worst = dict(triton=0.0, cuda=0.0 if by_cuda is not None else None, torch=0.0)
        for b, (lo, hi, n) in enumerate(lens):
            if hi == lo or n == 0:
                continue
            want = _torchlike(q[lo:hi], cache, table[b], n, sigma, scale, pool, relu, torch.float64)
            got = dict(triton=kern[lo:hi], cuda=None if by_cuda is None else by_cuda[lo:hi],
                       torch=_torchlike(q[lo:hi], cache, table[b], n, sigma, scale, pool, relu))
            for name, o in got.items():
                if o is not None:
                    e = ((o.double() - want).abs() / (1 + want.abs())).max().item()
                    worst[name] = max(worst[name], e)
        rows.append((kind, len(lens), max(n for _, _, n in lens), worst))
    return rows


def print_kernel_table(name, rows):
    """One line per recorded call, then the worst per kernel over the shape's calls."""
    fmt = lambda x: "      -" if x is None else f"{x:.2e}"  # noqa: E731
    print(f"  {name} attention kernels on recorded bf16 inputs (worst |o-o64|/(1+|o64|)):")
    for kind, b, n, w in rows:
        print(f"    {kind:7s} B={b:3d} max_keys={n:4d}  triton {fmt(w['triton'])}  "
              f"cuda {fmt(w['cuda'])}  torch-backend {fmt(w['torch'])}  "
              f"ratio {w['triton'] / max(w['torch'], 1e-30):.2f}")
    for kind in ("prefill", "decode"):
        ws = [w for k, _, _, w in rows if k == kind]
        if ws:
            top = {k: max((w[k] for w in ws if w[k] is not None), default=None) for k in ws[0]}
            print(f"    {kind:7s} worst over {len(ws)} calls:       triton {fmt(top['triton'])}  "
                  f"cuda {fmt(top['cuda'])}  torch-backend {fmt(top['torch'])}")


# ---- main --------------------------------------------------------------------------------
def stats(e):
    if e.numel() == 0:
        return float("nan"), float("nan"), float("nan")
    return e.max().item(), e.quantile(0.99).item(), e.mean().item()


def run_shape(name, overrides, seeds, attribution, dtype, device, smoke, noise=True):
    """Returns {variant: [(worst, p99, mean) per seed]} and prints the shape's tables; without
    `noise`, no noise-control run."""
    by_variant, kernel_rows = {}, []
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            path, cfg, tensors = build_checkpoint(tmp, overrides, seed)
            oracle = Oracle(cfg, tensors, device)
            waves = make_requests(cfg.vocab_size, seed, smoke)
            for vname, (kwargs, patches) in variants(attribution and seed == 0, device == "cpu").items():
                if vname == NOISE and not noise:
                    continue
                t0 = time.time()
                rec = Recorder(min_keys=32 if smoke else 256)
                extra = []
                if vname == "triton" and seed == 0:
                    cur = dict(((m, n), f) for m, n, f in patches)
                    pre = getattr(cur.get((triton_backend, "prefill_launch")), "fn", ops.asynci_prefill)
                    dec = getattr(cur.get((triton_backend, "decode_launch")), "fn", ops.asynci_decode)
                    extra = [(triton_backend, "prefill_launch", as_launch(rec.wrap("prefill", pre))),
                             (triton_backend, "decode_launch", as_launch(rec.wrap("decode", dec)))]
                with patched(patches + extra):
                    got = run_engine(path, dtype, waves, device, **kwargs)
                e = errors(got, oracle)
                w, p99, mean = stats(e)
                by_variant.setdefault(vname, []).append((w, p99, mean))
                print(f"  {name} seed={seed} {vname:28s} worst {w:.3e}  p99 {p99:.3e}  "
                      f"mean {mean:.2e}  n={e.numel()}  ({time.time() - t0:.1f}s)", flush=True)
                kernel_rows += kernel_table(rec.calls)
    if kernel_rows:
        print_kernel_table(name, kernel_rows)
    return by_variant


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, one tiny shape")
    ap.add_argument("--cpu", action="store_true", help="CPU, bf16, the Triton kernels interpreted")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--shapes", default=None, help="comma-separated names of SHAPES")
    ap.add_argument("--no-attribution", action="store_true")
    a = ap.parse_args()
    smoke = a.smoke or not (a.cpu or torch.cuda.is_available())
    if smoke or a.cpu:
        # the interpreter's bf16 made as on the GPU: without it every bf16 product is garbage
        from test_ops_attention import patch_interpreter_bf16, patch_interpreter_scalars
        patch_interpreter_scalars(), patch_interpreter_bf16()
    device = "cpu" if smoke or a.cpu else "cuda"
    dtype = "float32" if smoke else "bfloat16"
    shapes = SMOKE_SHAPE if smoke else SHAPES
    if a.shapes:
        shapes = {k: SHAPES[k] for k in a.shapes.split(",")}
    seeds = 1 if smoke else a.seeds
    t0 = time.time()
    table = {}
    for name, ov in shapes.items():
        print(f"{name}: {ov}", flush=True)
        table[name] = run_shape(name, ov, seeds, not a.no_attribution, dtype, device, smoke)
    print(f"\nworst scaled logprob error, {dtype}, max over {seeds} seed(s); "
          f"Triton/torch must be <= 1.2 ({time.time() - t0:.0f}s)")
    print(f"{'shape':22s} {'triton':>9s} {'torch':>9s} {'ratio':>6s} {'noise':>6s} {'p99':>6s} {'mean':>6s}"
          "  per seed: ratio / noise  closest swap to torch's error")
    for name, stat in table.items():
        w = {k: [seed[0] for seed in v] for k, v in stat.items()}
        tri, tor = max(w["triton"]), max(w["torch"])
        mean = sum(seed[2] for seed in stat["triton"]) / max(sum(seed[2] for seed in stat["torch"]), 1e-30)
        p99 = max(seed[1] for seed in stat["triton"]) / max(max(seed[1] for seed in stat["torch"]), 1e-30)
        noise = max(w[NOISE]) / max(tor, 1e-30)
        per_seed = " ".join(f"{t / max(o, 1e-30):.2f}/{n / max(o, 1e-30):.2f}"
                            for t, o, n in zip(w["triton"], w["torch"], w[NOISE]))
        swaps = {k: v[0] for k, v in w.items() if k.startswith("triton ") and k != "triton eager"}
        best = min(swaps, key=lambda k: abs(swaps[k] - w["torch"][0])) if swaps else "-"
        tag = f"{best} ({swaps[best]:.3e})" if swaps else "-"
        print(f"{name:22s} {tri:9.3e} {tor:9.3e} {tri / max(tor, 1e-30):6.2f} {noise:6.2f} {p99:6.2f} {mean:6.2f}  "
              f"{per_seed}  {tag}")
    print(f"noise: {NOISE} (the torch backend with its attention in fp32: more precise, otherwise the same "
          "engine) over the torch backend; p99 and mean: the Triton engine's 99th percentile (worst seed) and "
          "mean error over the torch backend's (mean <= 1.05 wanted, tests/test_gpu_parity.py). An engine with "
          "exact attention (noise) reached 1.24-1.59x the torch backend's worst on some seeds (H200, "
          "benchmarks/RESULTS.md): the worst ratio is one token's luck, p99 and mean measure precision")


if __name__ == "__main__":
    main()
