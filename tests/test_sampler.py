"""The sampler and its filters, on hand-made logits: which tokens each setting can draw; the
penalties, logit_bias and allowed_token_ids against a per-row reference."""
import gc
import math
import weakref

import pytest

import torch

from asynct.engine.sampler import sample
from asynct.engine.sampling_params import SamplingParams
from asynct.engine.sequence import Sequence


def draws(probs: list[float], rows: int = 400, **kw) -> set[int]:
    """The tokens `rows` draws from one distribution give, with these sampling values."""
    logits = torch.tensor([[math.log(p) for p in probs]] * rows)
    params = SamplingParams(temperature=1.0, **kw)
    seqs = [Sequence(i, str(i), 0, [0], params, 16) for i in range(rows)]
    return set(sample(logits, seqs)[0].tolist())


def test_top_p_takes_its_nucleus_after_top_k_and_min_p():
    """As vLLM: top-p is applied to what top-k and min-p leave, renormalised. Over the whole
    distribution, the nucleus was wider (token 1 was drawn though top-k's 0.5 / 0.8 passes 0.6)."""
    assert draws([0.5, 0.3, 0.2]) == {0, 1, 2}
    assert draws([0.5, 0.3, 0.2], top_k=2) == {0, 1}
    assert draws([0.5, 0.3, 0.2], top_k=2, top_p=0.6) == {0}
    # min-p drops token 3 (under 0.2 * 0.5); the rest renormalised puts 0.8 / 0.95 before token 2
    assert draws([0.5, 0.3, 0.15, 0.05], min_p=0.2) == {0, 1, 2}
    assert draws([0.5, 0.3, 0.15, 0.05], min_p=0.2, top_p=0.82) == {0, 1}


def test_top_k_keeps_the_tokens_tied_with_its_kth():
    """As vLLM: top-k keeps every token whose logit equals the k-th largest. Tied tokens past
    rank k were dropped, which ones by the sort's order (bf16 logits tie often): top_k=2 of
    three tokens tied second drew token 0 and one of them."""
    assert draws([0.4, 0.2, 0.2, 0.2], top_k=2) == {0, 1, 2, 3}
    assert draws([0.4, 0.4, 0.2], top_k=1) == {0, 1}
    assert draws([0.4, 0.3, 0.2, 0.1], top_k=2) == {0, 1}


def test_top_p_of_one_keeps_a_long_tail_beside_a_filtered_row():
    """A row with top_p=1 is filtered when another row of the batch is: where the top token's
    probability rounds to 1, the mass before the tail read as 1 >= top_p and dropped it."""
    from asynct.engine.sampler import _filter_threshold
    logits = torch.tensor([[0.0, -20.0, -20.0], [0.0, -1.0, -2.0]])
    seqs = [Sequence(i, str(i), 0, [0], SamplingParams(temperature=1.0, top_p=p), 16) for i, p in enumerate((1.0, 0.5))]
    kept = logits >= _filter_threshold(logits, seqs, torch.ones(2))[:, None]
    assert kept.tolist() == [[True, True, True], [True, False, False]]


def test_top_p_keeps_the_tokens_tied_at_its_edge():
    """The nucleus ends at a logit, and every token tied with it stays (as top-k keeps its
    k-th's ties): a sort's cut kept whichever of the tied tokens it put first."""
    assert draws([0.4, 0.2, 0.2, 0.2], top_p=0.5) == {0, 1, 2, 3}
    assert draws([0.4, 0.3, 0.2, 0.1], top_p=0.5) == {0, 1}


FILTERS = [  # (top_k, top_p, min_p, 1 / temperature) a row; k past the vocabulary: off
    (10**6, 0.9, 0.0, 1.0), (5, 1.0, 0.1, 2.0), (1, 0.5, 0.0, 0.5), (50, 0.95, 0.0, 1.0),
    (10**6, 1.0, 0.05, 1.3), (3, 0.3, 0.2, 0.7), (10**6, 0.01, 0.0, 0.02), (400, 0.999, 0.0, 4.0),
]


