"""lm-evaluation-harness backend `asynct`, shaped like lm-eval's vLLM backend.

Every request type hands its whole workload to the engine in one `generate` call (loglikelihood:
two per chunk of contexts that fits the KV cache), so continuous batching and prefix caching see
all of it at once (lm-eval's `batch_size` is accepted and ignored):

- `generate_until`: one request per context with its own stop strings and sampling params;
- `loglikelihood`: logprobs of context + continuation from a single prefill (the prompt's
  logprobs, then the last token as the one sample, forced), summed over the continuation, with
  `is_greedy` from ranks.
  Only the continuation's logprobs are asked for (`prompt_logprobs_start`), so a context that
  several requests share (a question's choices) comes from the prefix cache after its first
  request: those run first, the rest in a second `generate`;
- `loglikelihood_rolling`: lm-eval's rolling windows, each scored like a loglikelihood request.

Tokenisation matches lm-eval's `hf` backend (`tok_encode`, `_encode_pair`, BOS as the prefix of
an empty context) so both backends score exactly the same token sequences.

The loglikelihood requests are lm_eval_loglikelihood.py's; model_args and gen_kwargs checks,
lm_eval_args.py's.
"""
import logging
import time

from lm_eval import models as _builtin_models  # noqa: F401  (must load before register_model,
# or the registry holds only our model and `--model hf` disappears)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)

from asynct.engine.engine_args import as_flag
from asynct.engine.sampling_params import SamplingParams
from asynct.integrations.lm_eval_args import _SAMPLING_KEYS, _engine_args, _refuse_unsupported
from asynct.integrations.lm_eval_loglikelihood import LoglikelihoodMixin

logger = logging.getLogger(__name__)


