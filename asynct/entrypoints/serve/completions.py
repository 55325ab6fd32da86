"""/v1/completions: one engine request per prompt; choice index = prompt index * n + sample.
`echo` with `logprobs` returns the prompt's logprobs too, which is how lm-eval's
local-completions scores loglikelihood (max_tokens 1, logprobs 1, echo true)."""
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from asynct.entrypoints.serve.protocol import CompletionRequest
from asynct.entrypoints.serve.responses import (ChunkFrame, EventStream, TextStream, collect, encode, encode_ints,
                                                encode_str, event_stream, finite, prompt_logprobs_json, request_id,
                                                top_k, usage)
from asynct.entrypoints.serve.serving import ApiError, ServingContext


async def create_completion(body: CompletionRequest, request: Request, ctx: ServingContext):
    ctx.check_model(body.model)
    try:
        prompts = body.prompts()
        ctx.check_n(body.n, len(prompts))
        params = body.to_params(ctx.sampling_defaults, ctx.limits.max_logprobs)
    except ValueError as e:
        raise ApiError(400, str(e), param=getattr(e, "param", None)) from None
    truncated = body.truncate_prompt_tokens is not None
    encoded = await ctx.off_loop(lambda: [ctx.encode(p, body.add_special_tokens, truncated=truncated) for p in prompts])
    await ctx.check_bad_words(params, body)
    ids = [ctx.check_prompt(p, params, body) for p in encoded]
    # echo's text is the prompt as it ran: a truncated one decoded
    texts = [p if isinstance(p, str) and len(i) == len(e) else ctx.decode(i, False)
             for p, e, i in zip(prompts, encoded, ids)]
    job = Completion(ctx, body, request_id("cmpl", request), texts, ids)
    handle = ctx.submit(ids, params, stream=body.stream)
    if body.stream:
        return EventStream(job.stream(handle), handle)
    return JSONResponse(job.response(await collect(handle, request)))


