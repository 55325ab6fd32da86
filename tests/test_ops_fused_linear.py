"""Decode-sized fused linear layers (Triton, interpreted on CPU) against their unfused
compositions, on awkward shapes: K and N not multiples of the tiles, GQA, 1 to 32 rows (both
row tiles)."""
import pytest
import torch
from test_engine import reference  # noqa: F401  (fixture: the HF reference model)
from test_ops_attention import _interpreter_scalars  # noqa: F401  (autouse: loop bounds, bf16)
from test_ops_elementwise import close as close_tol
from test_ops_elementwise import DEV, on_dev

from asynct.ops import (SMALL_M, dyht_add, linear_dyht_add, linear_dyht_add_unfused, linear_dyht_add_triton,
                        linear_qk_norm_rope, linear_qk_norm_rope_unfused, linear_qk_norm_rope_triton,
                        linear_reglu, linear_reglu_unfused, linear_reglu_triton, rope_cos_sin_cache,
                        write_kv_cache_triton)

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(got, want, dtype):
    close_tol(got, want, TOL[dtype])


def rand(*shape, gen, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def norm_params(n, per_channel, gen):
    """(alpha, weight): alpha large enough that the clamp cuts some values, scalar or per channel."""
    c = n if per_channel else 1
    return torch.rand(c, generator=gen) * 3 + 0.2, torch.randn(c, generator=gen)


# (rows, K, N); K of 1,024 takes 512-wide K tiles at up to 16 rows
CASES = [(1, 96, 100), (5, 100, 48), (16, 64, 33), (3, 512, 48), (2, 1024, 32), (23, 96, 40), (32, 1024, 16),
         (33, 100, 24), (64, 96, 17)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,n", CASES)
@pytest.mark.parametrize("post", [False, True])
def test_linear_dyht_add(t, k, n, post, dtype):
    gen = torch.Generator().manual_seed(t * 100 + n)
    x = rand(t, k + 3, gen=gen, dtype=dtype)[:, 1:k + 1]       # rows strided as a view's are
    w, res = rand(n, k, gen=gen, dtype=dtype, scale=0.2), rand(t, n, gen=gen, dtype=dtype)
    a, dw = norm_params(n, True, gen)
    pa, pw = norm_params(n, False, gen) if post else (None, None)
    got = on_dev(linear_dyht_add_triton, x, w, res, a, dw, pa, pw)
    want = linear_dyht_add_unfused(x, w, res, a, dw, pa, pw)
    for g, r in zip(got, want):
        close(g, r, dtype)
    hidden = (w.float() @ x.float().T).T.to(dtype).float()
    if post:
        hidden = pw * (pa * hidden).clamp(-1, 1)
    close(want[0], (hidden + res.float()).to(dtype), dtype)           # the reference by hand


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,i", [(1, 96, 52), (7, 130, 24), (16, 64, 3), (2, 1024, 12), (29, 64, 10),
                                   (47, 64, 9)])
def test_linear_reglu(t, k, i, dtype):
    gen = torch.Generator().manual_seed(t + i)
    x, w = rand(t, k, gen=gen, dtype=dtype), rand(2 * i, k, gen=gen, dtype=dtype, scale=0.2)
    got = on_dev(linear_reglu_triton, x, w)
    close(got, linear_reglu_unfused(x, w), dtype)
    y = (x.float() @ w.float().T).to(dtype).float()
    close(linear_reglu_unfused(x, w), (y[:, :i].relu() * y[:, i:]).to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hkv,d,k,per_channel", [(1, 4, 2, 32, 96, True), (9, 3, 1, 16, 96, False),
                                                       (16, 2, 2, 64, 96, True), (2, 1, 1, 16, 1024, True),
                                                       (3, 2, 1, 128, 64, True), (20, 3, 1, 32, 96, False),
                                                       (64, 2, 1, 16, 96, True)])
def test_linear_qk_norm_rope(t, hq, hkv, d, k, per_channel, dtype):
    gen = torch.Generator().manual_seed(t * hq + d)
    x, w = rand(t, k, gen=gen, dtype=dtype), rand((hq + 2 * hkv) * d, k, gen=gen, dtype=dtype, scale=0.3)
    pos = torch.randint(0, 3000, (t,), generator=gen)
    cache = rope_cos_sin_cache(d, 4096, 10000.0)
    norms = (*norm_params(d, per_channel, gen), *norm_params(d, per_channel, gen))
    got = on_dev(linear_qk_norm_rope_triton, x, w, pos, hq, hkv, *norms, cache)
    want = linear_qk_norm_rope_unfused(x, w, pos, hq, hkv, *norms, cache)
    for g, r in zip(got, want):
        close(g, r.contiguous(), dtype)
    v = (x.float() @ w.float().T).to(dtype)[:, (hq + hkv) * d:]
    close(want[2].reshape(t, -1), v, dtype)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t,hq,hkv,d,bs", [(1, 4, 2, 32, 16), (3, 4, 2, 32, 16), (4, 4, 2, 32, 16),
                                          (5, 3, 1, 16, 4), (16, 2, 2, 64, 16), (24, 2, 1, 32, 16)])
