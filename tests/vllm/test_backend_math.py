"""The backend's cache write and both compute paths against the dense AsyncI reference, on vLLM's
CPU cache shape [num_blocks, Hkv, block_size, 2*D] in two stride orders and odd head sizes."""
import pytest
import torch

from vllm_helpers import HAVE_VLLM

if not HAVE_VLLM:
    pytest.skip("vLLM not installed (see scripts/ci_vllm.sh)", allow_module_level=True)

from asynct.integrations.vllm import paged_torch  # noqa: E402
from asynct.ops import asynci_prefill  # noqa: E402
from asynct.ops.asynci import asynci_attention  # noqa: E402


def make_cache(nb, hkv, bs, d, block_major):
    """vLLM's logical view; block_major=True is the LBNHC layout (physical [NB, BS, Hkv, 2D])."""
    if block_major:
        return torch.zeros(nb, bs, hkv, 2 * d).transpose(1, 2)
    return torch.zeros(nb, hkv, bs, 2 * d)


def scenario(d, hkv, g, bs, q_lens, ctx_lens, block_major, seed=0):
    """A step of len(q_lens) sequences with shuffled block tables; returns the cache after the
    write, the step's queries and metadata, and the dense reference output."""
    gen = torch.Generator().manual_seed(seed)
    hq = hkv * g
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    per_seq = [-(-s // bs) for s in seq_lens]
    nb = sum(per_seq) + 3
    perm = torch.randperm(nb, generator=gen)
    tables, at = torch.zeros(len(q_lens), max(per_seq), dtype=torch.int32), 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[at:at + n]
        at += n
    cache = make_cache(nb, hkv, bs, d, block_major)
    ks = [torch.randn(s, hkv, d, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, hkv, d, generator=gen) for s in seq_lens]
    slots = [tables[b, torch.arange(s) // bs].long() * bs + torch.arange(s) % bs
             for b, s in enumerate(seq_lens)]
    # Write everything (earlier steps' context and this step's keys) through the backend's path.
    paged_torch.write_kv(torch.cat(ks), torch.cat(vs), cache, torch.cat(slots))
    qs = [torch.randn(q, hq, d, generator=gen) for q in q_lens]
    sigma = torch.rand(hq, generator=gen) + 0.5
    scale = 0.3
    ref = [asynci_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                            v.transpose(0, 1)[None], sigma, scale, 3, True, q_offset=c)[0]
           .transpose(0, 1) for q, k, v, c in zip(qs, ks, vs, ctx_lens)]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return dict(cache=cache, q=torch.cat(qs), tables=tables, qsl=qsl, sigma=sigma, scale=scale,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), ref=torch.cat(ref), hq=hq)


CASES = [  # d, hkv, g, bs, q_lens, ctx_lens
    (16, 2, 2, 4, [1, 5, 23, 1], [0, 3, 0, 40]),   # mixed prefill / decode / chunk
    (24, 1, 3, 7, [9, 1, 1], [13, 6, 0]),          # odd head and block sizes
    (8, 4, 1, 16, [33], [17]),                     # tiny head, MHA
]


@pytest.mark.parametrize("block_major", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_torch_path_matches_dense_reference(case, block_major):
    d, hkv, g, bs, q_lens, ctx = case
    s = scenario(d, hkv, g, bs, q_lens, ctx, block_major)
    groups = paged_torch.plan(s["qsl"], s["seq_lens"], s["tables"], bs, s["hq"])
    out = torch.zeros_like(s["q"])
    paged_torch.attend(s["q"], s["cache"], groups, s["sigma"], s["scale"], 3, True, out)
    torch.testing.assert_close(out, s["ref"], rtol=1e-5, atol=1e-5)


def test_torch_path_splits_to_budget():
    d, hkv, g, bs, q_lens, ctx = CASES[0]
    s = scenario(d, hkv, g, bs, q_lens, ctx, True)
    groups = paged_torch.plan(s["qsl"], s["seq_lens"], s["tables"], bs, s["hq"], budget=300)
    assert len(groups) > len(q_lens)  # long rows were cut into several segments
    out = torch.zeros_like(s["q"])
    paged_torch.attend(s["q"], s["cache"], groups, s["sigma"], s["scale"], 3, True, out)
    torch.testing.assert_close(out, s["ref"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_major", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_shared_ops_on_strided_view_match(case, block_major):
    """asynct.ops (torch reference on CPU) reads vLLM's cache through the strided view."""
    d, hkv, g, bs, q_lens, ctx = case
    s = scenario(d, hkv, g, bs, q_lens, ctx, block_major)
    paged = paged_torch.as_ops_layout(s["cache"])
    assert paged.data_ptr() == s["cache"].data_ptr()  # a view, no copy
    out = torch.zeros_like(s["q"])
    asynci_prefill(s["q"], paged, s["tables"], s["qsl"], s["seq_lens"], s["sigma"], s["scale"],
                   3, True, out, max_query_len=max(q_lens), max_seq_len=int(s["seq_lens"].max()))
    torch.testing.assert_close(out, s["ref"], rtol=1e-5, atol=1e-5)


def test_write_kv_skips_padding_slots():
    cache = make_cache(2, 1, 4, 2, True)
    k = torch.ones(3, 1, 2)
    paged_torch.write_kv(k, 2 * k, cache, torch.tensor([5, -1, 0]))
    assert cache[1, 0, 1].tolist() == [1, 1, 2, 2] and cache[0, 0, 0].tolist() == [1, 1, 2, 2]
    assert float(cache.abs().sum()) == 12.0
