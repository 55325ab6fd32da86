"""Data parallel for `LLM`: N engine processes (core_proc.py), one per GPU, behind `LLMEngine`'s
interface (add_request, step, abort_request), so that `LLM.generate` drives them unchanged.

Requests added between two steps are assigned together at the next step, to balance the work
(prompt + expected output tokens) and to keep prompts that share KV blocks on one engine, where
its prefix cache serves them all: grouped by the deepest prefix an engine already holds (a
question's other choices: their question), else by their first block. A process that dies
fails its own requests, with an error naming it; the other engines' requests go on. Where
requests go is prefix_routing.py's."""
import logging
import queue
import weakref
from dataclasses import dataclass

from asynct.engine.core_client import start_engines
from asynct.engine.core_proc import apply_delta, dead_snapshot
from asynct.engine.detokenizer import Detokenizer
from asynct.engine.engine_args import EngineArgs
from asynct.engine.inputs import check_bad_words, check_prompt, check_stop_strings, tokenize, truncate_prompt
from asynct.engine.llm_engine import LLMEngine
from asynct.engine.outputs import CompletionOutput, RequestOutput
from asynct.engine.prefix_routing import PrefixHomes, assign, prefix_keys
from asynct.engine.sampling_params import SamplingParams
from asynct.engine.startup_heap import freeze_startup_heap

log = logging.getLogger("asynct")
POLL_S = 1.0     # how long a step waits for a message before checking that the engines live
ALONE = "alone"  # first item of the group of a prompt with no full block


@dataclass
class _Request:
    out: RequestOutput          # what the engine has sent so far (apply_delta)
    params: SamplingParams
    work: int                   # prompt + expected output tokens
    engine: int | None = None   # None until the next step assigns it