def test_qkv_stores_keys_and_values_in_the_cache(t, hq, hkv, d, bs, fp8):
    """Given the cache and slots, the fused QKV kernel stores k and v itself, as the unfused
    path + the cache write would (padding slots -1 store nothing; FP8 scales per channel)."""
    gen = torch.Generator().manual_seed(t + d)
    dev, dtype = DEV, torch.bfloat16
    x, w = rand(t, 96, gen=gen, dtype=dtype), rand((hq + 2 * hkv) * d, 96, gen=gen, dtype=dtype, scale=0.3)
    pos, rope = torch.randint(0, 3000, (t,), generator=gen), rope_cos_sin_cache(d, 4096, 10000.0)
    norms = (*norm_params(d, True, gen), *norm_params(d, False, gen))
    slots = torch.randperm(8 * bs, generator=gen)[:t]
    slots[t // 2] = -1 if t > 1 else slots[0]
    if t > 16:
        slots[t - 2] = -1       # padding in the 32-row tile's second half
    scales = tuple(torch.rand(hkv, d, generator=gen) + 0.5 for _ in range(2)) if fp8 else (None, None)
    cache = torch.zeros(2, 8, bs, hkv, d, dtype=torch.float8_e4m3fn if fp8 else dtype)
    want_cache = cache.clone()
    q, k, v = linear_qk_norm_rope_unfused(x, w, pos, hq, hkv, *norms, rope)
    # the write kernel, not the torch reference: the interpreter rounds fp32 -> e4m3 its own way
    # off the GPU (test_fp8_kv.test_fp8_store_kernel_interpreted_matches_ref)
    on_dev(write_kv_cache_triton, k.contiguous(), v.contiguous(), want_cache, slots, *scales)
    args = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in (x, w, pos, hq, hkv, *norms, rope)]
    got_cache = cache.to(dev)
    got = linear_qk_norm_rope_triton(*args, got_cache, slots.to(dev),
                                     *(s.to(dev) if fp8 else None for s in scales))
    assert got[1] is None and got[2] is None
    close(got[0].cpu(), q.contiguous(), dtype)
    got_cache, want_cache = got_cache.cpu().float().flatten(1, 2), want_cache.float().flatten(1, 2)
    live = slots[slots >= 0]
    assert want_cache[:, live].abs().sum(-1).gt(0).all()
    assert torch.equal(got_cache[:, live], want_cache[:, live])
    assert torch.equal(got_cache.abs().sum((0, 2, 3)) > 0, want_cache.abs().sum((0, 2, 3)) > 0)


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 32), (3, 3, 1, 16), (4, 2, 2, 64), (17, 2, 1, 32)])
def test_qkv_zeroes_the_attention_sums(t, hq, hkv, d, store):
    """Given attn_sums (fp32, q's shape), the QKV projection zeroes them for the decode to add
    into (the fused kernel's q programs, each its own columns; the unfused path by a fill),
    and its outputs are as without them. Wrong sums are refused by name."""
    gen, dtype = torch.Generator().manual_seed(t + d), torch.bfloat16
    x, w = rand(t, 96, gen=gen, dtype=dtype), rand((hq + 2 * hkv) * d, 96, gen=gen, dtype=dtype, scale=0.3)
    pos, rope = torch.randint(0, 3000, (t,), generator=gen), rope_cos_sin_cache(d, 4096, 10000.0)
    norms = (*norm_params(d, True, gen), *norm_params(d, False, gen))
    args = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in (x, w, pos, hq, hkv, *norms, rope)]
    target = {}
    if store:
        target = dict(kv_cache=torch.zeros(2, 8, 16, hkv, d, dtype=dtype, device=DEV),
                      slot_mapping=torch.arange(t, device=DEV))
    want = linear_qk_norm_rope_triton(*args, **target)
    for fn in (linear_qk_norm_rope_triton, linear_qk_norm_rope_unfused, linear_qk_norm_rope):
        sums = torch.full((t, hq, d), float("nan"), device=DEV)
        kw = dict(target, attn_sums=sums) if fn is not linear_qk_norm_rope_unfused else {}
        got = fn(*args, **kw)
        if fn is linear_qk_norm_rope_unfused:
            continue
        assert torch.equal(sums, torch.zeros_like(sums)), fn.__name__
        assert torch.equal(got[0], want[0])
    with pytest.raises(ValueError, match="attn_sums must be contiguous fp32"):
        linear_qk_norm_rope_triton(*args, attn_sums=torch.zeros(t, hq, d, dtype=dtype, device=DEV))


