"""The server's handle on its engine processes (one, or one per device with data parallel), each
driven by a `CoreClient` (asynct/engine/core_client.py). Handlers only touch `routes` and their own
queue, on the event loop; each client's receiver thread hands each message from its core to the
loop in one `call_soon_threadsafe`. A request goes to an engine whose prefix cache holds the
deepest prefix of it while that keeps the engines balanced, else to the one with the fewest in
flight (`pick_engine`)."""
import asyncio
import itertools
import logging
import time
from collections import deque

from asynct.engine.core_client import CoreClient, start_engines
from asynct.engine.core_proc import apply_delta, dead_snapshot
from asynct.engine.engine_args import EngineArgs
from asynct.engine.inputs import check_prompt
from asynct.engine.llm_engine import LLMEngine
from asynct.engine.outputs import RequestOutput
from asynct.engine.prefix_routing import PrefixHomes, pick_engine, prefix_keys
from asynct.engine.sampling_params import SamplingParams

log = logging.getLogger("asynct.serve")
SHUTTING_DOWN = "the server is shutting down"


class EngineError(Exception):
    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class QueueFull(Exception):
    pass


class RequestHandle:
    """One HTTP request's engine requests (one per prompt): the loop `put`s their outputs as they
    come, `updates` reads them."""

    def __init__(self, engine: "AsyncEngine", rids: list[str], n: int = 1):
        self.engine, self.rids = engine, rids
        self.n = n                     # sequences a prompt runs (SamplingParams.n)
        self.ready: dict = {}          # prompt index -> its newest output (or EngineError) not yet read
        self.waiter: asyncio.Future | None = None
        self.observe = None            # called with each (prompt index, output) put (metrics.LatencyStats)
        self.pending = set(range(len(rids)))
        self.failed = False

    def put(self, idx: int, out):
        """Outputs are cumulative: a newer one replaces one not yet read (a slow client's pile up
        into one). No asyncio.Queue: its items, futures and task counts cost every token."""
        if self.observe is not None:
            self.observe(idx, out)
        self.ready[idx] = out
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def updates(self):
        """Yields {prompt index: latest RequestOutput}: whatever came since the last."""
        while self.pending:
            if not self.ready:
                self.waiter = asyncio.get_running_loop().create_future()
                try:
                    await self.waiter
                finally:
                    self.waiter = None
            latest, self.ready = self.ready, {}
            for idx, out in latest.items():
                if isinstance(out, EngineError):
                    self.failed = True
                    raise out
                if out.finished:
                    self.pending.discard(idx)
            yield latest

    def close(self):
        """Aborts whatever is unfinished (client gone, or another prompt of it failed); idempotent."""
        live = [self.rids[i] for i in self.pending]
        self.pending = set()
        if live:
            self.engine.abort(live, client_left=not self.failed)


class EngineSlot:
    """One engine process as the front end sees it (loop thread only): its last snapshot, and the
    requests the front end has routed to it and not yet seen finish."""

    def __init__(self, client: CoreClient, info: dict):
        self.client, self.snapshot = client, info["snapshot"]
        self.num_in_flight = self.num_aborted = 0
        self.dead: str | None = None
        self.rate_samples: deque = deque(maxlen=256)   # (time, generation tokens) for tokens/s

    def publish(self, snap: dict):
        self.snapshot = snap
        now = time.monotonic()
        if not self.rate_samples or now - self.rate_samples[-1][0] >= 0.25:
            self.rate_samples.append((now, snap["generation_tokens"]))

    def generation_tokens_per_s(self, window: float = 10.0) -> float:
        now, gen = time.monotonic(), self.snapshot["generation_tokens"]
        recent = [s for s in list(self.rate_samples) if s[0] >= now - window]
        if not recent or now - recent[0][0] < 1e-3:
            return 0.0
        return (gen - recent[0][1]) / (now - recent[0][0])