class Completion:
    def __init__(self, ctx, body: CompletionRequest, rid, texts, ids):
        self.ctx, self.body, self.id, self.texts, self.ids = ctx, body, rid, texts, ids
        self.drop_generated = body.echo and body.max_tokens == 0
        self.created = int(time.time())
        self.next_offsets = {}     # a streamed choice's text_offset for its next token
        self.frame = ChunkFrame(self._head([]))

    def _head(self, choices) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices}

    def response(self, finals: dict) -> dict:
        choices, generated = [], 0
        for i, out in sorted(finals.items()):
            for c in out.outputs:
                n = 0 if self.drop_generated else len(c.token_ids)
                text = "" if self.drop_generated else c.text
                plp = (out.prompt_logprobs or [None]) if self.body.echo else None
                choice = self._choice(i, c, text, 0, n, plp, prompt_ids=True)
                choice["finish_reason"], choice["stop_reason"] = c.finish_reason, c.stop_reason
                if self.body.prompt_logprobs is not None:     # as vLLM, on each choice
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, self.body.prompt_logprobs)
                choices.append(choice)
                generated += n
        return {**self._head(choices), "usage": usage(sum(map(len, self.ids)), generated)}

    def _choice(self, i, c, text, start, end, plp, offset=None, prompt_ids=False) -> dict:
        """One choice with generated tokens [start, end). `plp` (the prompt's logprobs) is given
        only to the response or first chunk of an echo request: the prompt goes in front.
        `offset`: the text_offset of its first row where an earlier chunk ended (a chunk's text
        lags its tokens while stop strings are held back, so it cannot tell). `prompt_ids`: the
        response or the choice's first chunk, which carry vLLM's prompt_token_ids."""
        echo = self.body.echo and plp is not None
        choice = {"index": i * self.body.n + c.index, "text": (self.texts[i] if echo else "") + text,
                  "logprobs": None, "finish_reason": None}
        if self.body.logprobs is not None:
            rows = self._prompt_rows(i, plp) if echo else []
            rows += [token_row(c.token_ids[k], c.logprobs[k]) for k in range(start, end)]
            # offsets into prompt + completion, summing the rows' token texts as OpenAI's API and
            # vLLM count them (so a BOS row, which the echoed prompt text lacks, shifts them all)
            if offset is None:
                offset = 0 if echo else len(self.texts[i])
            choice["logprobs"] = logprobs_block(rows, offset)
        if self.body.return_token_ids:
            if prompt_ids:
                choice["prompt_token_ids"] = self.ids[i]
            choice["token_ids"] = c.token_ids[start:end]
        return choice

    def _prompt_rows(self, i, plp):
        ids = self.ids[i]
        first = (self.ctx.decode(ids[:1], False), None, None)
        k = self.body.logprobs
        return [first] + [token_row(t, top_k(e, k)) for t, e in zip(ids[1:], plp[1:])]

    def stream(self, handle):
        streams, generated = {}, {}

        def events(latest) -> str:
            return "".join(chunk for i, out in sorted(latest.items()) for c in out.outputs
                           if (chunk := self._chunk(i, out, c, streams, generated)))

        def closing() -> str:
            if not self.body.include_usage:
                return ""
            return self.frame.sse("", usage(sum(map(len, self.ids)), sum(generated.values())))
        return event_stream(handle, events, closing)

    def _chunk(self, i, out, c, streams, generated) -> str | None:
        if not c.token_ids and not c.finished:
            return None        # still prefilling (the echoed prompt waits for its logprobs)
        key = (i, c.index)
        first = key not in streams
        ts = streams.setdefault(key, TextStream())
        d = ts.delta(c)
        if d is None:
            return None
        text, start, end = ("", 0, 0) if self.drop_generated else d
        generated[key] = end
        # as vLLM's continuous usage: this choice's prompt and its tokens so far
        use = usage(len(self.ids[i]), end) if self.body.continuous_usage else None
        plp = (out.prompt_logprobs or [None]) if self.body.echo and first else None
        if plp is None and self.body.logprobs is None:      # nearly every chunk
            return self.frame.sse(self._plain_choice(i, c, text, start, end, first), use)
        choice = self._choice(i, c, text, start, end, plp, self.next_offsets.get(key), first)
        lp = choice["logprobs"]
        if lp and lp["tokens"]:
            self.next_offsets[key] = lp["text_offset"][-1] + len(lp["tokens"][-1] or "")
        choice["finish_reason"] = c.finish_reason
        if c.finished:
            choice["stop_reason"] = c.stop_reason
        return self.frame.sse(encode(choice), use)

    def _plain_choice(self, i, c, text, start, end, first) -> str:
        """The JSON of _chunk's choice where it has no logprobs and no echoed prompt, written
        from a template: the same text as encoding the dict, in a tenth of the time."""
        ids = ""
        if self.body.return_token_ids:
            prompt = f', "prompt_token_ids": {encode_ints(self.ids[i])}' if first else ""
            ids = f'{prompt}, "token_ids": {encode_ints(c.token_ids[start:end])}'
        stop = f', "stop_reason": {encode(c.stop_reason)}' if c.finished else ""
        return (f'{{"index": {i * self.body.n + c.index}, "text": {encode_str(text)}, "logprobs": null, '
                f'"finish_reason": {encode(c.finish_reason) if c.finished else "null"}{ids}{stop}}}')


def token_row(tid, entry):
    lp = entry[tid]
    return lp.decoded_token, finite(lp.logprob), top_dict(entry)


def top_dict(entry) -> dict:
    """token text -> logprob, best first; where two tokens decode alike the better one keeps the
    key, so max(values) is always the top-1 logprob (lm-eval's is_greedy test relies on it)."""
    top = {}
    for lp in sorted(entry.values(), key=lambda x: -x.logprob):
        top.setdefault(lp.decoded_token, finite(lp.logprob))
    return top


def logprobs_block(rows, offset) -> dict:
    tokens, offsets = [], []
    for tok, _, _ in rows:
        offsets.append(offset)
        tokens.append(tok)
        offset += len(tok or "")
    return {"tokens": tokens, "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [r[2] for r in rows], "text_offset": offsets}
