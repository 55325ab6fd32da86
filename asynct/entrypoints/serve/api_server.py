"""The FastAPI app: routes, OpenAI-style errors, API key and body-size guards, and `serve`."""
import asyncio
import contextlib
import logging
import secrets
import time
import uuid
import weakref
from collections import Counter

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from asynct.engine.startup_heap import freeze_startup_heap
from asynct.entrypoints.serve.async_engine import SHUTTING_DOWN, AsyncEngine
from asynct.entrypoints.serve.chat import create_chat_completion, render_chat
from asynct.entrypoints.serve.completions import create_completion
from asynct.entrypoints.serve.metrics import ThroughputLogger, render_metrics, summary_line
from asynct.entrypoints.serve.chat_protocol import ChatCompletionRequest, TokenizeRequest
from asynct.entrypoints.serve.protocol import CompletionRequest, DetokenizeRequest
from asynct.entrypoints.serve.limits import ServerLimits
from asynct.entrypoints.serve.serving import ApiError, ServingContext, error_body

log = logging.getLogger("asynct.serve")
PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")   # /health, /version, /metrics stay open


def build_app(ctx: ServingContext, api_key: str | None = None, max_body_bytes: int = 16 << 20,
              log_stats_interval: float | None = 10.0, cors: dict | None = None,
              request_id_headers: bool = False) -> FastAPI:
    """`cors`: CORSMiddleware's options (None: no CORS headers). `request_id_headers`: vLLM's
    --enable-request-id-headers (RequestIdHeader)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        import asyncio
        ctx.engine.start(asyncio.get_running_loop())
        stats = asyncio.create_task(ThroughputLogger(ctx.engine, log_stats_interval).run()) \
            if log_stats_interval else None
        yield
        if stats:
            stats.cancel()
        ctx.engine.stop()
        ctx.workers.stop()

    app = FastAPI(title="asynct", lifespan=lifespan)
    app.state.ctx, app.state.http_counts, app.state.limits = ctx, Counter(), ctx.limits
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, counts=app.state.http_counts)
    if cors:    # outside the Guard: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, **cors)
    if request_id_headers:    # outermost: on every response, CORS's preflight answers too (as vLLM's)
        app.add_middleware(RequestIdHeader)
    add_error_handlers(app)
    add_routes(app, ctx)
    return app


def add_routes(app: FastAPI, ctx: ServingContext):
    # FastAPI keeps every endpoint in module-level caches (fastapi.dependencies.models): endpoints
    # that held the context kept a dropped app's engine alive, and the heap frozen
    ctx, counts = weakref.proxy(ctx), app.state.http_counts

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(body, request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(body, request, ctx)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(ctx, name) for name in ctx.model_names]}

    @app.get("/version")
    async def version():     # vLLM's: an operator's check of what runs
        from asynct import __version__
        return {"version": __version__}

    @app.get("/health")
    async def health():
        if not ctx.engine.is_alive:
            raise ApiError(503, ctx.engine.dead or "the engine process is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(ctx.engine, ctx.model_name, counts, ctx.latency),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        ctx.need_tokenizer("/tokenize")
        if body.messages is not None and body.prompt is not None:
            raise ApiError(400, "give prompt or messages, not both", param="messages")
        if body.messages is not None:
            ids = await ctx.off_loop(render_chat, ctx, body, body.special_tokens)
        elif body.prompt is not None:
            ids = await ctx.off_loop(ctx.encode, body.prompt, body.special_tokens)
        else:
            raise ApiError(400, "give prompt or messages")
        out = {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}
        if body.return_token_strs:       # vLLM's: each token as the vocabulary spells it
            out["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        ctx.need_tokenizer("/detokenize")
        vocab = ctx.engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        ctx.need_tokenizer("/tokenizer_info")
        t = ctx.tokenizer
        return {"tokenizer_class": type(t).__name__, "eos_token": t.eos_token, "bos_token": t.bos_token,
                "pad_token": t.pad_token, "chat_template": getattr(t, "chat_template", None),
                "model_max_length": ctx.max_model_len}


def model_card(ctx: ServingContext, name: str) -> dict:
    """vLLM's card: `root` is the checkpoint served, `permission` what a client may do with it."""
    permission = {"id": f"modelperm-{name}", "object": "model_permission", "created": ctx.created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "asynct", "root": ctx.model_dir,
            "parent": None, "max_model_len": ctx.max_model_len, "permission": [permission]}