class AsyncEngine:
    def __init__(self, args: EngineArgs, max_queued_requests: int | None = None, make_engine=LLMEngine):
        """Starts the engine processes (args.data_parallel_size) and waits until they have loaded the
        model; raises ValueError with the engine's own message when one cannot (a bad checkpoint or
        option, mostly)."""
        self.args, self.max_queued_requests = args, max_queued_requests
        clients, infos = start_engines(args, make_engine, args.data_parallel_size)
        self.engines = [EngineSlot(c, info) for c, info in zip(clients, infos)]
        self.max_model_len = min(info["max_model_len"] for info in infos)
        self.vocab_size = infos[0]["vocab_size"]
        self.summary = infos[0].get("summary", {})   # the engine's build, for the start-up log line
        # rid -> (handle, prompt index, output so far, engine index); loop thread only
        self.routes: dict[str, tuple[RequestHandle, int, RequestOutput, int]] = {}
        self.num_seqs = 0      # the routes' sequences (a prompt runs its handle's n)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ids = itertools.count()
        self.stopping: str | None = None
        self.homes = PrefixHomes()

    # ---- lifetime ----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        for i, e in enumerate(self.engines):
            e.client.start(lambda msg, i=i: self._post(self._on_message, i, msg))

    def fail_all(self):
        """Shutting down: the requests in flight end with a 503, and so does any new one."""
        self.stopping = SHUTTING_DOWN
        self._fail(list(self.routes), self.stopping, 503)

    def stop(self):
        self.fail_all()
        for e in self.engines:
            e.client.sendq.put(("stop",))    # all stop at once; then wait for each
        for e in self.engines:
            e.client.stop()

    @property
    def dead(self) -> str | None:
        """Why the server cannot serve in full: shutting down, or an engine process gone."""
        return self.stopping or next((e.dead for e in self.engines if e.dead), None)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and all(e.client.is_alive for e in self.engines)

    # ---- loop side ---------------------------------------------------------------------------
    def check_prompt(self, ids: list[int], params: SamplingParams):
        check_prompt(ids, params, self.vocab_size, self.max_model_len)

    def submit(self, prompts: list[list[int]], params: SamplingParams, stream: bool) -> RequestHandle:
        """Queues one engine request per prompt, each on a live engine (`pick_engine`); raises
        QueueFull past the queue limit: requests beyond each engine's max_num_seqs count as queued
        (counted here, not sampled from the engines, so the limit is exact)."""
        # a process may have exited before its exit message reached the loop: a request sent
        # there would fail as if it had died running it, with live engines at hand
        live = [i for i, e in enumerate(self.engines) if e.dead is None and not e.client.exited]
        if self.stopping or not live:
            raise EngineError(self.dead or "every engine process has exited; restart the server", 503)
        if self.max_queued_requests is not None:
            self._check_queue(len(prompts) * params.n, len(live))
        base = f"req-{next(self.ids)}"
        handle = RequestHandle(self, [f"{base}-{i}" for i in range(len(prompts))], params.n)
        self.num_seqs += len(prompts) * params.n
        for i, (rid, ids) in enumerate(zip(handle.rids, prompts)):
            # hashing every block of a long prompt costs the event loop ms: only routing needs it
            keys = prefix_keys(ids, self.args.block_size) if len(self.engines) > 1 else []
            k = pick_engine(keys, [e.num_in_flight for e in self.engines], live, self.homes)
            self.engines[k].num_in_flight += 1
            self.routes[rid] = (handle, i, RequestOutput(rid, None, ids, None, [], False), k)
            self.engines[k].client.add((rid, ids, params, stream))
        return handle

    def _check_queue(self, num_seqs: int, num_live: int):
        """Sequences (prompts x n, as the engines' max_num_seqs counts them) past the running
        batches count as queued. A request larger than batches + queue could never be taken:
        ValueError (a 400), where a 429 had it retry for good."""
        room = self.args.max_num_seqs * num_live + self.max_queued_requests
        if num_seqs > room:
            raise ValueError(f"the request runs {num_seqs} sequences (prompts x n); this server takes at most "
                             f"{room} at once (--max-num-seqs x engines + --max-queued-requests)")
        if self.num_seqs + num_seqs > room:
            queued = max(0, self.num_seqs - self.args.max_num_seqs * num_live)
            raise QueueFull(f"{queued} sequences are queued (limit {self.max_queued_requests}); retry later")

    def abort(self, rids: list[str], client_left: bool = True):
        """`client_left`: counted in /metrics' requests_aborted_total (the server's own aborts, of a
        failed request's other prompts, are not)."""
        by_engine: dict[int, list[str]] = {}
        for rid in rids:
            route = self._unroute(rid)
            if route is not None:      # not yet finished
                by_engine.setdefault(route[3], []).append(rid)
        for k, live in by_engine.items():
            self.engines[k].num_aborted += len(live) if client_left else 0
            self.engines[k].client.abort(live)

    def _unroute(self, rid: str):
        route = self.routes.pop(rid, None)
        if route is not None:
            self.engines[route[3]].num_in_flight -= 1
            self.num_seqs -= route[0].n
        return route

    @property
    def num_in_flight(self) -> int:
        return len(self.routes)

    @property
    def num_aborted(self) -> int:
        return sum(e.num_aborted for e in self.engines)

    @property
    def snapshot(self) -> dict:
        """All engines' snapshots summed (the hit rate over all their queries)."""
        snaps = [e.snapshot for e in self.engines]
        total = {k: sum(s[k] for s in snaps) for k in snaps[0] if k != "prefix_cache_hit_rate"}
        total["prefix_cache_hit_rate"] = total["prefix_hits"] / total["prefix_queries"] \
            if total.get("prefix_queries") else 0.0
        return total

    def generation_tokens_per_s(self, window: float = 10.0) -> float:
        return sum(e.generation_tokens_per_s(window) for e in self.engines)

    def _on_message(self, k: int, msg):
        if msg[0] == "outputs":
            self._dispatch(msg[1])
            self.engines[k].publish(msg[2])
        elif msg[0] == "snapshot":
            self.engines[k].publish(msg[1])
        elif msg[0] == "errors":
            for rid, message, status in msg[1]:
                self._fail([rid], message, status)
        elif msg[0] == "exit":
            self._core_died(k, msg[1])

    def _dispatch(self, deltas):
        for delta in deltas:
            route = self.routes.get(delta[0])
            if route is None:      # aborted meanwhile
                continue
            handle, idx, out, _ = route
            apply_delta(out, delta)
            if out.finished:
                self._unroute(out.request_id)
            handle.put(idx, out)

    def _fail(self, rids: list[str], message: str, status: int):
        for rid in rids:
            route = self._unroute(rid)
            if route is not None:
                route[0].put(route[1], EngineError(message, status))

    def _core_died(self, k: int, code):
        """Fails the requests of the engine that died; the others keep serving."""
        if self.stopping:
            return
        e = self.engines[k]
        e.dead = f"{e.client.name} exited (code {code}); restart the server"
        e.snapshot = dead_snapshot(e.snapshot)     # /metrics: its last one showed requests it no longer runs
        log.error(e.dead)
        self._fail([rid for rid, route in self.routes.items() if route[3] == k], e.dead, 500)

    def _post(self, fn, *args):
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:      # the loop closed under us: shutting down
            pass

