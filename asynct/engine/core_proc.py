"""The engine in its own process, as vLLM's EngineCore: the server's event loop then never shares
a GIL with the step loop (in one process, every HTTP chunk written delays the next step by up to
the interpreter's 5 ms switch interval), and data parallel runs one per device. The wire format
lives here; `core_client.CoreClient` is the other end.

Front end -> core: ("add", [(rid, token_ids, params, stream), ...]), ("abort", [rid, ...]), ("stop",).
Core -> front end: ("ready", info with a first snapshot) or ("failed", message) once; then ("outputs", deltas, snapshot),
("errors", [(rid, message, status), ...]) and ("snapshot", snapshot).
Outputs travel as deltas (new tokens, new text), so a step's message does not grow with the
length of what was generated; `apply_delta` rebuilds vLLM's cumulative RequestOutput."""
import logging
import multiprocessing as mp
import os
import signal
import threading
from multiprocessing.connection import wait

from asynct.engine.engine_args import EngineArgs
from asynct.engine.llm_engine import LLMEngine
from asynct.engine.outputs import CompletionOutput, RequestOutput

log = logging.getLogger("asynct.engine")


def run_engine_core(args: EngineArgs, make_engine, inbox, outbox):
    """The child process's main: builds the engine, reports, then steps until told to stop or the
    front end goes away."""
    # Ctrl-C in a terminal reaches the whole process group, and so does SIGTERM from `systemctl
    # stop` (KillMode=control-group) or `kill -TERM -<pgid>`: the front end decides what they mean
    # (an interrupted LLM.generate goes on with its engines, a server finishes its requests within
    # the graceful timeout, then stops them); the engine would die at once, and its requests as if
    # it had crashed. It still ends with its front end (_exit_with_parent), or by SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = make_engine(args)
    except Exception as e:     # a bad checkpoint or option: the front end shows the message
        outbox.send(("failed", f"{type(e).__name__}: {e}"))
        return
    try:
        outbox.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                               "startup_seconds": engine.startup_seconds, "snapshot": snapshot(engine),
                               "summary": engine.summary()}))
        EngineCore(engine, outbox).run(inbox)
    except (BrokenPipeError, ConnectionResetError):   # the front end is gone (killed): nobody to tell
        pass


def _exit_with_parent():
    """A front end killed while its engine loads would leave the engine loading to the end (on a
    GPU, minutes holding its memory) before a closed pipe told it: it exits when the parent does."""
    def watch(sentinel):
        wait([sentinel])
        os._exit(0)
    threading.Thread(target=watch, args=(mp.parent_process().sentinel,), daemon=True).start()


