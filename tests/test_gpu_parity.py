"""bf16 parity on the GPU: over the model shapes of benchmarks/bf16_parity.py, the Triton
backend's worst teacher-forced logprob error against a float64 evaluation of the spec is at
most 1.2x the torch backend's (issue 13). Two seeds a shape: the worst error is a tail
statistic, so a single seed would make a noisy test."""
import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "bf16_parity", Path(__file__).resolve().parent.parent / "benchmarks" / "bf16_parity.py")
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("shape", list(parity.SHAPES))
def test_triton_bf16_error_within_torch_backend(shape):
    worst = parity.run_shape(shape, parity.SHAPES[shape], seeds=2, attribution=False,
                             dtype="bfloat16", device="cuda", smoke=False)
    tri, tor = max(worst["triton"]), max(worst["torch"])
    assert tri <= 1.2 * tor, f"{shape}: Triton {tri:.4f} vs torch {tor:.4f} ({tri / tor:.2f}x)"
