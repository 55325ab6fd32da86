"""The front end's handle on the engine process. Handlers only touch `routes` and their own queue,
on the event loop; a sender thread batches adds and aborts into the core's inbox, and a receiver
thread hands each message from the core to the loop in one `call_soon_threadsafe`."""
import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections import deque

from asynct.engine.llm_engine import EngineArgs, LLMEngine, check_prompt
from asynct.engine.outputs import RequestOutput
from asynct.engine.sampling_params import SamplingParams
from asynct.entrypoints.serve.engine_core import apply_delta, run_engine_core

log = logging.getLogger("asynct.serve")


class EngineError(Exception):
    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class QueueFull(Exception):
    pass


class RequestHandle:
    """One HTTP request's engine requests (one per prompt), read through a shared queue."""

    def __init__(self, engine: "AsyncEngine", rids: list[str]):
        self.engine, self.rids = engine, rids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending = set(range(len(rids)))

    async def updates(self):
        """Yields {prompt index: latest RequestOutput}. Outputs are cumulative, so several that
        queued up while the client was slow collapse into the newest one."""
        while self.pending:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            latest = {}
            for idx, out in items:
                if isinstance(out, EngineError):
                    raise out
                latest[idx] = out
                if out.finished:
                    self.pending.discard(idx)
            yield latest

    def close(self):
        """Aborts whatever is unfinished (client gone or request done early); idempotent."""
        live = [self.rids[i] for i in self.pending]
        self.pending = set()
        if live:
            self.engine.abort(live)