def filter_rows(vocab, dtype, dev):
    """Logits of the FILTERS rows, with ties and -inf logits (banned tokens), and their settings."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(len(FILTERS), vocab, generator=g) * 3
    x[1] = (x[1] * 2).round() / 2
    x[5] = (x[5] * 4).round() / 4
    x[2, ::7] = float("-inf")
    k, p, mp, inv = (torch.tensor(c, device=dev) for c in zip(*FILTERS))
    return x.to(dtype).to(dev), inv.float(), k.clamp(max=vocab).int(), p.float(), mp.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab, per_program", [(700, None), (2 * 4096 + 5, 2)])
def test_the_filter_threshold_kernel_equals_its_sorting_reference(dtype, vocab, per_program):
    """The Triton kernel's bisection of the logits' keys (interpreted on a CPU, compiled on a
    GPU) against the sort: the same logits kept (but where rounding moves top-p's edge), over
    rows with ties, -inf logits, every filter alone and together, and rows of several chunks
    (three, two to a program: the last program sums one)."""
    from asynct.ops.sampling_filters import filter_threshold_ref, filter_threshold_triton
    args = filter_rows(vocab, dtype, "cuda" if torch.cuda.is_available() else "cpu")
    x, inv, k, p, mp = args
    want, got = filter_threshold_ref(*args), filter_threshold_triton(*args, per_program=per_program)
    assert ((x >= want[:, None]).sum(-1) < vocab).all()      # every row filters something
    floor = filter_threshold_ref(x, inv, k, torch.ones_like(p), mp)
    for r in torch.nonzero(((x >= got[:, None]) != (x >= want[:, None])).any(-1)).flatten().tolist():
        # a GPU's exp and order of sums may move the nucleus' edge by rounding (and min-p's
        # threshold, never a logit's own value, by a bit): the kernel's threshold must still be
        # a logit whose nucleus holds to 1e-5 of the kept mass
        assert p[r] < 1 and (x[r] == got[r]).any(), (r, got[r], want[r])
        xr = x[r].float()
        w = torch.exp((xr - xr.max()) * inv[r]).masked_fill(xr < floor[r], 0)
        target, at, above = p[r] * w.sum(), w[xr >= got[r]].sum(), w[xr > got[r]].sum()
        assert at >= target * (1 - 1e-5) and above < target * (1 + 1e-5), (r, at / target, above / target)


def test_top_k_starts_from_the_kth_largest_tile_maximum():
    """Top-k's bisection starts at the k-th largest of the chunks' tile maxima: on a row whose only
    large logits are one a tile, that bound is the threshold itself, so a bound one rank too high
    keeps k - 1 tokens. Past the tiles (PARTS a chunk times the chunks), no bound."""
    from asynct.ops.sampling_filters import BLOCK, CHUNK, filter_threshold_ref, filter_threshold_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = 3 * CHUNK
    tiles = vocab // BLOCK
    x = torch.full((4, vocab), -10.0)
    x[:, ::BLOCK] = torch.randperm(tiles, generator=torch.Generator().manual_seed(1)).float()
    x = x.to(dev)
    k = torch.tensor([1, 5, tiles, tiles + 3], dtype=torch.int32, device=dev)
    one = torch.ones(4, device=dev)
    args = (x, one, k, one, one * 0)
    got = filter_threshold_triton(*args)
    kept = (x >= got[:, None]).sum(-1).tolist()
    assert torch.equal(got, filter_threshold_ref(*args)) and kept == [1, 5, tiles, vocab]   # -10's ties


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel's dispatch is CUDA's")
def test_fp32_logits_below_the_kernels_rows_sort(monkeypatch):
    """Penalised (fp32) logits of fewer than FP32_KERNEL_MIN_ROWS rows take the sort: 32-bit keys
    make 18 launches with top-k and top-p, slower at few rows. Model-dtype logits never sort."""
    from asynct.ops import sampling_filters as sf
    launched = []
    ref = sf.filter_threshold_ref
    monkeypatch.setattr(sf, "filter_threshold_triton", lambda *a, **kw: launched.append(a[0].dtype) or ref(*a[:5]))
    for rows, dtype in ((sf.FP32_KERNEL_MIN_ROWS - 1, torch.float32), (sf.FP32_KERNEL_MIN_ROWS, torch.float32),
                        (1, torch.bfloat16)):
        one = torch.ones(rows, device="cuda")
        sf.filter_threshold(torch.randn(rows, 700, device="cuda").to(dtype), one,
                            torch.full((rows,), 5, dtype=torch.int32, device="cuda"), one / 2, one * 0)
    assert launched == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("use_top_k, use_top_p", [(False, True), (True, False), (False, False)])
def test_the_filter_threshold_kernel_skips_a_bisection_no_row_needs(use_top_k, use_top_p):
    """Where no row sets top-k (or top-p) the kernel's launches skip its bisection: the
    thresholds stay the reference's, of rows whose other filters are on."""
    from asynct.ops.sampling_filters import filter_threshold_ref, filter_threshold_triton
    x, inv, k, p, mp = filter_rows(700, torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu")
    k = k if use_top_k else torch.full_like(k, 700)
    p = p if use_top_p else torch.ones_like(p)
    want = filter_threshold_ref(x, inv, k, p, mp)
    got = filter_threshold_triton(x, inv, k, p, mp, use_top_k=use_top_k, use_top_p=use_top_p)
    assert torch.equal(x >= want[:, None], x >= got[:, None])


def test_philox_matches_its_published_answer():
    """Random123's known answer for Philox 4x32-10, zero key and counter (the torch reference
    that CPUs draw with and the kernel is checked against)."""
    from asynct.ops.sampling_draw import philox_ref
    zero = torch.zeros(1, 1, dtype=torch.int64)
    assert [o.item() for o in philox_ref(zero, zero)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [517, 2 * 8192 + 77])
def test_the_draw_kernel_equals_its_reference(dtype, vocab):
    """The Triton draw (interpreted on a CPU, compiled on a GPU) against the torch reference, the
    same Philox noise: greedy rows (first index of the largest, a NaN first), thresholds, keys
    past 2**63 and counters with a high word, rows of one chunk and of three."""
    from asynct.ops.sampling_draw import draw_ref, draw_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g) * 3
    x[1, 3] = x[1, 400] = x[1].max() + 1       # greedy: tied, the first wins
    x[2, 10] = float("nan")
    x[3, ::5] = float("-inf")
    x = x.to(dtype).to(dev)
    inv = torch.tensor([1.0, 0.0, 0.0, 2.0, 0.7, 0.05], device=dev)
    tau = torch.tensor([float("-inf"), 0.0, 0.0, 2.0, 4.0, -1.0], device=dev)
    keys = torch.tensor([[1, 2, -5, 2**62, -2**63, 7], [0, 1 << 32, 7, (3 << 32) + 5, 9, 2**40]], device=dev)
    for threshold in (None, tau):
        want, got = draw_ref(x, inv, threshold, keys), draw_triton(x, inv, threshold, keys)
        assert got.tolist() == want.tolist() and got[1] == 3 and got[2] == 10


def test_draws_follow_the_kept_softmax():
    """Over 40,000 counters the reference's draws (what a CPU samples with) fall on each kept token as
    often as softmax(x / T) over the kept tokens says, and never on a dropped one."""
    from asynct.ops.sampling_draw import draw_ref
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    n = 40_000
    keys = torch.stack([torch.full((n,), 12345), torch.arange(n) << 32])
    got = draw_ref(x.expand(n, -1), torch.full((n,), 1 / 0.8), torch.full((n,), 0.5), keys)
    counts = torch.bincount(got, minlength=6).float() / n
    want = torch.where(x >= 0.5, x / 0.8, float("-inf")).softmax(-1)
    assert counts[3:5].sum() == 0 and (counts - want).abs().max() < 4 * (want * (1 - want) / n).sqrt().max()


# ---- penalties, logit_bias, allowed_token_ids ------------------------------------------------
VOCAB = 517      # not a power of two


def reference_adjust(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM V1's adjustments of one row, token by token."""
    x = logits.float().clone()
    if p.allowed_token_ids:
        keep = x[p.allowed_token_ids].clone()
        x[:] = float("-inf")
        x[p.allowed_token_ids] = keep
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.repetition_penalty != 1:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t)
        x[t] -= p.presence_penalty
    return x


ROWS = [  # (prompt, output, params): greedy and sampled, penalised and not
    ([1, 2, 3, 3], [4, 4, 4, 9], dict(temperature=0)),
    ([1, 2, 3, 3], [4, 4, 4, 9], dict(temperature=0, frequency_penalty=0.75)),
    ([5, 6, 7, 8, 9, 10], [11, 11, 12], dict(temperature=0, repetition_penalty=1.5)),
    ([5, 6, 7, 8, 9, 10], [11, 11, 12], dict(temperature=0.8, seed=3, repetition_penalty=0.5)),
    ([20, 21], [22, 22, 22, 23], dict(temperature=0, presence_penalty=-1.5, frequency_penalty=-0.5)),
    ([20, 21], [22, 22, 22, 23], dict(temperature=1.0, seed=4, presence_penalty=2.0, top_k=40, top_p=0.9)),
    ([30, 31, 32], [33], dict(temperature=0, logit_bias={100: 100.0, 33: -100, 516: 2.5})),
    ([30, 31, 32], [33], dict(temperature=1.0, seed=5, logit_bias={7: -100.0}, min_p=0.05)),
    ([40], [41, 41], dict(temperature=0, allowed_token_ids=[13])),
    ([40], [41, 41], dict(temperature=1.2, seed=6, allowed_token_ids=[13, 500, 41], repetition_penalty=1.25)),
    ([50, 50, 51], [], dict(temperature=0, repetition_penalty=2.0, frequency_penalty=2.0)),
    ([60, 61], [62, 63], dict(temperature=0.7, seed=7)),
    ([70, 71, 72], [73, 74, 73, 75, 73], dict(temperature=0, repetition_penalty=1.25, frequency_penalty=1.0,
                                              presence_penalty=0.5, logit_bias={73: 1.0},
                                              allowed_token_ids=[73, 74, 80])),
]


def make_seqs(rows) -> list[Sequence]:
    seqs = []
    for i, (prompt, output, kw) in enumerate(rows):
        s = Sequence(i, str(i), 0, prompt, SamplingParams(**kw), 16)
        for t in output:
            s.append_token(t)
        seqs.append(s)
    return seqs


def reference(logits: torch.Tensor, rows) -> torch.Tensor:
    return torch.stack([reference_adjust(x, p, o, SamplingParams(**kw)) for x, (p, o, kw) in zip(logits, rows)])


def awkward_logits(rows, seed: int = 0) -> torch.Tensor:
    """Negative and positive logits, the tokens the rows name among the largest (so that the
    adjustments decide what is drawn)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB, generator=g) * 3
    for i, (prompt, output, _) in enumerate(rows):
        for t in {*prompt, *output}:
            logits[i, t] = (1 if t % 2 else -1) * (6 + torch.rand(1, generator=g).item())
    return logits


def test_adjustments_equal_a_per_row_reference():
    from asynct.engine.penalties import adjust_logits
    logits = awkward_logits(ROWS)
    seqs = make_seqs(ROWS)
    got = adjust_logits(logits, seqs)
    assert torch.equal(got, reference(logits, ROWS))
    assert torch.equal(logits, awkward_logits(ROWS))       # the raw logits (for logprobs) are left alone


def test_sampling_draws_from_the_adjusted_logits():
    """Greedy rows take the argmax of the adjusted logits; sampled rows draw what the same seed
    draws from the reference's logits; an allowed token alone is drawn, greedy or not."""
    for seed in range(5):
        logits = awkward_logits(ROWS, seed)
        seqs = make_seqs(ROWS)
        want = reference(logits, ROWS)
        plain = [(p, o, {k: v for k, v in kw.items() if k in ("temperature", "seed", "top_k", "top_p", "min_p")})
                 for p, o, kw in ROWS]
        got, blocked = sample(logits, seqs)
        assert torch.equal(got, sample(want, make_seqs(plain))[0])
        assert got[8] == 13 and got.tolist() != sample(logits, make_seqs(plain))[0].tolist()
        assert not blocked.any()
        assert got[12] in (73, 74, 80)


def test_rows_without_adjustments_keep_their_logits():
    from asynct.engine.penalties import adjust_logits
    logits = awkward_logits([ROWS[0], ROWS[11], ROWS[0]])
    seqs = make_seqs([ROWS[0], ROWS[11], ROWS[0]])
    assert adjust_logits(logits, seqs) is logits
    mixed = make_seqs([ROWS[0], ROWS[1], ROWS[11]])
    out = adjust_logits(logits, mixed)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2]) and not torch.equal(out[1], logits[1])