@register_model("asynct")
class AsyncTLM(LoglikelihoodMixin, TemplateLM):
    _DEFAULT_MAX_GEN_TOKS = 256
    _DEFAULT_SEED = 1234   # lm-eval's vllm backend's default seed
    latest: "AsyncTLM | None" = None  # the last one made: `asynct eval` reports its timings

    def __init__(self, pretrained: str, batch_size=None, max_gen_toks: int = _DEFAULT_MAX_GEN_TOKS,
                 max_length: int | None = None, prefix_token_id: int | None = None, seed: int | None = _DEFAULT_SEED,
                 max_batch_size: int | None = None, add_bos_token: bool | None = None, **engine_kwargs):
        super().__init__()
        from asynct import LLM
        t0 = time.perf_counter()
        # decode graphs wait for a first generate: loglikelihood tasks never decode. The engine is
        # seeded from model_args, as lm-eval's vllm backend seeds vLLM's: unseeded, sampling drew
        # from whatever torch state the process had (none that --seed set in an engine process)
        # --max_batch_size bounds the engine's batch, as the vllm backend makes it vLLM's max_num_seqs
        if max_batch_size is not None:
            engine_kwargs.setdefault("max_num_seqs", max_batch_size)
        self.add_bos_token = None if add_bos_token is None else as_flag("add_bos_token", add_bos_token)
        self.llm = LLM(str(pretrained), **{"lazy_decode_graphs": True,
                                           **_engine_args({"seed": seed, **engine_kwargs})})
        self.timings = {"load": time.perf_counter() - t0, "engine": 0.0}
        self.prompt_tokens = {"total": 0, "cached": 0}   # the cached ones were not computed
        self.tokenizer = self.llm.get_tokenizer()
        if self.tokenizer is None:
            raise ValueError(f"{pretrained} has no tokenizer files; lm-eval needs text in and out")
        if self.add_bos_token is not None:   # as lm-eval's hf backend, the tokenizer loaded with it
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer.name_or_path, add_bos_token=self.add_bos_token)
        self._max_gen_toks = int(max_gen_toks)
        self._max_length = _lengths(max_length, self.llm.llm_engine.max_model_len)
        self._prefix_token_id = prefix_token_id
        # a stop string that is a special token's text, as its id (_sampling_params)
        self._special_ids = {t.content: i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
                             if t.special}
        self.batch_size = batch_size  # lm-eval reads it; the engine batches by itself
        AsyncTLM.latest = self

    # ---- what lm-eval asks of a model ---------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self._prefix_token_id is not None:
            return self._prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        # as lm-eval's hf backend: special tokens unless add_bos_token says otherwise, and a
        # string that already starts with BOS gets no second one
        bos = self.tokenizer.bos_token
        if add_special_tokens is None:
            starts_with_bos = bool(bos) and string.startswith(bos)
            add_special_tokens = not starts_with_bos and self.add_bos_token is not False
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        import jinja2

        def render(history):
            return self.tokenizer.apply_chat_template(history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            # as lm-eval's hf and vllm backends: a template that takes no system role (a
            # --system_instruction) renders the conversation without it, rather than failing the run
            logger.warning("Failed to apply chat template. removing the system role in chat history.")
            return render([m for m in chat_history if m["role"] != "system"])

    # ---- generate_until -----------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, untils = [], [], []
        for context, gen_kwargs in (r.args for r in requests):
            sp, until, max_gen = self._sampling_params(gen_kwargs, eos)
            ids = self._fit_context(self.tok_encode(context), max_gen)
            prompts.append({"prompt_token_ids": ids})
            params.append(sp)
            untils.append(until)
        outs = self._generate(prompts, params, disable_tqdm)
        res = []
        for r, out, until in zip(requests, outs, untils):
            text = postprocess_generated_text(out.outputs[0].text, until, None)
            self.cache_hook.add_partial("generate_until", r.args, text)
            res.append(text)
        return res

    def _fit_context(self, ids: list[int], max_gen: int) -> list[int]:
        """As lm-eval's backends: the prompt's tail where prompt + generation overflows
        max_length. A generation of max_length tokens or more leaves no room for any context
        (the tail would be the whole prompt, or lose its head): refused before anything runs,
        as lm-eval's hf backend refuses it."""
        if max_gen >= self.max_length:
            raise ValueError(f"max_gen_toks={max_gen} leaves no room for a context: it must be below "
                             f"max_length={self.max_length} (lower max_gen_toks, or raise max_length or "
                             "max_model_len)")
        return ids[-(self.max_length - max_gen):] if len(ids) + max_gen > self.max_length else ids

    def _sampling_params(self, gen_kwargs: dict, eos: str):
        kw = normalize_gen_kwargs(dict(gen_kwargs), default_max_gen_toks=self.max_gen_toks)
        until = handle_stop_sequences(kw.pop("until", None), eos=eos)
        max_gen = int(kw.pop("max_gen_toks"))
        _refuse_unsupported(kw)
        extra = {k: kw[k] for k in _SAMPLING_KEYS if kw.get(k) is not None}
        if not kw.get("do_sample"):
            extra["temperature"] = 0.0
        if extra.get("top_k") == -1:
            extra["top_k"] = 0
        # an empty stop string (a task's [""], or an EOS that decodes to "") is no stop: lm-eval's
        # post-processing skips it, and the engine refuses it, which failed the whole run
        stop = [s for s in until if s]
        # the engine's text leaves special tokens out (as vLLM's), so a stop string that is one
        # (a chat model's "<|im_end|>") never shows in it; hf's backend, decoding them in, stops there
        stop_ids = [self._special_ids[s] for s in stop if s in self._special_ids]
        return SamplingParams(max_tokens=max_gen, stop=stop, stop_token_ids=stop_ids, **extra), until, max_gen

    # ---- the engine -------------------------------------------------------------------------
    def _generate(self, prompts, params, disable_tqdm):
        if not prompts:
            return []
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        self.timings["engine"] += time.perf_counter() - t0
        self.prompt_tokens["total"] += sum(len(p["prompt_token_ids"]) for p in prompts)
        self.prompt_tokens["cached"] += sum(o.num_cached_tokens for o in outs)
        failed = [o.error for o in outs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outs)} engine requests failed; first: {failed[0]}")
        return outs


def _lengths(max_length, max_model_len: int) -> int:
    """max_length: max_model_len unless given, as lm-eval's hf backend takes the model's context.
    A scored window is max_length + 1 tokens, of which the model reads max_length
    (lm_eval_loglikelihood.py); a generation fits prompt + max_gen_toks in max_length."""
    if not max_length:
        return max_model_len
    n = int(max_length)
    if not 1 <= n <= max_model_len:
        raise ValueError(f"max_length={max_length} does not fit max_model_len={max_model_len} (lower "
                         f"max_length, or raise max_model_len)")
    return n
