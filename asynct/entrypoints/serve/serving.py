"""What the completion and chat handlers share on the way in: the served model, tokenising off the
event loop, prompt checks, submitting to the engine, and OpenAI's error bodies. What they share
on the way out (collecting or streaming a request's outputs) is responses.py's."""
import asyncio
import queue
import threading
import time

from asynct.engine.detokenizer import Detokenizer
from asynct.engine.inputs import check_bad_words, check_stop_strings
from asynct.engine.sampling_params import SamplingParams
from asynct.entrypoints.serve.async_engine import AsyncEngine, EngineError, QueueFull, RequestHandle
from asynct.entrypoints.serve.limits import ServerLimits
from asynct.entrypoints.serve.metrics import LatencyStats


class ApiError(Exception):
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code=None, param=None) -> dict:
    kind = ApiError.TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


class WorkersBusy(Exception):
    """Every worker stayed busy with other jobs for the whole timeout."""


class Workers:
    """Daemon threads that tokenise and render chat templates off the event loop. Daemons, so
    that work which never ends cannot keep the process from exiting; started by the first job
    and ended with the app's lifespan (a dropped app's were left idle for good)."""

    def __init__(self, num_threads: int = 4):
        self.num_threads = num_threads
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []

    async def run(self, timeout: float, fn, *args):
        """fn(*args) in a worker. Raises TimeoutError where it runs over `timeout` seconds (the
        worker runs on), and WorkersBusy where it waited that long for a worker: counted from
        enqueueing, a request queued behind another client's slow jobs failed as if its own
        work were too slow. A job whose request gave up waiting (or left) is skipped."""
        if not self.threads:
            self.start()
        loop = asyncio.get_running_loop()
        started, future = loop.create_future(), loop.create_future()
        self.jobs.put((started, future, fn, args))
        try:
            await asyncio.wait_for(started, timeout)     # cancels `started` on a timeout or a cancel
        except TimeoutError:
            raise WorkersBusy from None
        return await asyncio.wait_for(future, timeout)

    def start(self):
        self.threads = [threading.Thread(target=self._work, name=f"asynct-render-{i}", daemon=True)
                        for i in range(self.num_threads)]
        for t in self.threads:
            t.start()

    def stop(self):
        """Each thread ends after the jobs queued before this (a later job starts new ones)."""
        for _ in self.threads:
            self.jobs.put(None)
        self.threads = []

    def _work(self):
        while (job := self.jobs.get()) is not None:
            started, future, fn, args = job
            if started.done() or not _post(started, None, None):   # given up on, or the loop closed
                continue
            try:
                result, error = fn(*args), None
            except Exception as e:
                result, error = None, e
            _post(future, result, error)


def _post(future, result, error) -> bool:
    """Settles `future` on its loop from a worker thread; False where the loop has closed."""
    try:
        future.get_loop().call_soon_threadsafe(_settle, future, result, error)
        return True
    except RuntimeError:
        return False