def test_a_pending_token_on_the_device_is_counted():
    """Async scheduling: a sequence's newest output token may be only in the step before's
    sampled tensor (num_pending_tokens, sample_row); the penalties count it there."""
    from asynct.engine.penalties import adjust_logits
    rows = [ROWS[1], ROWS[0], ROWS[2], ROWS[4], ROWS[11]]
    logits = awkward_logits(rows)
    full = [(p, o + [t], kw) for (p, o, kw), t in zip(rows, (4, 5, 300, 23, 62))]
    seqs = make_seqs(rows)
    prev_sampled = torch.tensor([99, 4, 300, 62, 23, 5])       # the step before's samples
    for s, row in zip(seqs, (1, 5, 2, 4, 3)):
        s.num_pending_tokens, s.sample_row = 1, row
    got = adjust_logits(logits, seqs, prev_sampled)
    assert torch.equal(got, reference(logits, full))
    assert not torch.equal(got, adjust_logits(logits, make_seqs(rows)))     # the pending tokens mattered


class CountingDict(dict):
    reads = 0

    def items(self):
        CountingDict.reads += 1
        return super().items()


class CountingList(list):
    reads = 0

    def __iter__(self):
        CountingList.reads += 1
        return super().__iter__()


def test_a_sequences_bias_and_allowed_tokens_go_to_the_device_once():
    """Each step rebuilt every row's logit_bias and allowed_token_ids as host lists, one entry
    per token: 256 rows of OpenAI's 300-token logit_bias were ~77k Python tuples and two host
    tensors every decode step, more host time than the step's forward on a GPU. They go to the
    device once per sequence; a step's host work is a few numbers per row."""
    from asynct.engine.penalties import adjust_logits
    rows = [([1, 2], [], dict(temperature=0, logit_bias={5: 1.0, 7: -2.0})),
            ([3], [], dict(temperature=0, allowed_token_ids=[5, 9, 11])),
            ([3], [], dict(temperature=0, logit_bias={9: 3.0}, allowed_token_ids=[5, 9]))]
    seqs = make_seqs(rows)
    for s in seqs:
        if s.params.logit_bias:
            s.params.logit_bias = CountingDict(s.params.logit_bias)
        if s.params.allowed_token_ids:
            s.params.allowed_token_ids = CountingList(s.params.allowed_token_ids)
    CountingDict.reads = CountingList.reads = 0
    for step in range(4):
        logits = awkward_logits(rows, step)
        assert torch.equal(adjust_logits(logits, seqs), reference(logits, rows))
        for s in seqs:
            s.append_token(5)
        rows = [(p, o + [5], kw) for p, o, kw in rows]
    assert CountingDict.reads <= 2 and CountingList.reads <= 2


