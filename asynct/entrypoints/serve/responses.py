"""What the completion and chat handlers share on the way out: running a request to the end while
watching for the client to leave (`collect`), the SSE stream that aborts what its client left
(`EventStream`, `TextStream`), and the pieces of OpenAI's and vLLM's bodies (ids, logprobs, usage)."""
import asyncio
import json
import logging
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from asynct.entrypoints.serve.async_engine import EngineError, RequestHandle
from asynct.entrypoints.serve.serving import ApiError, error_body

log = logging.getLogger("asynct.serve")


def request_id(prefix: str, request: Request | None = None) -> str:
    """As vLLM's: the client's X-Request-Id where it sent one (a gateway's trace id), else random.
    The engine's own ids stay apart (AsyncEngine.submit): two requests may send the same."""
    given = request.headers.get("x-request-id") if request is not None else None
    return f"{prefix}-{given or uuid.uuid4().hex}"


async def collect(handle: RequestHandle, request: Request) -> dict:
    """The final output per prompt; aborts if the client leaves first."""
    final = {}

    async def run():
        async for latest in handle.updates():
            final.update(latest)

    task, gone = asyncio.ensure_future(run()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ApiError(499, "client disconnected")
        task.result()
    except EngineError as e:
        raise ApiError(e.status, str(e)) from None
    finally:
        for t in (task, gone):
            t.cancel()
        handle.close()
    return final


class EventStream(StreamingResponse):
    """A streamed response (SSE) that aborts what is unfinished of its request however it ends.
    Its chunks' generator cannot: a client that leaves while the headers are being written has
    the response cancelled before the generator's first step, so no line of it (`finally`
    included) ever runs, and one that leaves while a chunk is being written leaves the generator
    suspended at a `yield` until garbage collection closes it."""

    def __init__(self, chunks, handle: RequestHandle):
        super().__init__(chunks, media_type="text/event-stream")
        self.handle = handle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.close()


async def _disconnected(request: Request):
    # once the body is read, the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def finite(x: float) -> float:
    # JSON has no -inf; OpenAI reports impossible tokens as -9999
    return x if x > -9999.0 else -9999.0


def top_k(entry: dict, k: int) -> dict:
    """A logprobs entry (token id -> Logprob: the token's own first, then the top ranks) cut to
    the token's own and the top k (-1: all), where the engine computed more for another field."""
    return {t: lp for i, (t, lp) in enumerate(entry.items()) if i == 0 or k == -1 or lp.rank <= k}


def prompt_logprobs_json(plp, k: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt position None (the first: nothing scores it) or token
    id (a string, as JSON keys are) -> its logprob, rank and text: the prompt's token and the top k."""
    return plp and [None if e is None else {str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in top_k(e, k).items()}
            for e in plp]


# json.dumps(obj, ensure_ascii=False) builds an encoder a call; this one, built once, writes the
# same text. encode_str is what it writes a str as.
encode = json.JSONEncoder(ensure_ascii=False).encode
encode_str = json.encoder.encode_basestring


def sse(obj) -> str:
    return f"data: {encode(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def encode_ints(ids) -> str:
    """A list of token ids as JSON writes it."""
    return f"[{', '.join(map(str, ids))}]"


class ChunkFrame:
    """A stream's chunks share their id, object, created and model: that part is encoded once.
    `sse(choices)` is what sse() gives for the chunk `head` with those choices (JSON text) and,
    where given, its usage and further `fields`, byte for byte: a streamed token costs no
    whole-chunk encoding."""

    def __init__(self, head: dict):
        text = encode(head)
        assert text.endswith('"choices": []}'), "choices must be head's last key, empty"
        self.prefix = "data: " + text[:-2]

    def sse(self, choices: str, usage: dict | None = None, **fields) -> str:
        if usage is not None:
            fields = {"usage": usage, **fields}
        more = "".join(f", {encode(k)}: {encode(v)}" for k, v in fields.items())
        return f"{self.prefix}{choices}]{more}}}\n\n"


async def event_stream(handle: RequestHandle, events, closing):
    """A streamed request's SSE text, one piece (one write) per update: `events(latest)` is an
    update's events, every choice's at once; `closing()` the events after the last update (usage).
    The last update's events go out with the closing ones and [DONE], in one write."""
    tail = ""
    try:
        async for latest in handle.updates():
            text = events(latest)
            if not handle.pending:         # that was the last
                tail = text
            elif text:
                yield text
        tail += closing()
    except EngineError as e:
        tail += sse(error_body(e.status, str(e)))
    except Exception as e:  # noqa: BLE001  (a bug of ours: the 200 is sent, so the client gets an
        # error event, as vLLM sends, not a dropped connection; EventStream aborts the request)
        log.exception("a streamed response failed")
        tail += sse(error_body(500, f"internal error while streaming: {type(e).__name__}: {e}"))
    yield tail + SSE_DONE


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TextStream:
    """Per choice: what was already sent, so each chunk carries only the new text and tokens.
    The engine holds back a running stream's text that may start a stop string
    (SamplingParams.output_text_buffer_length), so it never reaches the client. The last output's
    text is the engine's whole text (it decodes the output once more at the finish, and leaves
    out a stop token's text). A finished choice is sent once: with n > 1 the request's later
    outputs still carry it."""

    def __init__(self):
        self.text, self.num_tokens = "", 0
        self.finished = False

    def delta(self, out) -> tuple[str, int, int] | None:
        """(new text, first new token, end) or None when nothing new is there to send."""
        if self.finished:
            return None
        self.finished = out.finished
        text = out.text
        start, end = self.num_tokens, len(out.token_ids)
        if end == start and not out.finished and len(text) == len(self.text):
            return None
        new = text[len(self.text):] if text.startswith(self.text) else ""
        self.text, self.num_tokens = self.text + new, end
        return new, start, end
