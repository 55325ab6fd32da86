"""The asyncio side of the engine. `LLMEngine` is not thread-safe, so one dedicated thread owns it:
it drains an inbox of adds and aborts between steps and hands each step's outputs to the event
loop in one `call_soon_threadsafe`. Handlers only ever touch the inbox and their own queue."""
import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque

from asynct.engine.llm_engine import LLMEngine
from asynct.engine.outputs import RequestOutput
from asynct.engine.sampling_params import SamplingParams

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
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.routes: dict[str, tuple[RequestHandle, int]] = {}   # touched on the loop thread only
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.ids = itertools.count()
        self.num_aborted = 0
        self.rate_samples: deque = deque(maxlen=256)   # (time, generation tokens) for tokens/s
        self.snapshot = self._snapshot()

    # ---- loop side -----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.thread = threading.Thread(target=self._run, name="asynct-engine", daemon=True)
        self.thread.start()

    def stop(self):
        self._fail_routes("the server is shutting down", 503)
        self.inbox.put(("stop",))
        if self.thread:
            self.thread.join(timeout=30)

    def submit(self, prompts: list[list[int]], params: SamplingParams, stream: bool) -> RequestHandle:
        """Queues one engine request per prompt; raises QueueFull past the queue limit: requests
        beyond the batch's max_num_seqs count as queued (counted here, not sampled from the engine,
        so the limit is exact)."""
        if self.max_queued_requests is not None:
            cap = self.engine.args.max_num_seqs + self.max_queued_requests
            if len(self.routes) + len(prompts) > cap:
                queued = max(0, len(self.routes) - self.engine.args.max_num_seqs)
                raise QueueFull(f"{queued} requests are queued (limit {self.max_queued_requests}); retry later")
        base = f"req-{next(self.ids)}"
        handle = RequestHandle(self, [f"{base}-{i}" for i in range(len(prompts))])
        for i, (rid, ids) in enumerate(zip(handle.rids, prompts)):
            self.routes[rid] = (handle, i)
            self.inbox.put(("add", rid, ids, params, stream))
        return handle

    def abort(self, rids: list[str]):
        rids = [rid for rid in rids if self.routes.pop(rid, None) is not None]   # not yet finished
        if rids:
            self.num_aborted += len(rids)
            self.inbox.put(("abort", rids))

    @property
    def num_in_flight(self) -> int:
        return len(self.routes)

    def _dispatch(self, outs: list[RequestOutput]):
        for out in outs:
            route = self.routes.get(out.request_id)
            if route is None:      # aborted meanwhile
                continue
            if out.finished:
                del self.routes[out.request_id]
            route[0].queue.put_nowait((route[1], out))

    def _fail(self, rids: list[str], message: str, status: int):
        for rid in rids:
            route = self.routes.pop(rid, None)
            if route is not None:
                route[0].queue.put_nowait((route[1], EngineError(message, status)))

    def _fail_routes(self, message: str, status: int):
        self._fail(list(self.routes), message, status)

    # ---- engine thread -------------------------------------------------------------------
    def _post(self, fn, *args):
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:      # the loop closed under us: shutting down
            pass

    def _run(self):
        engine = self.engine
        while True:
            if not self._drain(block=not engine.has_unfinished_requests()):
                return
            try:
                outs = engine.step()
            except Exception as e:     # a bug, not bad input: fail what runs, keep serving
                log.exception("engine step failed")
                self._abort_all(f"engine error: {e}")
                continue
            self._publish()
            if outs:
                self._post(self._dispatch, outs)

    def _drain(self, block: bool) -> bool:
        """Applies queued adds/aborts; blocks for the first one when idle. False on stop."""
        if block:
            self._publish()
        try:
            item = self.inbox.get() if block else self.inbox.get_nowait()
            while True:
                if item[0] == "stop":
                    return False
                self._apply(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, item):
        if item[0] == "add":
            _, rid, ids, params, stream = item
            try:
                self.engine.add_request(rid, ids, params, stream=stream)
            except ValueError as e:
                self._post(self._fail, [rid], str(e), 400)
            except Exception as e:      # never let one request take the engine thread down
                log.exception("adding request %s failed", rid)
                self._post(self._fail, [rid], f"engine error: {e}", 500)
        elif item[0] == "abort":
            for rid in item[1]:
                self.engine.abort_request(rid)

    def _abort_all(self, message: str):
        rids = list(self.engine.requests)
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
        self._post(self._fail, rids, message, 500)

    def _publish(self):
        """Metrics are read from the loop thread: publish an immutable snapshot instead."""
        self.snapshot = self._snapshot()
        now, gen = time.monotonic(), self.snapshot["generation_tokens"]
        if not self.rate_samples or now - self.rate_samples[-1][0] >= 0.25:
            self.rate_samples.append((now, gen))

    def _snapshot(self) -> dict:
        e = self.engine
        bm, sched = e.block_manager, e.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting),
                "blocks_total": bm.num_blocks, "blocks_free": bm.num_free_blocks,
                "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
                "preemptions": sched.num_preemptions, "time": time.monotonic(),
                **{k: e.stats[k] for k in ("prompt_tokens", "generation_tokens", "steps")}}

    def generation_tokens_per_s(self, window: float = 10.0) -> float:
        now, gen = time.monotonic(), self.snapshot["generation_tokens"]
        recent = [s for s in list(self.rate_samples) if s[0] >= now - window]
        if not recent or now - recent[0][0] < 1e-3:
            return 0.0
        return (gen - recent[0][1]) / (now - recent[0][0])
