"""/v1/chat/completions: the messages go through the tokenizer's chat template, then the same
engine path as completions. Rendering runs in a worker thread with a time limit (the caller's
`ctx.off_loop`); a template sent in the request is rendered only where the server trusts them."""
import inspect
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from asynct.entrypoints.serve.chat_protocol import ChatCompletionRequest, ChatTemplateFields
from asynct.entrypoints.serve.responses import (ChunkFrame, EventStream, TextStream, collect, encode, encode_ints,
                                                encode_str, event_stream, finite, prompt_logprobs_json, request_id,
                                                usage)
from asynct.entrypoints.serve.serving import ApiError, ServingContext


def render_chat(ctx: ServingContext, body: ChatTemplateFields, add_special_tokens: bool) -> list[int]:
    """`body.messages` rendered as `body` asks (a chat or /tokenize request)."""
    ctx.need_tokenizer("chat")
    kwargs = body.template_kwargs()
    check_template_kwargs(ctx, kwargs)
    if not kwargs.get("chat_template") and not getattr(ctx.tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template, so /v1/chat/completions "
                            "cannot format messages: use /v1/completions with a prompt")
    if body.add_generation_prompt and body.continue_final_message:
        raise ApiError(400, "continue_final_message needs add_generation_prompt: false (the last message is "
                            "continued, no new one begins)", param="continue_final_message")
    try:
        msgs = [m.for_template() for m in body.messages]
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    try:
        # as vLLM: chat_template_kwargs may set the template's `tools` and `documents` too, and win
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools is not None else None
        text = ctx.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                                                 continue_final_message=body.continue_final_message,
                                                 **{"tools": tools, "documents": body.documents, **kwargs})
    except ApiError:
        raise
    except Exception as e:       # template errors (jinja raise_exception, bad roles) are the caller's
        raise ApiError(400, f"the chat template failed on these messages: {e}") from None
    truncated = getattr(body, "truncate_prompt_tokens", None) is not None
    return ctx.encode(text, add_special_tokens, param="messages", truncated=truncated)


def check_template_kwargs(ctx: ServingContext, kwargs: dict):
    """chat_template_kwargs are the template's variables; they may not set apply_chat_template's
    own arguments, and a template of the client's own needs --trust-request-chat-template (a
    template is a program: it can loop for hours)."""
    if "chat_template" in kwargs and not ctx.limits.trust_request_chat_template:
        raise ApiError(400, "this server does not render chat templates sent in requests "
                            "(start it with --trust-request-chat-template to allow them)", param="chat_template")
    reserved = set(inspect.signature(ctx.tokenizer.apply_chat_template).parameters) - {"chat_template", "tools", "documents", "kwargs"}
    clash = sorted(reserved & set(kwargs))
    if clash:
        raise ApiError(400, f"chat_template_kwargs may not set {clash}", param="chat_template_kwargs")


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServingContext):
    ctx.check_model(body.model)
    ctx.check_n(body.n)
    try:
        params = body.to_params(ctx.sampling_defaults, ctx.limits.max_logprobs)
    except ValueError as e:
        raise ApiError(400, str(e), param=getattr(e, "param", None)) from None
    ids = await ctx.off_loop(render_chat, ctx, body, body.add_special_tokens)
    await ctx.check_bad_words(params, body)
    ids = ctx.check_prompt(ids, params, body)
    chat = Chat(ctx, body, request_id("chatcmpl", request), ids)
    handle = ctx.submit([ids], params, stream=body.stream)
    if body.stream:
        return EventStream(chat.stream(handle), handle)
    return JSONResponse(chat.response((await collect(handle, request))[0]))