@pytest.mark.parametrize("post", [False, True])
@pytest.mark.parametrize("t,k", [(1, 96), (2, 1024), (3, 100), (4, 1024)])
def test_o_proj_takes_fp32_sums_beside_16_bit_weights(t, k, post):
    """The decode's fp32 sums go into o_proj as they are, on its CUDA-core path (one to four
    rows), the product rounded to the weights' dtype: against the unfused op, which rounds the
    same fp32 product. Five rows take the dot tiles, which want operands alike: the dispatch
    sends those to the unfused op, the kernel refuses them by name."""
    from asynct.ops.fused_linear import _gemv_takes_fp32
    gen, n, dtype = torch.Generator().manual_seed(t * k), 41, torch.bfloat16
    x, w, res = rand(t, k, gen=gen, dtype=torch.float32), rand(n, k, gen=gen, dtype=dtype, scale=0.05), \
        rand(t, n, gen=gen, dtype=dtype)
    a, dw = norm_params(n, True, gen)
    pa, pw = norm_params(n, False, gen) if post else (None, None)
    assert _gemv_takes_fp32(x, w)
    got = on_dev(linear_dyht_add_triton, x, w, res, a, dw, pa, pw)
    want = linear_dyht_add_unfused(x, w, res, a, dw, pa, pw)
    for g, r in zip(got, want):
        close(g, r, dtype)
    y = (x.double() @ w.double().T).to(dtype)
    close(want[0], dyht_add(y, res, a, dw, pa, pw)[0], dtype)
    five = torch.zeros(5, k)
    assert not _gemv_takes_fp32(five, w) and not _gemv_takes_fp32(x.to(dtype), w)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        linear_dyht_add_triton(five, w, torch.zeros(5, n, dtype=dtype), a, dw)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 3, 16, 17, 32, 33, 64])