class EngineCore:
    def __init__(self, engine: LLMEngine, outbox):
        self.engine, self.outbox = engine, outbox
        # rid -> [prompt logprobs sent, per choice [tokens sent, text sent], or None once it finished]
        self.sent: dict[str, list] = {}

    def run(self, inbox):
        while True:
            idle = not self.engine.has_unfinished_requests()
            if idle:
                self.outbox.send(("snapshot", snapshot(self.engine)))
            if not self._drain(inbox, block=idle):
                return
            if self.engine.has_unfinished_requests():
                self._step()

    def _drain(self, inbox, block: bool) -> bool:
        """Applies what the front end sent; waits for it when idle. False: stop."""
        try:
            while block or inbox.poll():
                block, msg = False, inbox.recv()
                if msg[0] == "stop":
                    return False
                self._apply(msg)
        except (EOFError, OSError):    # the front end is gone
            return False
        return True

    def _apply(self, msg):
        if msg[0] == "abort":
            for rid in msg[1]:
                self.engine.abort_request(rid)
                self.sent.pop(rid, None)
            return
        errors = []
        for rid, ids, params, stream in msg[1]:
            try:
                self.engine.add_request(rid, ids, params, stream=stream)
            except ValueError as e:
                errors.append((rid, str(e), 400))
            except Exception as e:     # never let one request take the engine down
                log.exception("adding request %s failed", rid)
                errors.append((rid, f"engine error: {e}", 500))
        if errors:
            self.outbox.send(("errors", errors))

    def _step(self):
        try:
            outs = self.engine.step()
            failed = [(o.request_id, o.error, 500) for o in outs if o.error]
            deltas = [self._delta(o) for o in outs if not o.error]
        except Exception as e:         # a bug, not bad input: fail what runs, keep serving
            log.exception("engine step failed")
            self._abort_all(f"engine error: {e}")
            return
        for rid, _, _ in failed:       # the engine failed these alone (LLMEngine._fail_request)
            self.sent.pop(rid, None)
        if failed:
            self.outbox.send(("errors", failed))
        self.outbox.send(("outputs", deltas, snapshot(self.engine)))

    def _abort_all(self, message: str):
        rids = list(self.engine.requests)
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
        self.sent.clear()
        self.outbox.send(("errors", [(rid, message, 500) for rid in rids]))

    def _delta(self, out: RequestOutput) -> tuple:
        rid = out.request_id
        sent = (self.sent.pop(rid, None) if out.finished else self.sent.setdefault(rid, [0, []])) or [0, []]
        plp = out.prompt_logprobs
        new_plp = plp[sent[0]:] if plp is not None and len(plp) > sent[0] else None
        sent[0] = len(plp) if plp is not None else 0
        seqs = []
        for c in out.outputs:
            if c.index == len(sent[1]):
                sent[1].append([0, ""])
            state = sent[1][c.index]
            # a finished choice stays in a streamed request's outputs while its siblings run: its
            # final delta went once, the front end has all of it
            if state is None:
                continue
            num_tokens, text = state
            if num_tokens == len(c.token_ids) and text == c.text and not c.finished:
                continue
            keep = len(text) if c.text.startswith(text) else 0
            lps = c.logprobs[num_tokens:] if c.logprobs is not None else None
            seqs.append((c.index, keep, c.text[keep:], c.token_ids[num_tokens:], lps, c.cumulative_logprob,
                         c.finish_reason, c.stop_reason))
            sent[1][c.index] = None if c.finished else [len(c.token_ids), c.text]
        return rid, out.finished, out.num_cached_tokens, new_plp, seqs


def apply_delta(out: RequestOutput, delta: tuple):
    """Brings the front end's copy of a request's output up to the core's."""
    _, out.finished, out.num_cached_tokens, new_plp, seqs = delta
    if new_plp is not None:
        out.prompt_logprobs = (out.prompt_logprobs or []) + new_plp
    for index, keep, text, tokens, lps, cumulative, finish_reason, stop_reason in seqs:
        while len(out.outputs) <= index:
            out.outputs.append(CompletionOutput(len(out.outputs), "", [], None, None))
        c = out.outputs[index]
        c.text = (c.text if keep == len(c.text) else c.text[:keep]) + text
        c.token_ids.extend(tokens)
        if lps is not None:
            c.logprobs = c.logprobs if c.logprobs is not None else []
            c.logprobs.extend(lps)
        c.cumulative_logprob, c.finish_reason, c.stop_reason = cumulative, finish_reason, stop_reason


def snapshot(engine: LLMEngine) -> dict:
    bm, sched = engine.block_manager, engine.scheduler
    return {"running": len(sched.running), "waiting": len(sched.waiting),
            "blocks_total": bm.num_blocks, "blocks_free": bm.num_free_blocks,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate, "preemptions": sched.num_preemptions,
            "prefix_queries": bm.num_queries, "prefix_hits": bm.num_hits,
            **{k: engine.stats[k] for k in ("prompt_tokens", "generation_tokens", "steps")}}


def dead_snapshot(snap: dict) -> dict:
    """A dead engine's last snapshot as it stands now: nothing running or waiting and no KV
    blocks (they went with the process); its counters stay, so that totals never go back."""
    return {**snap, "running": 0, "waiting": 0, "blocks_total": 0, "blocks_free": 0}
