"""`LLM`: offline batched generation in vLLM's shape."""
import logging
import time
from dataclasses import fields
from functools import partial

from tqdm.auto import tqdm

from asynct.engine.engine_args import EngineArgs
from asynct.engine.generation_config import request_defaults
from asynct.engine.llm_engine import LLMEngine
from asynct.engine.outputs import CompletionOutput, RequestOutput
from asynct.engine.request_failure import FAILED_REQUEST
from asynct.engine.sampling_params import SamplingParams

log = logging.getLogger("asynct")


class LLM:
    """LLM(model=DIR, dtype=..., device=..., block_size=16, max_num_seqs=..., seed=None,
    data_parallel_size=1, ...)

    vLLM's options that asynct shares: `seed` (the random state unseeded requests sample from;
    a request's own seed wins), `tensor_parallel_size` (1; tensor parallelism runs through
    vLLM and asynct's plugin, docs/vllm.md), `trust_remote_code` (accepted, ignored: a checkpoint
    runs no code of its own), `data_parallel_size` (engine processes, one per GPU)."""

    def __init__(self, model: str, **kwargs):
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown LLM options {unknown}; known: {sorted(known - {'model'})}")
        args = EngineArgs(model=str(model), **kwargs)
        self.default_sampling_params = request_defaults(args)
        if args.data_parallel_size != 1:   # engine processes, one per GPU, behind LLMEngine's interface
            from asynct.engine.data_parallel import DataParallelEngine
            self.llm_engine = DataParallelEngine(args)
        else:
            self.llm_engine = LLMEngine(args)
        self._next_id = 0

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what generate uses without SamplingParams (the generation config's values)."""
        return SamplingParams(**self.default_sampling_params)

    def get_tokenizer(self):
        d = self.llm_engine.detokenizer
        return d.tokenizer if d else None

    def generate(self, prompts, sampling_params=None, use_tqdm=True, *, lora_request=None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        _refuse_unapplied(lora_request, priority)
        prompts = _batch(prompts)
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) \
            else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        ids = []
        for prompt, p in zip(prompts, params):
            rid = str(self._next_id)
            self._next_id += 1
            ids.append(rid)
            try:
                self.llm_engine.add_request(rid, _prompt_input(prompt), p or self.get_default_sampling_params())
            except ValueError as e:
                log.warning("request %s failed: %s", rid, e, extra={FAILED_REQUEST: rid})
                results[rid] = _error_output(rid, prompt, str(e))
        try:
            self._run(results, len(prompts), use_tqdm)
        finally:        # a call that raised leaves nothing queued to haunt the next one
            for rid in ids:
                self.llm_engine.abort_request(rid)
        return [results[r] for r in ids]

    def chat(self, messages, sampling_params=None, use_tqdm=True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools=None,
             chat_template_kwargs: dict | None = None, lora_request=None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered with the tokenizer's chat template (or `chat_template`), then generated."""
        from asynct.entrypoints.chat_utils import render_conversations
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages is a list of messages or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        texts = render_conversations(self.get_tokenizer(), conversations, chat_template, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs)
        # the template writes the special tokens it wants (BOS): encoding the text must not add a second
        detok = self.llm_engine.detokenizer
        prompts = [{"prompt_token_ids": detok.encode(t, add_special_tokens=False)} for t in texts]
        outs = self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def _run(self, results, total, use_tqdm):
        engine = self.llm_engine
        # as vLLM's: use_tqdm may be the caller's own bar maker, given tqdm's arguments
        make_bar = use_tqdm if callable(use_tqdm) else partial(tqdm, disable=not use_tqdm)
        bar = make_bar(total=total, desc="Processed prompts")
        bar.update(len(results))        # the requests refused before they ran
        start, prompt, generated = (time.perf_counter(), engine.stats["prompt_tokens"],
                                    engine.stats["generation_tokens"])
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
            # vLLM's postfix: prompt tokens count too (loglikelihood requests are nearly all prompt)
            dt = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"est. speed input: {(engine.stats['prompt_tokens'] - prompt) / dt:.2f} toks/s, "
                                f"output: {(engine.stats['generation_tokens'] - generated) / dt:.2f} toks/s",
                                refresh=False)
        bar.close()


def _refuse_unapplied(lora_request, priority):
    """vLLM's generate arguments that asynct cannot apply, taken at their no-op values (priority 0
    is what vLLM's first-come-first-served scheduler takes too) rather than ignored."""
    if lora_request is not None:
        raise ValueError("lora_request is not supported: asynct runs no LoRA adapters")
    if priority is not None and any(priority):
        raise ValueError(f"priority is not supported: asynct serves requests first come, first served "
                         f"(only 0), got {priority!r:.60}")


def _batch(prompts) -> list:
    """The prompts of one call: a list or tuple of them (vLLM takes any sequence), or one prompt."""
    return list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]


def _prompt_input(prompt):
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]    # a string here would be tokenized as text: say so instead
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids is a list of token ids, got {type(ids).__name__}")
        return list(ids)                    # the engine checks each id
    if isinstance(prompt, dict) and "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"'prompt' is a string (token ids go in 'prompt_token_ids'), "
                             f"got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")


def _error_output(rid, prompt, message) -> RequestOutput:
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    ids = ids if isinstance(ids, list) else []
    text = prompt if isinstance(prompt, str) else None
    return RequestOutput(rid, text, list(ids), None,
                         [CompletionOutput(0, "", [], None, None, "error", message)], True, error=message)