def test_bench_shapes_deterministic(t):
    """bench-0.6b's four projections: equal to the unfused ops, and bit-identical from call to
    call (the async-vs-sync and graph-vs-eager equality tests rely on it)."""
    gen = torch.Generator("cuda").manual_seed(t)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    x, x3, res = r(t, 1024), r(t, 3072), r(t, 1024)
    one = torch.ones(1, device="cuda")
    pos, cache = torch.arange(t, device="cuda") + 100, rope_cos_sin_cache(128, 512, 1e6, "cuda")
    calls = [(linear_qk_norm_rope_triton, linear_qk_norm_rope_unfused,
              (x, r(2048, 1024, scale=0.03), pos, 8, 4, one, one, one, one, cache)),
             (linear_dyht_add_triton, linear_dyht_add_unfused, (x, r(1024, 1024, scale=0.03), res, one, one, one, one)),
             (linear_reglu_triton, linear_reglu_unfused, (x, r(6144, 1024, scale=0.03))),
             (linear_dyht_add_triton, linear_dyht_add_unfused, (x3, r(1024, 3072, scale=0.03), res, one, one))]
    for fused, ref, args in calls:
        first = _tuple(fused(*args))
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(first, _tuple(fused(*args))))
        for a, b in zip(first, _tuple(ref(*args))):
            close(a.cpu(), b.contiguous().cpu(), torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fold,cascade", [(False, False), (True, True)])
def test_pdl_chain_matches_plain_launches(monkeypatch, fold, cascade):
    """Four decode layers' kernel chains (QKV, the KV write or its fold into QKV, split decode
    attention with or without its shared-prefix pass, the split sum, o_proj, gate/up, down)
    replayed from CUDA graphs with programmatic dependent launch and without, on three inputs
    in turn: outputs and cache bit-identical. A kernel that read what the kernel before writes,
    or wrote anything, before its wait would race here."""
    from asynct.ops import _triton, asynci_decode, write_kv_cache
    if not _triton.pdl(torch.zeros(1, device="cuda")):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    gen = torch.Generator("cuda").manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    one, sigma = torch.ones(1, device="cuda"), torch.full((8,), 0.7, device="cuda")
    x_in, xs, cache0 = r(1, 1024), [r(1, 1024) for _ in range(3)], r(2, 40, 16, 4, 128)
    pos, rope = torch.tensor([299], device="cuda"), rope_cos_sin_cache(128, 512, 1e6, "cuda")
    table = torch.arange(40, dtype=torch.int32, device="cuda")[None]
    lens, slot = torch.tensor([300], dtype=torch.int32, device="cuda"), torch.tensor([299], device="cuda")
    prefix = torch.tensor([256], dtype=torch.int32, device="cuda") if cascade else None
    w = [(r(2048, 1024, scale=0.03), r(1024, 1024, scale=0.03), r(6144, 1024, scale=0.03),
          r(1024, 3072, scale=0.03)) for _ in range(4)]

    def layers(cache):
        h = n = x_in
        for wqkv, wo, wgu, wd in w:
            target = dict(kv_cache=cache, slot_mapping=slot) if fold else {}
            q, k, v = linear_qk_norm_rope(n, wqkv, pos, 8, 4, one, one, one, one, rope, **target)
            assert (k is None) == fold
            if k is not None:
                write_kv_cache(k, v, cache, slot)
            a = asynci_decode(q, cache, table, lens, sigma, 0.09, 3, True, torch.empty_like(q),
                              max_seq_len=4096, prefix_len=prefix)
            h, n = linear_dyht_add(a.view(1, -1), wo, h, one, one, one, one)
            h, n = linear_dyht_add(linear_reglu(n, wgu), wd, h, one, one)
        return h, n

    graphs = []
    for on in (False, True):
        monkeypatch.setattr(_triton, "PDL", on)
        cache = cache0.clone()
        layers(cache.clone())               # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layers(cache)
        graphs.append((graph, cache, out))
    for x in xs:
        x_in.copy_(x)
        got = []
        for graph, cache, out in graphs:
            cache.copy_(cache0)
            graph.replay()
            got.append([t.clone() for t in (*out, cache)])
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(*got))


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def test_bad_inputs_are_named():
    x, w = torch.randn(SMALL_M + 1, 32), torch.randn(16, 32)
    one, pos = torch.ones(1), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=f"T <= {SMALL_M}"):
        linear_reglu_triton(x, w)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        linear_reglu_triton(x[:2], torch.randn(16, 31))
    with pytest.raises(ValueError, match="even row count"):
        linear_reglu_triton(x[:2], torch.randn(15, 32))
    with pytest.raises(ValueError, match="residual"):
        linear_dyht_add_triton(x[:2], w, torch.randn(3, 16), one, one)
    with pytest.raises(ValueError, match="go together"):
        linear_dyht_add_triton(x[:2], w, torch.randn(2, 16), one, one, one, None)
    with pytest.raises(ValueError, match="rows, the heads want"):
        linear_qk_norm_rope_triton(x[:1], w, pos, 1, 1, one, one, one, one, rope_cos_sin_cache(16, 8))
    with pytest.raises(ValueError, match="power of two >= 16"):
        linear_qk_norm_rope_triton(x[:1], torch.randn(24, 32), pos, 1, 1, one, one, one, one,
                                   rope_cos_sin_cache(8, 8))
    with pytest.raises(ValueError, match="positions must be"):
        linear_qk_norm_rope_triton(x[:2], torch.randn(48, 32), pos, 1, 1, one, one, one, one,
                                   rope_cos_sin_cache(16, 8))