def test_a_steps_new_allowed_tokens_and_biases_go_in_one_copy_each(monkeypatch):
    """A loglikelihood step of lm-eval's forces each request's last token (allowed_token_ids):
    one copy a new row. Now a step's new rows share one copy for their allowed ids and one for
    their biases; later steps send none."""
    import asynct.engine.penalties as penalties
    rows = [([3], [], dict(temperature=0, allowed_token_ids=[5 + k], logit_bias={k: 1.0} if k % 2 else None))
            for k in range(4)]
    seqs = make_seqs(rows)
    sent, real = [], penalties.host_to_device_many
    monkeypatch.setattr(penalties, "host_to_device_many", lambda parts, dev: sent.append(len(parts)) or real(parts, dev))
    for step in range(2):
        logits = awkward_logits(rows, step)
        assert torch.equal(penalties.adjust_logits(logits, seqs), reference(logits, rows))
        # each _flat_index sends its offsets and sizes: 2 parts
        assert sorted(sent) == ([2, 2, 4, 4] if step == 0 else [2, 2]), sent
        sent.clear()


def test_penalty_counts_kept_between_steps_equal_the_reference():
    """The engine keeps each penalised sequence's counts on the device between steps and adds
    only the tokens received since (plus, for one step, the one pending there). Over steps of
    growing outputs, pending tokens, finished sequences whose rows new ones reuse (zeroed, their
    prompt marks replaced) and more sequences than the first rows hold, every step equals the
    per-row reference."""
    from asynct.engine.penalties import adjust_logits
    from asynct.engine.penalty_counts import PenaltyCounts
    from asynct.engine.sequence import SequenceStatus
    counts, g = PenaltyCounts(), torch.Generator().manual_seed(0)
    live = make_seqs(ROWS)
    for step in range(6):
        if step in (2, 4):          # two sequences end; new ones (other prompts) take their rows
            for s in live[1:3]:
                s.status = SequenceStatus.FINISHED
            live = [live[0]] + live[3:] + make_seqs([([90 + step, 91], [92], dict(temperature=0, repetition_penalty=1.5)),
                                                     ([94], [], dict(temperature=0, frequency_penalty=1.0))])
        rows = [(s.token_ids[:s.num_prompt_tokens], s.output_token_ids, vars(s.params)) for s in live]
        pending = {i: int(torch.randint(VOCAB, (1,), generator=g)) for i in range(0, len(live), 3)}
        prev = torch.randint(VOCAB, (len(live),), generator=g)
        for i, tok in pending.items():
            live[i].num_pending_tokens, live[i].sample_row, prev[i] = 1, i, tok
        want = torch.stack([reference_adjust(x, p, o + ([pending[i]] if i in pending else []), live[i].params)
                            for i, (x, (p, o, _)) in enumerate(zip(awkward_logits(rows, step), rows))])
        assert torch.equal(adjust_logits(awkward_logits(rows, step), live, prev, counts), want), step
        for i, s in enumerate(live):      # the step's tokens reach the host
            s.num_pending_tokens = 0
            s.append_token(pending.get(i, (7 * step + i) % VOCAB))
    assert len(counts.owner) > 8          # grown past its first rows