class Chat:
    def __init__(self, ctx, body: ChatCompletionRequest, rid: str, prompt_ids: list[int]):
        self.ctx, self.body, self.id = ctx, body, rid
        self.prompt_ids, self.num_prompt_tokens = prompt_ids, len(prompt_ids)
        self.echo = body.echoed()
        self.created = int(time.time())
        self.frame = ChunkFrame(self._head("chat.completion.chunk", []))

    def _head(self, obj: str, choices) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.model_name,
                "choices": choices}

    def response(self, out) -> dict:
        choices = [{"index": c.index, "message": {"role": self.body.response_role, "content": self.echo + c.text},
                    "logprobs": self._logprobs(c, 0, len(c.token_ids)), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        n = sum(len(c.token_ids) for c in out.outputs)
        response = {**self._head("chat.completion", choices), "usage": usage(self.num_prompt_tokens, n)}
        if self.body.return_token_ids:     # as vLLM: the prompt's on the response, each choice's own
            response["prompt_token_ids"] = self.prompt_ids
            for choice, c in zip(choices, out.outputs):
                choice["token_ids"] = c.token_ids
        if self.body.prompt_logprobs is not None:     # as vLLM, on the response: one prompt for all choices
            response["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, self.body.prompt_logprobs)
        return response

    def _logprobs(self, c, start, end):
        if not self.body.logprobs:
            return None
        k = self.body.top_logprobs or 0
        return {"content": [chat_token(c.token_ids[i], c.logprobs[i], k) for i in range(start, end)]}

    def stream(self, handle):
        streams, generated = {}, {}

        def events(latest) -> str:
            return "".join(chunk for c in latest[0].outputs if (chunk := self._chunk(c, streams, generated)))

        def closing() -> str:
            if not self.body.include_usage:
                return ""
            return self.frame.sse("", usage(self.num_prompt_tokens, sum(generated.values())))
        return event_stream(handle, events, closing)

    def _chunk(self, c, streams, generated) -> str | None:
        if c.index not in streams:     # OpenAI opens every choice with the role alone
            streams[c.index] = TextStream()
            first = {"index": c.index, "delta": {"role": self.body.response_role, "content": ""}, "logprobs": None,
                     "finish_reason": None}
            # as vLLM's return_token_ids: the prompt's ids with each choice's role
            ids = {"prompt_token_ids": self.prompt_ids} if self.body.return_token_ids else {}
            head = self._sse_chunk(encode(first), c.index, generated, **ids)
            if self.echo:
                head += self._sse_chunk(encode({**first, "delta": {"content": self.echo}}), c.index, generated)
        else:
            head = ""
        d = streams[c.index].delta(c)
        if d is None:
            return head or None
        text, start, end = d
        generated[c.index] = end
        if not self.body.logprobs:     # nearly every chunk
            return head + self._sse_chunk(self._plain_choice(c, text, start, end), c.index, generated)
        choice = {"index": c.index, "delta": {"content": text} if text or not c.finished else {},
                  "logprobs": self._logprobs(c, start, end), "finish_reason": c.finish_reason}
        if c.finished:
            choice["stop_reason"] = c.stop_reason
        if self.body.return_token_ids:
            choice["token_ids"] = c.token_ids[start:end]
        return head + self._sse_chunk(encode(choice), c.index, generated)

    def _plain_choice(self, c, text, start, end) -> str:
        """The JSON of _chunk's choice where it has no logprobs, written from a template: the
        same text as encoding the dict, in a tenth of the time."""
        delta = f'{{"content": {encode_str(text)}}}' if text or not c.finished else "{}"
        stop = f', "stop_reason": {encode(c.stop_reason)}' if c.finished else ""
        ids = f', "token_ids": {encode_ints(c.token_ids[start:end])}' if self.body.return_token_ids else ""
        return (f'{{"index": {c.index}, "delta": {delta}, "logprobs": null, '
                f'"finish_reason": {encode(c.finish_reason) if c.finished else "null"}{stop}{ids}}}')

    def _sse_chunk(self, choice: str, index: int, generated, **fields) -> str:
        # as vLLM's continuous usage: the prompt's tokens and this choice's so far
        use = usage(self.num_prompt_tokens, generated.get(index, 0)) if self.body.continuous_usage else None
        return self.frame.sse(choice, use, **fields)


def chat_token(tid, entry, k) -> dict:
    def one(lp):
        tok = lp.decoded_token or ""
        return {"token": tok, "logprob": finite(lp.logprob), "bytes": list(tok.encode("utf-8", "replace"))}
    best = sorted(entry.values(), key=lambda x: -x.logprob)[:None if k == -1 else k]     # -1: every token
    return {**one(entry[tid]), "top_logprobs": [one(lp) for lp in best]}