@pytest.mark.parametrize("t", [3, 20, SMALL_M + 5])
def test_outputs_go_into_given_buffers(t):
    """`out`: the static buffers of a piecewise graph. The QKV projection, q and k (and the
    unfused path's v, a view of the projection) and the hidden of linear_dyht_add are written
    there, the buffer may be the residual itself, and the values are the fresh outputs'. The
    fused kernels (up to SMALL_M rows) write their own v. A buffer of the wrong shape is named."""
    gen, dtype, (hq, hkv, d, k) = torch.Generator().manual_seed(t), torch.bfloat16, (4, 2, 32, 96)
    x, w = rand(t, k, gen=gen, dtype=dtype).to(DEV), rand((hq + 2 * hkv) * d, k, gen=gen, dtype=dtype).to(DEV)
    pos, cache = torch.randint(0, 100, (t,), generator=gen).to(DEV), rope_cos_sin_cache(d, 128).to(DEV)
    norms = [p.to(DEV) for p in (*norm_params(d, True, gen), *norm_params(d, False, gen))]
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype, device=DEV)  # noqa: E731
    bufs = (nan(t, (hq + 2 * hkv) * d), nan(t, hq, d), nan(t, hkv, d))
    want = linear_qk_norm_rope(x, w, pos, hq, hkv, *norms, cache)
    got = linear_qk_norm_rope(x, w, pos, hq, hkv, *norms, cache, out=bufs)
    assert got[0].data_ptr() == bufs[1].data_ptr() and got[1].data_ptr() == bufs[2].data_ptr()
    assert (got[2].data_ptr() == bufs[0][:, (hq + hkv) * d:].data_ptr()) == (t > SMALL_M or not CUDA)
    for g, r in zip(got, want):
        assert torch.equal(g, r)
    with pytest.raises(ValueError, match="q out must be contiguous"):
        linear_qk_norm_rope(x, w, pos, hq, hkv, *norms, cache, out=(bufs[0], bufs[1][:, :1], bufs[2]))
    if t <= SMALL_M:    # the fused kernel itself (interpreted on CPU)
        bufs = (nan(t, (hq + 2 * hkv) * d), nan(t, hq, d), nan(t, hkv, d))
        fresh = linear_qk_norm_rope_triton(x, w, pos, hq, hkv, *norms, cache)
        got = linear_qk_norm_rope_triton(x, w, pos, hq, hkv, *norms, cache, out=bufs)
        assert got[0].data_ptr() == bufs[1].data_ptr() and got[1].data_ptr() == bufs[2].data_ptr()
        assert all(torch.equal(g, r) for g, r in zip(got, fresh))
    wo, res = rand(48, hq * d, gen=gen, dtype=dtype).to(DEV), rand(t, 48, gen=gen, dtype=dtype).to(DEV)
    a, dw = (p.to(DEV) for p in norm_params(48, True, gen))
    q2 = got[0].reshape(t, -1)
    want = linear_dyht_add(q2, wo, res, a, dw)
    into = nan(t, 48)
    assert all(torch.equal(g, r) for g, r in zip(linear_dyht_add(q2, wo, res, a, dw, out=into), want))
    assert torch.equal(into, want[0])
    if t <= SMALL_M:
        into = nan(t, 48)
        fresh = linear_dyht_add_triton(q2, wo, res, a, dw)
        assert torch.equal(linear_dyht_add_triton(q2, wo, res, a, dw, out=into)[0], fresh[0])
        assert torch.equal(into, fresh[0])
    hidden, normed = linear_dyht_add(q2, wo, res, a, dw, out=res)    # the residual stream, in place
    assert hidden.data_ptr() == res.data_ptr() and torch.equal(res, want[0]) and torch.equal(normed, want[1])
    with pytest.raises(ValueError, match="out must be contiguous"):
        linear_dyht_add(q2, wo, res, a, dw, out=into[:, :40])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_dispatch_takes_the_kernels_up_to_small_m():
    x, w = torch.randn(SMALL_M + 1, 64, device="cuda"), torch.randn(32, 64, device="cuda")
    assert torch.equal(linear_reglu(x[:SMALL_M], w), linear_reglu_triton(x[:SMALL_M], w))
    assert torch.equal(linear_reglu(x, w), linear_reglu_unfused(x, w))
    one, cache = torch.ones(1, device="cuda"), rope_cos_sin_cache(24, 64, device="cuda")
    args = (x[:2], torch.randn(72, 64, device="cuda"), torch.arange(2, device="cuda"), 1, 1,
            one, one, one, one, cache)
    for got, want in zip(linear_qk_norm_rope(*args), linear_qk_norm_rope_unfused(*args)):
        assert torch.equal(got, want)           # head_dim 24: not a power of two, unfused


def test_launch_plan_row_tiles_and_shared_memory():
    """16-row activation tiles up to 16 rows, 32 up to 32, 64 past; 512-wide K tiles only with
    16-row ones; stages kept within 128 KiB of shared memory (fp32 at 32 rows: 2, at 64: 1)."""
    from asynct.ops.fused_linear import _tiles, row_tile
    assert [row_tile(m) for m in (1, 16, 17, 32, 33, SMALL_M)] == [16, 16, 32, 32, 64, 64]
    for rows, dtype, tiles, want in [(16, torch.bfloat16, 64, (16, 512, 3)), (17, torch.bfloat16, 64, (32, 256, 4)),
                                     (32, torch.float32, 64, (32, 256, 2)), (16, torch.float32, 64, (16, 256, 4)),
                                     (32, torch.bfloat16, 384, (32, 256, 4)), (33, torch.bfloat16, 64, (64, 256, 3)),
                                     (64, torch.float32, 384, (64, 256, 1))]:
        plan = _tiles(torch.zeros(rows, 1024, dtype=dtype), 1024, tiles)
        assert (plan["BLOCK_M"], plan["BLOCK_K"], plan["num_stages"]) == want, (rows, dtype, tiles)
        smem = plan["num_stages"] * (plan["BLOCK_M"] + 16) * plan["BLOCK_K"] * dtype.itemsize
        assert smem <= 128 << 10