def test_a_penalised_step_sends_only_the_tokens_since_the_step_before(monkeypatch):
    """One upload a step, and its token list holds the new output tokens only: the counts of
    the tokens before are on the device already."""
    import asynct.engine.penalties as penalties
    from asynct.engine.penalty_counts import PenaltyCounts
    sent, real = [], penalties.host_to_device_many
    monkeypatch.setattr(penalties, "host_to_device_many", lambda parts, dev: sent.append(parts) or real(parts, dev))
    counts, seqs = PenaltyCounts(), make_seqs([ROWS[1], ROWS[4], ROWS[2]])
    for step in range(3):
        penalties.adjust_logits(awkward_logits(ROWS[:3], step), seqs, None, counts)
        for s in seqs:
            s.append_token(5)
    assert len(sent) == 3
    assert [len(parts[1][0]) for parts in sent] == [4 + 4 + 3, 3, 3]


def test_penalty_rows_grow_to_the_engines_batch_not_past_it():
    """Rows double up to the engine's max_num_seqs + 1 (every running sequence penalised, and
    the zero row), not past it: doubling made 512 rows (390 MB at a 152k vocabulary) of 257."""
    from asynct.engine.penalties import adjust_logits
    from asynct.engine.penalty_counts import PenaltyCounts
    rows = [ROWS[1]] * 12
    counts = PenaltyCounts(rows_hint=13)
    want = reference(awkward_logits(rows), rows)
    assert torch.equal(adjust_logits(awkward_logits(rows), make_seqs(rows), None, counts), want)
    assert len(counts.owner) == counts.counts.shape[0] == 13



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_adjustments_never_wait_for_the_device():
    """Every adjustment and the min_tokens ban are queued without a host sync: `x[idx] = v`
    (index_put_) synchronised twice a step of allowed_token_ids rows, so the next step could not
    be prepared while this one ran (lm-eval's forced tokens: rolling loglikelihood 1.05x slower).
    The same logits as on the CPU."""
    from asynct.engine.penalties import adjust_logits
    from asynct.engine.sampler import suppress_stops
    # one row without adjustments (the partial path), one whose stop and EOS ids are banned
    rows = [*ROWS, (ROWS[0][0], [], {}), ([40], [41], dict(min_tokens=3, stop_token_ids=[5, 7]))]
    logits, dev = awkward_logits(rows), torch.device("cuda")
    want = suppress_stops(adjust_logits(logits, make_seqs(rows)), make_seqs(rows), [2])
    seqs = make_seqs(rows)
    got = logits.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = suppress_stops(adjust_logits(got, seqs), seqs, [2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), want)


