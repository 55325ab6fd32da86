"""lm-eval's loglikelihood requests for `AsyncTLM`: each (context, continuation) scored by one
prefill, all in one run of the engine: a question's choices, side by side, take their shared
context from the prefix cache (the engine shares a prompt's blocks from the step that computes
them on), and `loglikelihood_rolling`'s windows scored the same way.

A window is max_length + 1 tokens, as lm-eval's hf backend scores it: the model reads all but the
last (max_length, up to the whole context), the prompt logprobs score the continuation's tokens
in it, and the last token is the request's one sample, forced by allowed_token_ids (whose
logprob and rank are the raw logits', as vLLM returns them)."""
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from asynct.engine.sampling_params import SamplingParams


class LoglikelihoodMixin:
    """AsyncTLM's loglikelihood methods. They read its llm, max_length, prefix_token_id and
    cache_hook, and run their prompts with its tok_encode and _generate."""

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """requests: ((context, continuation) or None, context_ids, continuation_ids)."""
        keep = self.max_length + 1   # as the hf backend: max_length predictions after 1 context token
        inputs, ctxlens = [], []
        for _, ctx, cont in requests:
            whole = (ctx + cont)[-keep:]
            inputs.append(whole)
            # a continuation longer than max_length: its last max_length tokens (the first has no logits)
            ctxlens.append(max(len(whole) - len(cont), 1))
        outs = self._continuation_logprobs(inputs, ctxlens, disable_tqdm)
        res = []
        for (key, _, _), ids, n_ctx, out in zip(requests, inputs, ctxlens, outs):
            answer = _continuation_logprob(ids, out.prompt_logprobs + out.outputs[0].logprobs, n_ctx)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            res.append(answer)
        return res

    def _continuation_logprobs(self, inputs, ctxlens, disable_tqdm):
        """Each input's RequestOutput: all but its last token as the prompt, with the prompt
        logprobs from its ctxlen on, and the last token as its one sample (=0: the token's own
        logprob and rank, no top-k lists)."""
        params = [SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=ids[-1:], logprobs=0,
                                 prompt_logprobs=0, prompt_logprobs_start=n) for ids, n in zip(inputs, ctxlens)]
        return self._generate([{"prompt_token_ids": ids[:-1]} for ids in inputs], params, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, scores):
            totals[i] += lp
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals


def _continuation_logprob(ids, logprobs, n_ctx) -> tuple[float, bool]:
    """Sum of the continuation tokens' logprobs (`logprobs[p]`: token p's entry); greedy when
    each was the top-ranked token (no token above it)."""
    total, greedy = 0.0, True
    for tok, entry in zip(ids[n_ctx:], logprobs[n_ctx:]):
        lp = entry[tok]
        total += lp.logprob
        greedy = greedy and lp.rank == 1
    return total, greedy