def add_error_handlers(app: FastAPI):
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        # OpenAI answers 400 for a body it cannot use, malformed JSON included
        errs = e.errors()
        param = None
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media and media != "application/json":
            # FastAPI reads such a body as bytes, and said it was no object (curl -d sends a form type)
            msg = f"Unsupported Media Type: Only 'application/json' is allowed (Content-Type: {media})"
        elif any(err.get("type") == "json_invalid" for err in errs):
            # its loc holds the character offset of the parse error, which no field is called
            msg = "malformed JSON body: " + "; ".join(str(err.get("ctx", {}).get("error", err["msg"])) for err in errs)
        else:
            msg = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:]) or 'body'}: {err['msg']}" for err in errs)
            # as OpenAI: `param` names the first bad field ("max_tokens" for "max_tokens": "many")
            loc = errs[0].get("loc", ()) if errs else ()
            param = str(loc[1]) if len(loc) > 1 and loc[0] == "body" else None
        return JSONResponse(error_body(400, msg, param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        detail = str(e.detail)
        if isinstance(e.__cause__, RecursionError):     # FastAPI's parse of the body gave up: say why
            detail = "malformed JSON body: it nests deeper than the parser's recursion limit"
        return JSONResponse(error_body(e.status_code, detail), status_code=e.status_code,
                            headers=getattr(e, "headers", None))



class RequestIdHeader:
    """Pure ASGI: every response carries X-Request-Id, the client's own where it sent one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # the first one sent, as Request.headers.get gives the completion's id (dict() kept the last)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = given or uuid.uuid4().hex.encode()

        async def tagged(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid)]}
            await send(msg)
        await self.app(scope, receive, tagged)


class Guard:
    """Pure ASGI (so streaming is untouched): API key, body-size limit, response counts, and the
    500 for an unhandled error (here rather than in Starlette's outermost handler, so that it is
    counted and the connection stays open)."""

    def __init__(self, app, api_key, max_body_bytes, counts):
        self.app, self.api_key, self.max_body_bytes, self.counts = app, api_key, max_body_bytes, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        async def counted_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                self.counts[msg["status"]] += 1
            await send(msg)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem = self._check(scope["path"], headers)
        if problem:
            return await JSONResponse(error_body(*problem), status_code=problem[0],
                                      headers={"WWW-Authenticate": "Bearer"} if problem[0] == 401 else None)(
                scope, receive, counted_send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.max_body_bytes:    # chunked bodies carry no length up front
                raise HTTPException(413, f"the request body exceeds {self.max_body_bytes} bytes")
            return msg

        try:
            await self.app(scope, limited_receive, counted_send)
        except Exception as e:
            log.exception("unhandled error in %s", scope["path"])
            if started:           # mid-response: all that is left is to drop the connection
                raise
            await JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)(
                scope, receive, counted_send)

    def _check(self, path: str, headers: dict):
        if self.api_key and path.startswith(PROTECTED):
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                return 401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return 413, f"the request body ({length} bytes) exceeds {self.max_body_bytes} bytes", "body_too_large"
        return None


class Server(uvicorn.Server):
    """uvicorn's, but at shutdown (SIGTERM, Ctrl-C) the requests still running when the graceful
    timeout is up end with a 503, a stream's as its last event: uvicorn cancelled them, cutting
    each stream off mid-way, with a CancelledError traceback in the log. New requests get the 503
    from the start."""

    async def shutdown(self, sockets=None):
        engine = self.config.app.state.ctx.engine
        engine.stopping = SHUTTING_DOWN
        deadline = time.monotonic() + self.config.timeout_graceful_shutdown
        while engine.num_in_flight and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        engine.fail_all()
        await super().shutdown(sockets)


def make_app(model: str, served_model_name: str | list[str] | None = None, api_key: str | None = None,
             max_queued_requests: int | None = None, max_body_bytes: int = 16 << 20, make_engine=None,
             limits: ServerLimits | None = None, log_stats_interval: float | None = 10.0,
             chat_template: str | None = None, cors: dict | None = None, request_id_headers: bool = False,
             **engine_kwargs) -> FastAPI:
    """Starts the engine process and waits for its model (the slow part), then builds the app.
    `make_engine(EngineArgs) -> LLMEngine` runs in that process (tests wrap the engine with it).
    `log_stats_interval`: seconds between throughput log lines (None: none). `chat_template`: a
    Jinja template or a file holding one, in place of the tokenizer's. `cors`,
    `request_id_headers`: build_app's."""
    import time

    from asynct.engine.engine_args import EngineArgs
    from asynct.engine.generation_config import request_defaults
    from asynct.engine.llm_engine import LLMEngine
    from asynct.entrypoints.chat_utils import load_chat_template
    from asynct.engine.detokenizer import Detokenizer
    template, args = load_chat_template(chat_template), EngineArgs(model=str(model), **engine_kwargs)
    if template is not None and Detokenizer.from_path(args.tokenizer or args.model) is None:
        raise ValueError("--chat-template needs a tokenizer; this checkpoint has none")
    defaults = request_defaults(args)
    t0 = time.perf_counter()
    engine = AsyncEngine(args, max_queued_requests, make_engine or LLMEngine)
    ctx = ServingContext(engine, str(model), served_model_name, limits, defaults)
    if template is not None:
        ctx.tokenizer.chat_template = template
    if engine.summary:
        log.info(summary_line(ctx.model_name, str(model), engine.summary, time.perf_counter() - t0))
    # this process's heap too (torch, transformers, FastAPI: a full collection stalled every stream),
    # but not the app's ~4,000 objects: FastAPI's cycles among them hold the engine, and frozen
    # they were never collected once the app was dropped, nor the engine, nor the heap unfrozen
    freeze_startup_heap(engine)
    return build_app(ctx, api_key, max_body_bytes, log_stats_interval, cors, request_id_headers)
