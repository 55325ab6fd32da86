"""Prompt logprobs are computed in slices of at most max_num_seqs rows: a prefill step scores up
to max_num_batched_tokens positions (lm-eval's loglikelihood_rolling), whose [rows, vocab] logits
at once the start-up memory profile does not hold. The slices give what one pass gave."""
import weakref

import torch

from asynct import LLM, SamplingParams

PROMPT = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(5)).tolist()
SCORED = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
SAMPLED = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)


def generate(llm, monkeypatch):
    """Outputs of a 30-token scored prompt beside a sampling one; per compute_logits call its
    rows and how many logits of earlier calls were still alive; the sequences of each step."""
    runner, calls, steps, made = llm.llm_engine.runner, [], [], []
    logits, launch = runner.model.compute_logits, runner.launch

    def spy(hidden):
        calls.append((hidden.shape[0], sum(r() is not None for r in made)))
        made.append(weakref.ref(out := logits(hidden)))
        return out
    monkeypatch.setattr(runner.model, "compute_logits", spy)
    monkeypatch.setattr(runner, "launch", lambda batch: steps.append(len(batch.seqs)) or launch(batch))
    outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [7, 8, 9]}],
                        [SCORED, SAMPLED], use_tqdm=False)
    return outs, calls, steps


def assert_same_entries(got, want):
    """The same ids in the same order with the same ranks. The logprobs to float rounding: on
    the CPU, MKL's fp32 GEMM rounds rows of a product of under ~4 rows (gemv, tail kernels) a
    ulp apart from the same rows in a bigger one; on an H200 (bf16, cuBLAS) slices of 1 to 300
    rows of an 8192-row product were equal bit for bit."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        assert list(g or ()) == list(w or ())
        for t in w or ():
            assert g[t].rank == w[t].rank and g[t].decoded_token == w[t].decoded_token
            assert abs(g[t].logprob - w[t].logprob) <= 1e-5, (t, g[t], w[t])


def test_sliced_prompt_logprobs_equal_one_pass(tiny_ckpt, monkeypatch):
    """max_num_seqs=4: the scored prompt's 29 rows take 8 slices, in the step where the other
    request samples; its prompt logprobs and both outputs are those of an engine that slices
    nothing."""
    sliced, calls, steps = generate(LLM(tiny_ckpt, device="cpu", max_num_seqs=4, num_kv_blocks=64), monkeypatch)
    assert steps[0] == 2 and len(calls) > 8
    whole, whole_calls, _ = generate(LLM(tiny_ckpt, device="cpu", max_num_seqs=64, num_kv_blocks=64), monkeypatch)
    assert max(n for n, _ in whole_calls) >= len(PROMPT) - 1
    assert_same_entries(sliced[0].prompt_logprobs, whole[0].prompt_logprobs)
    assert sliced[0].prompt_logprobs[0] is None and len(sliced[0].prompt_logprobs) == len(PROMPT)
    for s, w in zip(sliced, whole):
        assert s.outputs[0].token_ids == w.outputs[0].token_ids
        assert s.outputs[0].logprobs == w.outputs[0].logprobs


def test_no_call_computes_more_logits_rows_than_max_num_seqs(tiny_ckpt, monkeypatch):
    """The start-up profile holds max_num_seqs full-vocabulary rows with logprobs
    (sampling_profile); a prompt-logprob step computed all of its rows at once. Nor do the
    sampling rows' logits or an earlier slice's live on while a slice's are computed."""
    _, calls, _ = generate(LLM(tiny_ckpt, device="cpu", max_num_seqs=4, num_kv_blocks=64), monkeypatch)
    assert max(n for n, _ in calls) <= 4 and len(calls) > 8, calls
    assert all(alive == 0 for _, alive in calls), calls