def test_launch_plan_gemv_rows(monkeypatch):
    """The CUDA-core path where it won: one row for every op, two for all but gate/up, three
    and four (in the 4-row kernel) for QKV and o_proj/down where K is no wider than
    GEMV_WIDE_ROWS_MAX_K, dot tiles of 16 weight rows past that; its K tile never wider than K
    needs; never more rows than the kernel has accumulators for, whatever the table says."""
    from asynct.ops import fused_linear
    from asynct.ops.fused_linear import GEMV, GEMV_MAX_ROWS, TILE_N, _plan
    monkeypatch.setitem(fused_linear.GEMV, "probe", ((2,) * (GEMV_MAX_ROWS + 2), 512, (4,) * (GEMV_MAX_ROWS + 2)))
    assert _plan(torch.zeros(GEMV_MAX_ROWS + 1, 96), 96, "probe")[1] is None
    wide = fused_linear.GEMV_WIDE_ROWS_MAX_K + 1
    assert _plan(torch.zeros(2, wide), wide, "probe")[1] and _plan(torch.zeros(3, wide), wide, "probe")[1] is None
    assert _plan(torch.zeros(GEMV_MAX_ROWS, 96), 96, "probe")[1]["BLOCK_M"] == GEMV_MAX_ROWS
    # rows past GEMV_EARLY_ELEMENTS take K tiles after the wait, even if the table's tile holds K
    monkeypatch.setitem(fused_linear.GEMV, "probe", ((16,), 1024, (4,)))
    assert _plan(torch.zeros(1, 1024), 1024, "probe")[1]["BLOCK_K"] < 1024
    monkeypatch.delitem(fused_linear.GEMV, "probe")
    # weight rows a program by activation rows: QKV's halve past two
    assert [_plan(torch.zeros(m, 1024), 1024, "qkv")[0] for m in (1, 2, 3, 4)] == [8, 8, 4, 4]
    for rows, ops in [(1, {"qkv", "reglu", "dyht_add"}), (2, {"qkv", "dyht_add"}), (3, {"qkv", "dyht_add"}),
                      (4, {"qkv", "dyht_add"}), (5, set())]:
        x = torch.zeros(rows, 96, dtype=torch.bfloat16)
        for op in GEMV:
            n, plan = _plan(x, 96, op)
            assert (plan is not None) == (op in ops), (rows, op)
            if plan:
                assert plan["GEMV"] and plan["BLOCK_M"] == {3: 4}.get(rows, rows)
                assert plan["BLOCK_K"] == 128 and not plan["EVEN_K"]
            else:
                assert n == TILE_N


def test_launch_plan_caps_registers_only_where_k_is_one_small_tile(monkeypatch):
    """Gate/up's one-row GEMV takes the register cap at K 1,024 (one tile), not past one tile
    (the cap would spill), nor at a K that leaves the tile partly masked; no other op takes it,
    nor gate/up under another config (a benchmark's sweep), which the cap was not measured for."""
    from asynct.ops import fused_linear
    from asynct.ops.fused_linear import GEMV, _plan
    assert GEMV["reglu"][3] == (40,)
    for k, capped in [(1024, True), (512, True), (2048, False), (896, False), (3072, False)]:
        plan = _plan(torch.zeros(1, k, dtype=torch.bfloat16), k, "reglu")[1]
        assert plan.get("maxnreg") == (40 if capped else None), k
    for op in set(GEMV) - {"reglu"}:
        for m in (1, 2):
            plan = _plan(torch.zeros(m, 1024, dtype=torch.bfloat16), 1024, op)[1]
            assert plan is not None and "maxnreg" not in plan, (op, m)
    monkeypatch.setitem(fused_linear.GEMV, "reglu", ((8,), 1024, (4,)))
    assert "maxnreg" not in _plan(torch.zeros(1, 1024, dtype=torch.bfloat16), 1024, "reglu")[1]