# ---- the sampling kernels' review (kept launches, fp32's range, NaN logits, seeds) ----------
_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_kept_launches_do_not_hold_the_logits_they_were_first_called_with():
    """cached_launch keeps a KernelLaunch per (kernel, grid, key) for the process's life, and a
    KernelLaunch kept its first JIT call's arguments (`first`): each new row count held that
    step's [rows, vocab] logits (and the filter's buffers) for good, unseen by the memory
    profile (152k vocab, fp32, every batch size up to 256: ~20 GB)."""
    from asynct.ops.sampling_draw import draw_triton
    from asynct.ops.sampling_filters import filter_threshold_triton
    x = torch.randn(3, 700, device=_DEV)
    alive = weakref.ref(x)
    one = torch.ones(3, device=_DEV)
    tau = filter_threshold_triton(x, one, torch.full((3,), 5, dtype=torch.int32, device=_DEV), one * 0.9, one * 0)
    draw_triton(x, one, tau, torch.zeros(2, 3, dtype=torch.int64, device=_DEV))
    draw_triton(x, one, tau, torch.zeros(2, 3, dtype=torch.int64, device=_DEV))   # the kept runner's path too
    del x
    gc.collect()
    assert alive() is None


def test_a_top_p_below_float32s_range_keeps_the_top_token():
    """top_p=1e-50 is valid (0 < top_p <= 1) and is 0 in fp32: the bisection's target 0 is met
    by every key, so the threshold became _value(HI), a NaN (interpreter: nothing kept and
    the draw takes token 0; a GPU's fmax drops the NaN: no top-p at all). The reference keeps
    the top token."""
    from asynct.ops.sampling_filters import filter_threshold_ref, filter_threshold_triton
    assert SamplingParams(top_p=1e-50).top_p == 1e-50
    x = torch.tensor([[3.0, 1.0, 2.0, 0.5]], device=_DEV)
    one = torch.ones(1, device=_DEV)
    for dt in (torch.float32, torch.bfloat16):
        args = (x.to(dt), one, torch.tensor([4], dtype=torch.int32, device=_DEV),
                torch.tensor([1e-50], device=_DEV), torch.zeros(1, device=_DEV))
        assert filter_threshold_ref(*args).item() == 3.0
        assert filter_threshold_triton(*args).item() == 3.0


