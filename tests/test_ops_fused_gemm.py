"""The prefill-sized gate/up + ReGLU GEMM (asynct/ops/fused_gemm.py; TMA descriptors, interpreted
on CPU in fp32) against the unfused op, on shapes that are not tile multiples; on a GPU, bf16 at
the dispatch threshold and past it, and linear_reglu's choice of path."""
import pytest
import torch
from test_ops_attention import _interpreter_scalars  # noqa: F401  (autouse: loop bounds, bf16)

from asynct.ops import FUSED_GEMM_MIN_ROWS, fused_gemm, linear_reglu, linear_reglu_unfused
from asynct.ops import fused_linear
from asynct.ops.fused_gemm import gemm_reglu, gemm_reglu_supported

CUDA = torch.cuda.is_available()
SMALL = (32, 16, 32, 4, 2)    # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: small tiles, several a shape


@pytest.mark.parametrize("m,k,i", [(70, 48, 40), (1, 16, 16), (130, 64, 24), (33, 96, 17 + 15)])
def test_gemm_reglu_matches_the_unfused_op(m, k, i):
    gen = torch.Generator().manual_seed(m + k + i)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(2 * i, k, generator=gen) * k ** -0.5
    dev = "cuda" if CUDA else "cpu"
    got = gemm_reglu(x.to(dev), w.to(dev), config=SMALL).cpu()
    want = linear_reglu_unfused(x, w)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert got.abs().max() > 0      # relu(gate) * up of random data is not all zero


def test_gemm_reglu_names_a_weight_that_does_not_fit():
    with pytest.raises(ValueError, match="gate_up weight"):
        gemm_reglu(torch.zeros(4, 32), torch.zeros(8, 16), config=SMALL)


def test_only_16_bit_cuda_operands_take_the_gemm():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not gemm_reglu_supported(torch.zeros(4, 16, dtype=torch.bfloat16), w)     # CPU
    if CUDA:
        cw = w.cuda()
        assert gemm_reglu_supported(torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda"), cw) \
            == (torch.cuda.get_device_capability() >= (9, 0))
        assert not gemm_reglu_supported(torch.zeros(4, 16, device="cuda"), cw.float())   # fp32
        assert not gemm_reglu_supported(torch.zeros(4, 20, dtype=torch.bfloat16, device="cuda")[:, 2:18], cw)


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU")
@pytest.mark.parametrize("m", [FUSED_GEMM_MIN_ROWS - 1, FUSED_GEMM_MIN_ROWS, 2 * FUSED_GEMM_MIN_ROWS + 77])
def test_linear_reglu_takes_the_gemm_from_its_threshold_on_gpu(m, monkeypatch):
    """bench-0.6b's gate/up in bf16: the GEMM from FUSED_GEMM_MIN_ROWS rows, within bf16's
    rounding of the unfused op (the GEMM rounds once, at the end)."""
    calls = []
    monkeypatch.setattr(fused_linear, "gemm_reglu", lambda *a: calls.append(a) or gemm_reglu(*a))
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(2 * 3072, 1024, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.03
    got, want = linear_reglu(x, w), linear_reglu_unfused(x, w)
    assert len(calls) == (m >= FUSED_GEMM_MIN_ROWS)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
    assert fused_gemm.CONFIG[0] < m    # several row tiles, the last one partial
