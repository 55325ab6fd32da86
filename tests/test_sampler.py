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


def test_top_p_of_one_keeps_a_long_tail_beside_a_filtered_row():
    """A row with top_p=1 is filtered when another row of the batch is: where the top token's
    probability rounds to 1, the mass before the tail read as 1 >= top_p and dropped it."""
    from asynct.engine.sampler import _filter_top_k_top_p_min_p
    logits = torch.tensor([[0.0, -20.0, -20.0], [0.0, -1.0, -2.0]])
    seqs = [Sequence(i, str(i), 0, [0], SamplingParams(temperature=1.0, top_p=p), 16) for i, p in enumerate((1.0, 0.5))]
    out = _filter_top_k_top_p_min_p(logits, seqs)
    assert torch.equal(out[0], logits[0])
    assert out[1].isinf().tolist() == [False, True, True]