def test_a_huge_temperature_does_not_make_a_row_greedy():
    """1 / temperature under fp32's range (T > ~7e44, valid: only >= 0 and finite are checked)
    is 0 in the inv_temps tensor, which the draw reads as greedy: the row always takes the
    argmax. Before, logits / T were all 0 (uniform draws), as vLLM's."""
    from asynct.engine.sampler import _draw
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0]]).expand(64, -1).contiguous()
    seqs = [Sequence(i, str(i), 0, [0], SamplingParams(temperature=1e300, seed=i), 16) for i in range(64)]
    assert len(set(_draw(logits, seqs).tolist())) > 1


def test_draw_kernel_and_reference_agree_on_a_sampled_row_with_a_nan():
    """The draw's reference (what CPUs sample with) keeps a NaN logit of a sampled row (x < tau is
    False for a NaN) and argmax picks it; the kernel drops it (x >= tau is False)."""
    from asynct.ops.sampling_draw import draw_ref, draw_triton
    x = torch.randn(2, 511, generator=torch.Generator().manual_seed(0), device="cpu").to(_DEV)
    x[:, 100] = float("nan")
    inv = torch.ones(2, device=_DEV)
    keys = torch.tensor([[1, 2], [0, 1 << 32]], device=_DEV)
    for threshold in (None, torch.full((2,), -1.0, device=_DEV)):
        assert draw_triton(x, inv, threshold, keys).tolist() == draw_ref(x, inv, threshold, keys).tolist()