def _settle(future, result, error):
    if future.done():                 # timed out and cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ServingContext:
    def __init__(self, engine: AsyncEngine, model_dir: str, served_model_name: str | list[str] | None,
                 limits: ServerLimits | None = None, sampling_defaults: dict | None = None):
        self.engine, self.limits = engine, limits or ServerLimits()
        # the generation config's values for the fields a request leaves unset (vLLM's)
        self.sampling_defaults = sampling_defaults or {}
        self.workers = Workers()
        # vLLM's: a request may name any of the served names; responses carry the first
        self.model_names = [served_model_name] if isinstance(served_model_name, str) else \
            list(served_model_name or [model_dir])
        self.model_name, self.model_dir = self.model_names[0], model_dir
        self.aliases = {*self.model_names, model_dir}
        # the front end's own tokenizer: the engine's lives in the engine process
        self.detok = Detokenizer.from_path(engine.args.tokenizer or model_dir)
        self.tokenizer = self.detok.tokenizer if self.detok else None
        self.max_model_len = engine.max_model_len
        self.max_prompt_chars = self.limits.max_prompt_chars or self._prompt_chars_that_fit()
        self.created = int(time.time())
        self.latency = LatencyStats()

    def _prompt_chars_that_fit(self) -> int:
        """No token spells more characters than the vocabulary's longest, so a longer text cannot
        fit in max_model_len tokens: it is refused before the tokenizer spends time on it."""
        longest = max(map(len, self.tokenizer.get_vocab()), default=1) if self.tokenizer else 1
        return longest * self.max_model_len

    def check_n(self, n: int, num_prompts: int = 1):
        if n > self.limits.max_n:
            raise ApiError(400, f"n must be at most {self.limits.max_n} (--max-n), got {n}", param="n")
        # the event loop checks, submits and answers every choice: a million-prompt body held it
        # (and /health) for 20 s before this cap
        if num_prompts * n > self.limits.max_choices:
            raise ApiError(400, f"{num_prompts} prompts x n={n} ask for {num_prompts * n} choices; this server "
                                f"takes at most {self.limits.max_choices} a request (--max-choices)",
                           param="prompt")

    async def off_loop(self, fn, *args):
        """Tokenising and templates take time that depends on the client: never on the event loop."""
        try:
            return await self.workers.run(self.limits.render_timeout, fn, *args)
        except TimeoutError:
            raise ApiError(400, f"tokenising or rendering the chat template took over "
                                f"{self.limits.render_timeout:g} s") from None
        except WorkersBusy:
            raise ApiError(503, f"the server's tokenising threads stayed busy with other requests for "
                                f"{self.limits.render_timeout:g} s; retry later") from None

    def check_model(self, model: str | None):
        if model is not None and model not in self.aliases:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{' or '.join(map(repr, self.model_names))}", code="model_not_found",
                           param="model")

    def need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ApiError(400, f"this model has no tokenizer, so {what} is not possible: "
                                "send prompts as token ids")

    def encode(self, prompt: str | list[int], add_special_tokens: bool, param: str = "prompt",
               truncated: bool = False) -> list[int]:
        """`param`: the request field the text came from (a rendered chat: "messages").
        `truncated`: the request truncates its prompt, so that a longer text may fit (only
        --max-prompt-chars bounds it, as vLLM skips its length check then)."""
        if not isinstance(prompt, str):
            return list(prompt)
        self.need_tokenizer("a text prompt")
        limit = self.limits.max_prompt_chars if truncated else self.max_prompt_chars
        if limit and len(prompt) > limit:
            why = "--max-prompt-chars" if self.limits.max_prompt_chars else \
                f"more cannot fit in max_model_len={self.max_model_len} tokens; --max-prompt-chars"
            raise ApiError(400, f"the prompt has {len(prompt)} characters; this server tokenises at most "
                                f"{limit} ({why})", param=param)
        return self.detok.encode(prompt, add_special_tokens)

    def check_prompt(self, ids: list[int], params: SamplingParams, body) -> list[int]:
        """The engine's own checks, here so that a bad prompt is a 400 before anything queues; a
        sampling value that does not fit the model (top_k past the vocabulary) names its field.
        Returns the prompt as it runs: truncated where the request asks (truncate_prompt_tokens)."""
        ids = self.truncate(ids, body)
        if len(params.stop_list) > self.limits.max_stop_strings:
            raise ApiError(400, f"{len(params.stop_list)} stop strings; this server takes at most "
                                f"{self.limits.max_stop_strings} (--max-stop-strings)", param="stop")
        try:
            self.engine.check_prompt(ids, params)
            # the engine process would refuse them too, but only after a stream's 200 had gone
            check_stop_strings(self.detok, params)
        except ValueError as e:
            raise ApiError(400, str(e), param=body.api_param(getattr(e, "param", "prompt"))) from None
        # the request's own max_tokens, as vLLM checks it (params hold the generation config's cap)
        self._check_fits(len(ids), body.requested_max_tokens, body)
        return ids

    async def check_bad_words(self, params: SamplingParams, body):
        """Tokenises bad_words into params once for all the request's prompts, off the event loop
        (a long list takes the tokenizer seconds), and before a stream's 200."""
        if not params.bad_words:
            return
        try:
            await self.off_loop(check_bad_words, self.detok, params, self.engine.vocab_size)
        except ValueError as e:
            raise ApiError(400, str(e), param=body.api_param(getattr(e, "param", "bad_words"))) from None

    def truncate(self, ids: list[int], body) -> list[int]:
        """As vLLM's server: truncate_prompt_tokens keeps the prompt's last k tokens, where k is
        at most what max_tokens leaves of the context (-1: all of that), else a 400 naming it."""
        k, max_tokens = body.truncate_prompt_tokens, body.requested_max_tokens or 0
        room = self.max_model_len - max_tokens
        if k is None or (k == -1 and room < 1):     # no room at all: _check_fits says why
            return ids
        keep = room if k == -1 else k
        if keep > room:
            raise ApiError(400, f"truncate_prompt_tokens={k} is more than max_model_len ({self.max_model_len}) - "
                                f"{body.api_param('max_tokens')} ({max_tokens}) = {room} prompt tokens; request a "
                                "smaller truncation size", param="truncate_prompt_tokens")
        return ids[-keep:]

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int | None, body):
        """As vLLM's server: the prompt and max_tokens must fit in max_model_len together, or 400.
        The engine would stop at the end of the context, a finish_reason "length" that reads as
        max_tokens reached. As vLLM's, `param` names max_tokens where it alone exceeds the context,
        else "input_tokens" (the prompt is what no longer fits). No max_tokens (chat's default):
        the rest of the context, as vLLM's default, which a whole-context prompt leaves empty."""
        n, limit = num_prompt_tokens, self.max_model_len
        if max_tokens is None and n >= limit:
            raise ApiError(400, f"the prompt has {n} tokens: this model's context of {limit} (max_model_len) "
                                "leaves no room to generate", param="input_tokens")
        if max_tokens is None or n + max_tokens <= limit:
            return
        field = body.api_param("max_tokens")
        if max_tokens > limit:
            raise ApiError(400, f"{field}={max_tokens} is more than this model's whole context of {limit} tokens "
                                "(max_model_len)", param=field)
        raise ApiError(400, f"the prompt has {n} tokens and {field} is {max_tokens}: {n + max_tokens} tokens, past "
                            f"this model's context of {limit} (max_model_len); after this prompt at most "
                            f"{limit - n} tokens can be generated", param="input_tokens")

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self.detok.decode(ids, skip_special_tokens) if self.detok else ""

    def submit(self, prompts: list[list[int]], params: SamplingParams, stream: bool) -> RequestHandle:
        try:
            handle = self.engine.submit(prompts, params, stream)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full") from None
        except ValueError as e:
            raise ApiError(400, str(e), param="n" if params.n > 1 else "prompt") from None
        except EngineError as e:
            raise ApiError(e.status, str(e)) from None
        self.latency.track(handle, stream)
        return handle