class DataParallelEngine:
    def __init__(self, args: EngineArgs, make_engine=LLMEngine):
        self.args, self.size = args, args.data_parallel_size
        self.clients, infos = start_engines(args, make_engine, self.size)
        self._finalizer = weakref.finalize(self, _stop_all, self.clients)
        self.detokenizer = Detokenizer.from_path(args.tokenizer or args.model)   # ours: prompts arrive here
        self.max_model_len = min(info["max_model_len"] for info in infos)
        self.vocab_size = infos[0]["vocab_size"]
        # they load at once: each part of start-up took as long as its slowest engine
        self.startup_seconds = {k: max(info["startup_seconds"][k] for info in infos) for k in infos[0]["startup_seconds"]}
        self.snapshots = [info["snapshot"] for info in infos]
        self.dead: list[str | None] = [None] * self.size
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        for i, c in enumerate(self.clients):
            # the inbox, not self: callbacks that held this engine kept it alive through its own
            # finalizer's arguments (the clients), so that dropping it neither stopped its
            # processes nor could unfreeze the heap
            c.start(lambda msg, i=i, inbox=self.inbox: inbox.put((i, msg)))
        self.requests: dict[str, _Request] = {}
        self.unassigned: list[str] = []
        self.load = [0] * self.size           # work in flight per engine
        self.homes = PrefixHomes()
        self.done: list[RequestOutput] = []   # finished by the front end (failures), for the next step
        freeze_startup_heap(self)     # the parent's heap too (torch, transformers), as LLMEngine's

    # ---- LLMEngine's interface --------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, stream: bool = False):
        """Validates and queues a request as LLMEngine.add_request does (ValueError naming the
        problem); it goes to an engine at the next step."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if stream:
            raise ValueError("data parallel LLM returns finished outputs only (stream=False)")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = tokenize(self.detokenizer, prompt)
        ids = truncate_prompt(ids, params, self.max_model_len)
        check_prompt(ids, params, self.vocab_size, self.max_model_len)
        check_stop_strings(self.detokenizer, params)
        check_bad_words(self.detokenizer, params, self.vocab_size)
        self.requests[request_id] = _Request(RequestOutput(request_id, text, ids, None, [], False), params,
                                             self._work(ids, params))
        self.unassigned.append(request_id)

    def abort_request(self, request_id: str):
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.engine is None:
            self.unassigned.remove(request_id)
        else:
            self.load[req.engine] -= req.work
            self.clients[req.engine].abort([request_id])

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.done)

    def step(self) -> list[RequestOutput]:
        """Sends what was added since the last step, then waits for the engines' next messages;
        returns the requests that finished (failed ones with `error` set)."""
        if self.unassigned:
            self._dispatch()
        while not self.done and self.requests:
            try:
                self._on_message(*self.inbox.get(timeout=POLL_S))
            except queue.Empty:
                self._check_alive()
            while not self.inbox.empty():
                self._on_message(*self.inbox.get_nowait())
        done, self.done = self.done, []
        return done

    @property
    def num_kv_blocks(self) -> int:
        """All engines' KV blocks (their last snapshots'), as LLMEngine.num_kv_blocks."""
        return sum(s["blocks_total"] for s in self.snapshots)

    @property
    def stats(self) -> dict:
        return {k: sum(s[k] for s in self.snapshots) for k in ("prompt_tokens", "generation_tokens", "steps")}

    def shutdown(self):
        self._finalizer()

    # ---- assignment ---------------------------------------------------------------------------
    def _work(self, ids: list[int], params: SamplingParams) -> int:
        new = min(params.max_tokens or self.max_model_len, self.max_model_len - len(ids))
        return len(ids) + params.n * new

    def _dispatch(self):
        # a process may have exited while idle, its exit not yet read: requests sent there would
        # fail as if it had died running them, with live engines at hand
        live = [k for k in range(self.size) if self.dead[k] is None and not self.clients[k].exited]
        # sorted, so that a shared prefix cut into shares is cut where the prompts part least
        rids = sorted(self.unassigned, key=lambda rid: self.requests[rid].out.prompt_token_ids)
        self.unassigned = []
        if not live:
            for rid in rids:
                self._fail(rid, "every engine process has exited; make a new LLM")
            return
        reqs = [self.requests[rid] for rid in rids]
        keys = [prefix_keys(r.out.prompt_token_ids, self.args.block_size) for r in reqs]
        groups, homes = self._groups(keys, live)
        chosen = assign([r.work for r in reqs], groups, [self.load[k] for k in live], homes)
        for rid, r, ks, c in zip(rids, reqs, keys, chosen):
            self.homes.remember(ks, live[c])
            r.engine = live[c]
            self.load[r.engine] += r.work
            self.clients[r.engine].add((rid, r.out.prompt_token_ids, r.params, False))

    def _groups(self, keys: list[list[int]], live: list[int]):
        """Each request's group for `assign` and the groups' homes (indices into `live`, the
        engines holding its deepest prefix first): its deepest prefix a live engine holds (a
        question's other choices: their question), else its first block (a few-shot prefix
        nobody holds yet), else a group of its own."""
        groups, homes = [], {}
        for i, ks in enumerate(keys):
            key, k = self.homes.deepest(ks, self.load, live)
            if k is not None:
                homes[key] = [live.index(h) for h in self.homes.holders(ks, self.load, live)]
            elif ks:
                key = ks[0]
            else:
                key = (ALONE, i)
            groups.append(key)
        return groups, homes

    # ---- messages ---------------------------------------------------------------------------
    def _on_message(self, k: int, msg):
        if msg[0] == "outputs":
            self.snapshots[k] = msg[2]
            for delta in msg[1]:
                req = self.requests.get(delta[0])
                if req is None:       # aborted meanwhile
                    continue
                apply_delta(req.out, delta)
                if req.out.finished:
                    self._finish(delta[0])
        elif msg[0] == "snapshot":
            self.snapshots[k] = msg[1]
        elif msg[0] == "errors":
            for rid, message, _ in msg[1]:
                if rid in self.requests:
                    self._fail(rid, message)
        elif msg[0] == "exit":
            self._engine_died(k, msg[1])

    def _engine_died(self, k: int, code):
        if self.dead[k] is not None:
            return
        self.dead[k] = f"{self.clients[k].name} exited (code {code}) while running this request"
        self.snapshots[k] = dead_snapshot(self.snapshots[k])   # num_kv_blocks: the live engines' only
        log.error("%s exited (code %s); its requests fail, the other engines go on", self.clients[k].name, code)
        for rid in [rid for rid, r in self.requests.items() if r.engine == k]:
            self._fail(rid, self.dead[k])

    def _check_alive(self):
        """A backstop for an exit whose message is lost: a process gone with requests on it."""
        for k, c in enumerate(self.clients):
            if self.dead[k] is None and c.exited and not c.threads[1].is_alive():
                self._engine_died(k, c.proc.exitcode)

    def _finish(self, rid: str):
        req = self.requests.pop(rid)
        if req.engine is not None:
            self.load[req.engine] -= req.work
        self.done.append(req.out)

    def _fail(self, rid: str, message: str):
        out = self.requests[rid].out
        out.outputs = [CompletionOutput(0, "", [], None, None, "error", message)]
        out.finished, out.error = True, message
        self._finish(rid)


def _stop_all(clients):
    for c in clients:
        c.sendq.put(("stop",))
    for c in clients:
        c.stop(timeout=10)