def test_a_kept_launch_holds_no_argument_on_the_compiled_path():
    """The same on a GPU's path (a stand-in JIT that returns a compiled kernel): a cached_launch
    still goes straight to the compiled kernel on its second call, and holds no tensor."""
    from asynct.ops import _triton
    log = []

    class Compiled:
        packed_metadata = ()

        def __getitem__(self, grid):
            return lambda *values: log.append("compiled")

    class Jit:
        arg_names = ["x_ptr", "n", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *args, **kw: log.append("jit") or Compiled()

    fn = Jit()
    buf = torch.zeros(64)
    alive = weakref.ref(buf)
    _triton.cached_launch(fn, (4,))(buf, 7, BLOCK=16)
    _triton.cached_launch(fn, (4,))(torch.zeros(64), 7, BLOCK=16)
    del buf
    gc.collect()
    assert alive() is None
    _triton.cached_launch(fn, (4,))(torch.zeros(64)[1:], 7, BLOCK=16)     # unaligned: the JIT again
    _triton.cached_launch(fn, (4,))(torch.zeros(64)[1:], 7, BLOCK=16)
    _triton._cached_launches.pop((fn, (4,), ()))
    assert log == ["jit", "compiled", "jit", "compiled"]


def toks(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_seeded_tokens_do_not_depend_on_batch_n_preemption_or_async(tiny_ckpt):
    """The counter-based noise: a seeded request's tokens alone, beside
    unseeded ones, as sample 0 of n=3, with and without async scheduling and with a KV cache
    small enough to preempt and recompute."""
    from asynct import LLM
    from tests.test_engine import random_prompts
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    kw = dict(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, top_p=0.9, top_k=40)
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    others = [{"prompt_token_ids": p} for p in random_prompts(6, 3, 40, seed=2)]
    seen = set()
    for settings in (dict(async_scheduling=False), dict(async_scheduling=True),
                     dict(num_kv_blocks=12, block_size=4, async_scheduling=False),
                     dict(num_kv_blocks=12, block_size=4, async_scheduling=True)):
        llm = LLM(tiny_ckpt, device="cpu", **settings)   # the kernels' GPU paths: their own tests above
        alone = toks(llm.generate([prompt], SamplingParams(**kw), use_tqdm=False))[0][0]
        batched = toks(llm.generate([prompt] + others, [SamplingParams(**kw)] + [free] * len(others),
                                    use_tqdm=False))[0][0]
        n3 = toks(llm.generate([prompt], SamplingParams(n=3, **kw), use_tqdm=False))[0]
        assert alone == batched == n3[0] and len({tuple(s) for s in n3}) == 3, settings
        seen.add(tuple(alone))
    assert len(seen) == 1


def test_greedy_rows_beside_sampled_rows_equal_a_greedy_run(tiny_ckpt):
    """Greedy rows in a batch of filtered, sampled rows take the plain argmax."""
    from asynct import LLM
    from tests.test_engine import random_prompts
    llm = LLM(tiny_ckpt, device="cpu")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 3, 30, seed=9)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    hot = SamplingParams(temperature=1.5, top_k=5, top_p=0.8, min_p=0.05, max_tokens=16, ignore_eos=True)
    want = toks(llm.generate(prompts, greedy, use_tqdm=False))
    assert toks(llm.generate(prompts + prompts, [greedy] * 4 + [hot] * 4, use_tqdm=False))[:4] == want
