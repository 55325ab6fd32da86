"""The sampler and its filters, on hand-made logits: which tokens each setting can draw."""
import math

import torch

from asynct.engine.sampler import sample
from asynct.engine.sampling_params import SamplingParams
from asynct.engine.sequence import Sequence


def draws(probs: list[float], rows: int = 400, **kw) -> set[int]:
    """The tokens `rows` draws from one distribution give, with these sampling values."""
    logits = torch.tensor([[math.log(p) for p in probs]] * rows)
    params = SamplingParams(temperature=1.0, **kw)
    seqs = [Sequence(i, str(i), 0, [0], params, 16) for i in range(rows)]
    return set(sample(logits, seqs).tolist())


def test_top_p_takes_its_nucleus_after_top_k_and_min_p():
    """As vLLM: top-p is applied to what top-k and min-p leave, renormalised. Over the whole
    distribution, the nucleus was wider (token 1 was drawn though top-k's 0.5 / 0.8 passes 0.6)."""
    assert draws([0.5, 0.3, 0.2]) == {0, 1, 2}
    assert draws([0.5, 0.3, 0.2], top_k=2) == {0, 1}
    assert draws([0.5, 0.3, 0.2], top_k=2, top_p=0.6) == {0}
    # min-p drops token 3 (under 0.2 * 0.5); the rest renormalised puts 0.8 / 0.95 before token 2
    assert draws([0.5, 0.3, 0.15, 0.05], min_p=0.2) == {0, 1, 2}
    assert draws([0.5, 0.3, 0.15, 0.05], min_p=0.2, top_p=0.82) == {0, 1}
