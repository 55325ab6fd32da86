"""Greedy sampling's argmax kernel (interpreted on CPU, native on a GPU) against torch.argmax:
ties across and within chunks, NaN, infinities, all -inf rows, a vocabulary that ends inside
a chunk, bf16 and fp32 logits."""
import pytest
import torch
from test_ops_attention import _interpreter_scalars  # noqa: F401  (autouse: loop bounds, bf16)

from asynct.ops.argmax import CHUNK, argmax, argmax_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def second(v):
    return min(CHUNK + 5, v // 2)


def awkward_logits(v, dtype):
    g = torch.Generator().manual_seed(v)
    x = (torch.randn(7, v, generator=g) * 3).to(dtype)
    x[0, [5, v - 1]] = 50.0                           # a tie across chunks: the first wins
    x[1, [v - 3, second(v)]] = 40.0                    # the earliest, past the first chunk if there is one
    x[2, [1, 7]] = float("nan")                       # NaN beats everything, its first index
    x[2, 0] = float("inf")
    x[3] = float("-inf")                              # nothing but -inf: index 0
    x[4, [v - 1]] = float("inf")                      # the last column, inside the last chunk
    x[5, :] = 1.0                                     # all equal
    x[6, [v - 2, 2]] = float("nan")
    return x


@pytest.mark.parametrize("v", [300, 2 * CHUNK + 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_kernel_matches_torch(v, dtype):
    x = awkward_logits(v, dtype)
    want = x.argmax(-1)
    assert want.tolist() == [5, second(v), 1, 0, v - 1, 0, 2]
    got = argmax_triton(x.to(DEV)).cpu()
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(argmax_triton(x[1:2].to(DEV)).cpu(), want[1:2])   # one row
    assert argmax_triton(x[:0].to(DEV)).shape == (0,)


def test_argmax_dispatch_takes_torch_off_cuda_and_for_huge_vocabularies():
    x = awkward_logits(300, torch.float32)
    assert torch.equal(argmax(x), x.argmax(-1))
    if DEV == "cuda":
        big = torch.randn(2, 64 * CHUNK + 1, device=DEV)     # more chunks than the second stage loads
        assert torch.equal(argmax(big), big.argmax(-1))