@pytest.mark.parametrize("budget", [0, 1 << 20])
@pytest.mark.parametrize("t", [1, 2])
def test_gemv_whole_k_tile_and_k_tiles(monkeypatch, budget, t):
    """The CUDA-core path with all of K in one tile (loaded before the PDL wait) and in K tiles
    after it (past GEMV_EARLY_ELEMENTS), both against the unfused ops, K past a table tile."""
    from asynct.ops import fused_linear
    monkeypatch.setattr(fused_linear, "GEMV_EARLY_ELEMENTS", budget)
    gen, dt, k = torch.Generator().manual_seed(t), torch.bfloat16, 1100
    x, res = rand(t, k, gen=gen, dtype=dt), rand(t, 20, gen=gen, dtype=dt)
    for op in fused_linear.GEMV:
        plan = fused_linear._plan(x, k, op)[1]
        assert plan is None or plan["BLOCK_K"] == (2048 if budget else fused_linear.GEMV[op][1]), op
    w, a = rand(20, k, gen=gen, dtype=dt, scale=0.1), torch.rand(20, generator=gen) + 0.2
    for g, r in zip(on_dev(linear_dyht_add_triton, x, w, res, a, a), linear_dyht_add_unfused(x, w, res, a, a)):
        close(g, r, dt)
    w = rand(12, k, gen=gen, dtype=dt, scale=0.1)
    close(on_dev(linear_reglu_triton, x, w), linear_reglu_unfused(x, w), dt)
    w, pos, rope = rand(3 * 16, k, gen=gen, dtype=dt, scale=0.1), torch.arange(t) + 5, rope_cos_sin_cache(16, 64)
    one = torch.ones(1)
    args = (x, w, pos, 1, 1, one, one, one, one, rope)
    for g, r in zip(on_dev(linear_qk_norm_rope_triton, *args), linear_qk_norm_rope_unfused(*args)):
        close(g, r, dt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("t,k,post", [(3, 1024, True), (4, 1024, False), (3, 3072, False), (4, 3000, True)])
def test_gemv_o_proj_and_down_at_three_and_four_rows(monkeypatch, t, k, post, early, dtype):
    """o_proj's and down's K (1,024 with the post-DyHT, 3,072; 3,000 fits no K tile) at three
    and four rows through the CUDA-core path's 4-row kernel, with all of K in one tile before
    the PDL wait and (no budget) in K tiles after it, against the unfused op; an odd column
    count leaves the last program a masked weight row. Every row differs, so a row dropped or
    put in another's place shows."""
    from asynct.ops import fused_linear
    if not early:
        monkeypatch.setattr(fused_linear, "GEMV_EARLY_ELEMENTS", 0)
    gen, n = torch.Generator().manual_seed(t * k), 41
    x = rand(t, k + 3, gen=gen, dtype=dtype)[:, 1:k + 1]       # rows strided as a view's are
    w, res = rand(n, k, gen=gen, dtype=dtype, scale=0.05), rand(t, n, gen=gen, dtype=dtype)
    plan = fused_linear._plan(x, k, "dyht_add")[1]
    assert plan["GEMV"] and plan["BLOCK_M"] == 4 and (plan["BLOCK_K"] >= k) == early
    a, dw = norm_params(n, True, gen)
    pa, pw = norm_params(n, False, gen) if post else (None, None)
    got = on_dev(linear_dyht_add_triton, x, w, res, a, dw, pa, pw)
    for g, r in zip(got, linear_dyht_add_unfused(x, w, res, a, dw, pa, pw)):
        close(g, r, dtype)


def test_dispatch_off_gpu_is_the_reference():
    gen = torch.Generator().manual_seed(0)
    x, w, res = torch.randn(3, 32, generator=gen), torch.randn(48, 32, generator=gen), torch.randn(3, 48)
    a, dw = norm_params(48, True, gen)
    for got, want in zip(linear_dyht_add(x, w, res, a, dw), linear_dyht_add_unfused(x, w, res, a, dw)):
        assert torch.equal(got, want)
    assert torch.equal(linear_reglu(x, w), linear_reglu_unfused(x, w))
    cache, pos = rope_cos_sin_cache(16, 8), torch.arange(3)
    args = (x, w[:48], pos, 1, 1, torch.ones(1), torch.ones(1), torch.ones(1), torch.ones(1), cache)
    for got, want in zip(linear_qk_norm_rope(*args), linear_qk_norm_rope_unfused(*args)):
        assert torch.equal(got, want)


def test_engine_through_the_fused_kernels_matches_the_reference(tiny_ckpt, reference, monkeypatch):
    """The model's plumbing around the fused kernels (views, residual stream, the next layer's
    norm), every step at most SMALL_M tokens so every step takes them (interpreted on CPU), at
    both row tiles: greedy tokens and logprobs equal the reference model's."""
    from asynct import LLM, SamplingParams
    from asynct.ops import fused_linear
    calls = []

    def fast(x, weight, fp32_x=False):
        calls.append(x.shape[0])
        return x.dim() == 2 and 0 < x.shape[0] <= SMALL_M and weight.dtype == x.dtype
    monkeypatch.setattr(fused_linear, "_fast", fast)
    llm = LLM(tiny_ckpt, max_num_batched_tokens=SMALL_M, max_num_seqs=4, enforce_eager=True)
    calls.clear()       # the GPU warm-up also runs a forward past the fused kernels
    prompts = [[5], [7, 99, 3, 41, 250], list(range(30, 53)), [200] * 17]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert calls and max(calls) <= SMALL_M and any(16 < n for n in calls)
    for p, o in zip(prompts, outs):
        full = p + o.outputs[0].token_ids
        with torch.no_grad():
            ref = reference(torch.tensor([full])).logits[0].log_softmax(-1)
        assert full[len(p):] == [int(ref[i].argmax()) for i in range(len(p) - 1, len(full) - 1)]
        for pos in range(1, len(full)):
            entry = o.prompt_logprobs[pos] if pos < len(p) else o.outputs[0].logprobs[pos - len(p)]
            assert abs(entry[full[pos]].logprob - ref[pos - 1, full[pos]].item()) < 1e-4


def test_warm_up_launches_every_fused_linear_variant_a_step_can(monkeypatch):
    """Each kind of launch (kernel, constexprs, warps) that a step of 1 to SMALL_M tokens makes
    (every step stores its keys, a piecewise graph's pieces too) is one the engine's warm-up
    makes (bench-0.6b's layer on an H200's 132 SMs, kernels replaced by recorders): nothing
    compiles in the middle of serving. Three-token steps once took dot tiles no warm-up count
    reached, until the warm-up counted the first count past the GEMV rows. Decode steps of up
    to DECODE_SUMS_MAX_ROWS sequences zero fp32 sums in QKV and feed them to o_proj: the
    warm-up's decode steps."""
    from asynct.attention.triton_backend import DECODE_SUMS_MAX_ROWS
    from asynct.engine.runner_startup import warmup_decode_counts, warmup_token_counts
    from asynct.ops import fused_linear as fl
    seen = set()

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.add((self.name, tuple(sorted(kw.items()))))
    for name in ("qkv_rope_kernel", "gate_up_reglu_kernel", "linear_dyht_add_kernel"):
        monkeypatch.setattr(fl, name, Recorder(name))
    monkeypatch.setattr(fl, "sm_count", lambda x: 132)
    monkeypatch.setattr(fl, "pdl_args", lambda x, wanted=True: dict(PDL=True, launch_pdl=True))
    bf, hq, hkv, d, c, inter = torch.bfloat16, 8, 4, 128, 1024, 3072
    w_qkv, w_o = torch.zeros((hq + 2 * hkv) * d, c, dtype=bf), torch.zeros(c, hq * d, dtype=bf)
    w_gu, w_down = torch.zeros(2 * inter, c, dtype=bf), torch.zeros(c, inter, dtype=bf)
    one, rope = torch.ones(1), rope_cos_sin_cache(d, 64)
    cache = torch.zeros(2, 4, 16, hkv, d, dtype=bf)

    def layer(t, sums=False):
        target = dict(kv_cache=cache, slot_mapping=torch.zeros(t, dtype=torch.long))
        if sums:    # a small decode step's: the decode adds into fp32 sums that QKV zeroes
            target["attn_sums"] = torch.zeros(t, hq, d)
        x = torch.zeros(t, c, dtype=bf)
        linear_qk_norm_rope_triton(x, w_qkv, torch.zeros(t, dtype=torch.long), hq, hkv, one, one, one, one,
                                   rope, **target)
        res = torch.zeros(t, c, dtype=bf)
        linear_dyht_add_triton(torch.zeros(t, hq * d, dtype=torch.float32 if sums else bf), w_o, res, one, one,
                               one, one)
        linear_reglu_triton(x, w_gu)
        linear_dyht_add_triton(torch.zeros(t, inter, dtype=bf), w_down, res, one, one)
    for t in warmup_token_counts():
        if t <= SMALL_M:
            layer(t)
    for t in warmup_decode_counts():
        layer(t, sums=True)
    warm = set(seen)
    for t in range(1, SMALL_M + 1):
        seen.clear()
        layer(t)
        if t <= DECODE_SUMS_MAX_ROWS:
            layer(t, sums=True)
        assert seen <= warm, (t, sorted(seen - warm))