class AsyncEngine:
    def __init__(self, args: EngineArgs, max_queued_requests: int | None = None, make_engine=LLMEngine):
        """Starts the engine process and waits until it has loaded the model; raises ValueError
        with the engine's own message when it cannot (a bad checkpoint or option, mostly)."""
        self.args, self.max_queued_requests = args, max_queued_requests
        ctx = mp.get_context("spawn")        # CUDA cannot live through a fork
        core_inbox, self.inbox = ctx.Pipe(duplex=False)
        self.outbox, core_outbox = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_engine_core, args=(args, make_engine, core_inbox, core_outbox),
                                name="asynct-engine-core", daemon=True)
        self.proc.start()
        core_inbox.close()
        core_outbox.close()              # so that the core's exit reads as EOF here
        info = self._wait_ready()
        self.max_model_len, self.vocab_size = info["max_model_len"], info["vocab_size"]
        self.summary = info.get("summary", {})     # the engine's build, for the start-up log line
        self.routes: dict[str, tuple[RequestHandle, int, RequestOutput]] = {}   # loop thread only
        self.sendq: queue.SimpleQueue = queue.SimpleQueue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.threads: list[threading.Thread] = []
        self.ids = itertools.count()
        self.num_aborted, self.dead = 0, None
        self.rate_samples: deque = deque(maxlen=256)   # (time, generation tokens) for tokens/s
        self.snapshot = info["snapshot"]

    def _wait_ready(self) -> dict:
        while not self.outbox.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {self.proc.exitcode} while loading")
        kind, info = self.outbox.recv()
        if kind == "failed":
            self.proc.join(timeout=10)
            raise ValueError(f"the engine could not start: {info}")
        return info

    # ---- lifetime ----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.threads = [threading.Thread(target=fn, name=name, daemon=True)
                        for fn, name in ((self._send_loop, "asynct-send"), (self._receive_loop, "asynct-receive"))]
        for t in self.threads:
            t.start()

    def stop(self):
        self.dead = self.dead or "the server is shutting down"
        self._fail(list(self.routes), self.dead, 503)
        self.sendq.put(("stop",))
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
        for t in self.threads:
            t.join(timeout=5)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self.proc.is_alive() and all(t.is_alive() for t in self.threads)

    # ---- loop side ---------------------------------------------------------------------------
    def check_prompt(self, ids: list[int], params: SamplingParams):
        check_prompt(ids, params, self.vocab_size, self.max_model_len)

    def submit(self, prompts: list[list[int]], params: SamplingParams, stream: bool) -> RequestHandle:
        """Queues one engine request per prompt; raises QueueFull past the queue limit: requests
        beyond the batch's max_num_seqs count as queued (counted here, not sampled from the engine,
        so the limit is exact)."""
        if self.dead:
            raise EngineError(self.dead, 503)
        if self.max_queued_requests is not None:
            cap = self.args.max_num_seqs + self.max_queued_requests
            if len(self.routes) + len(prompts) > cap:
                queued = max(0, len(self.routes) - self.args.max_num_seqs)
                raise QueueFull(f"{queued} requests are queued (limit {self.max_queued_requests}); retry later")
        base = f"req-{next(self.ids)}"
        handle = RequestHandle(self, [f"{base}-{i}" for i in range(len(prompts))])
        for i, (rid, ids) in enumerate(zip(handle.rids, prompts)):
            self.routes[rid] = (handle, i, RequestOutput(rid, None, ids, None, [], False))
            self.sendq.put(("add", (rid, ids, params, stream)))
        return handle

    def abort(self, rids: list[str]):
        rids = [rid for rid in rids if self.routes.pop(rid, None) is not None]   # not yet finished
        if rids:
            self.num_aborted += len(rids)
            self.sendq.put(("abort", rids))

    @property
    def num_in_flight(self) -> int:
        return len(self.routes)

    def _on_message(self, msg):
        if msg[0] == "outputs":
            self._dispatch(msg[1])
            self._publish(msg[2])
        elif msg[0] == "snapshot":
            self._publish(msg[1])
        elif msg[0] == "errors":
            for rid, message, status in msg[1]:
                self._fail([rid], message, status)

    def _dispatch(self, deltas):
        for delta in deltas:
            route = self.routes.get(delta[0])
            if route is None:      # aborted meanwhile
                continue
            handle, idx, out = route
            apply_delta(out, delta)
            if out.finished:
                del self.routes[out.request_id]
            handle.queue.put_nowait((idx, out))

    def _fail(self, rids: list[str], message: str, status: int):
        for rid in rids:
            route = self.routes.pop(rid, None)
            if route is not None:
                route[0].queue.put_nowait((route[1], EngineError(message, status)))

    def _publish(self, snap: dict):
        self.snapshot = snap
        now = time.monotonic()
        if not self.rate_samples or now - self.rate_samples[-1][0] >= 0.25:
            self.rate_samples.append((now, snap["generation_tokens"]))

    def _core_died(self):
        self.dead = f"the engine process exited (code {self.proc.exitcode}); restart the server"
        log.error(self.dead)
        self._fail(list(self.routes), self.dead, 500)

    def generation_tokens_per_s(self, window: float = 10.0) -> float:
        now, gen = time.monotonic(), self.snapshot["generation_tokens"]
        recent = [s for s in list(self.rate_samples) if s[0] >= now - window]
        if not recent or now - recent[0][0] < 1e-3:
            return 0.0
        return (gen - recent[0][1]) / (now - recent[0][0])

    # ---- threads -----------------------------------------------------------------------------
    def _send_loop(self):
        """Everything queued since the last send goes as one add and one abort message."""
        while True:
            items = [self.sendq.get()]
            while not self.sendq.empty():
                items.append(self.sendq.get_nowait())
            adds = [item[1] for item in items if item[0] == "add"]
            aborts = [rid for item in items if item[0] == "abort" for rid in item[1]]
            try:
                if adds:
                    self.inbox.send(("add", adds))
                if aborts:
                    self.inbox.send(("abort", aborts))
                if any(item[0] == "stop" for item in items):
                    self.inbox.send(("stop",))
                    return
            except (BrokenPipeError, OSError):   # the core is gone; the receiver reports it
                return

    def _receive_loop(self):
        while True:
            try:
                msg = self.outbox.recv()
            except (EOFError, OSError):
                self.proc.join(timeout=5)
                if self.dead is None:
                    self._post(self._core_died)
                return
            self._post(self._on_message, msg)

    def _post(self, fn, *args):
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:      # the loop closed under us: shutting down
            pass
