"""The front end's handle on one engine-core process (core_proc.py): it spawns the process, waits
for its model, and runs two threads: a sender that batches adds and aborts into one message each,
and a receiver that hands every message from the core to a callback. Callers decide where those
messages go: the server posts them to its event loop, data parallel `LLM` to a queue it drains."""
import atexit
import contextlib
import multiprocessing as mp
import os
import queue
import threading
import weakref
from dataclasses import replace
from multiprocessing.connection import wait as wait_for

from asynct.engine.core_proc import run_engine_core
from asynct.engine.engine_args import EngineArgs, resolve_device
from asynct.engine.llm_engine import LLMEngine

# every process the engine starts: the GPU machines it runs on need NVLink multicast off
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_env_lock = threading.Lock()


_running: "weakref.WeakSet[CoreClient]" = weakref.WeakSet()


def _stop_at_exit():
    """Engine processes ignore SIGTERM (core_proc.run_engine_core), and multiprocessing's own exit
    handler ends daemonic children with SIGTERM, then waits for them: a script that ended without
    stopping its engines waited forever. Registered after that handler, so it runs before it."""
    for client in list(_running):
        client.stop(timeout=5)


class EngineDeadError(RuntimeError):
    """An engine process exited (killed for memory, a crash in the driver): what it printed
    before, if anything, says why; a command line shows this line, not the parent's traceback."""


class CoreClient:
    def __init__(self, args: EngineArgs, make_engine=LLMEngine, index: int | None = None, gpu: str | None = None):
        """Starts the process without waiting for it, so that several load their models at once
        (`wait_ready` then waits). `index` numbers it among data-parallel engines; `gpu` is the
        one CUDA device it sees (default: what this process sees)."""
        self.index, self.gpu = index or 0, gpu
        self.name = "the engine process" + (f" {index}" if index is not None else "") + \
            (f" (GPU {gpu})" if gpu is not None else "")
        ctx = mp.get_context("spawn")        # CUDA cannot live through a fork
        core_inbox, self.inbox = ctx.Pipe(duplex=False)
        self.outbox, core_outbox = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_engine_core, args=(args, make_engine, core_inbox, core_outbox),
                                name=f"asynct-engine-core-{index}", daemon=True)
        env = {**CHILD_ENV, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
        with child_env(env):
            self.proc.start()
        if not _running:
            atexit.unregister(_stop_at_exit)
            atexit.register(_stop_at_exit)
        _running.add(self)
        core_inbox.close()
        core_outbox.close()              # so that the core's exit reads as EOF here
        self.sendq: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []

    def wait_ready(self) -> dict:
        """The core's first report; raises ValueError with the engine's own message when it could
        not start (a bad checkpoint or option, mostly)."""
        while not self.outbox.poll(0.2):
            if self.exited:
                raise self._died_loading()
        try:
            kind, info = self.outbox.recv()
        except EOFError:     # it exited without a word: poll reads the closed pipe as ready
            raise self._died_loading() from None
        if kind == "failed":
            self.proc.join(timeout=10)
            raise ValueError(f"{self.name} could not start: {info}")
        return info

    def _died_loading(self) -> "EngineDeadError":
        self.proc.join(timeout=10)
        return EngineDeadError(f"{self.name} exited with code {self.proc.exitcode} while loading")

    def start(self, on_message):
        """`on_message(msg)` runs on the receiver thread for each message of the core, and last
        with ("exit", exit code) when the process is gone."""
        self.threads = [threading.Thread(target=fn, name=f"{name}-{self.index}", daemon=True)
                        for fn, name in ((self._send_loop, "asynct-send"), (self._receive_loop, "asynct-receive"))]
        self.on_message = on_message
        for t in self.threads:
            t.start()

    def add(self, item: tuple):
        """item: (rid, token ids, SamplingParams, stream)."""
        self.sendq.put(("add", item))

    def abort(self, rids: list[str]):
        self.sendq.put(("abort", rids))

    def stop(self, timeout: float = 30):
        _running.discard(self)
        self.sendq.put(("stop",))
        if not self.threads:             # never started: nothing sends for us
            with contextlib.suppress(OSError):
                self.inbox.send(("stop",))
        self.proc.join(timeout=timeout)
        if not self.exited:
            self.proc.kill()
            self.proc.join(timeout=5)
        for t in self.threads:
            t.join(timeout=5)
        if not any(t.is_alive() for t in self.threads):
            # the callback holds the engine that holds this client: a cycle, never collected while
            # the start-up heap is frozen for that engine (startup_heap.py)
            self.on_message = None

    @property
    def is_alive(self) -> bool:
        return not self.exited and all(t.is_alive() for t in self.threads)

    @property
    def exited(self) -> bool:
        """Whether the process has ended, from its sentinel, which every thread may read:
        `proc.is_alive()` reaps the child, and of two threads reaping it (the receiver's join and
        a dispatcher's check) the loser sees no exit code, and a live process, ever after."""
        return bool(wait_for([self.proc.sentinel], timeout=0))

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
                self.on_message(("exit", self.proc.exitcode))
                return
            self.on_message(msg)


@contextlib.contextmanager
def child_env(env: dict):
    """`env` in os.environ while a child is spawned (a spawned child copies it); the lock keeps
    two spawns, in two threads, from seeing each other's values."""
    with _env_lock:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def gpus_for(args: EngineArgs, size: int) -> list[str | None]:
    """The CUDA device each of `size` engines sees (one each), or None each where they run on the
    CPU; CUDA_VISIBLE_DEVICES, when set, names the devices to use."""
    import torch
    device = resolve_device(args.device)
    if device.type != "cuda":
        return [None] * size
    if device.index is not None:
        raise ValueError(f"device={args.device!r} names one GPU; with data_parallel_size={size} each engine "
                         "gets its own: give device='cuda' (and CUDA_VISIBLE_DEVICES to choose them)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None \
        else [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < size:
        raise ValueError(f"data_parallel_size={size} needs {size} GPUs; {len(ids)} visible")
    return ids[:size]


def engine_args(args: EngineArgs, index: int, size: int) -> EngineArgs:
    """Engine `index`'s args: its own seed (seed + index). With one seed each, engines drew the
    same unseeded samples, and the copies of a prompt spread over them (a task's repeats) came
    back alike."""
    if size == 1 or args.seed is None:
        return args
    return replace(args, seed=args.seed + index)


def start_engines(args: EngineArgs, make_engine, size: int) -> tuple[list[CoreClient], list[dict]]:
    """`size` engine processes loading their models at once, one per GPU where there are GPUs
    (size 1: one seeing what this process sees), and their ready reports. Where one cannot
    start, all are stopped and its error raised."""
    if size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {size}")
    gpus = gpus_for(args, size) if size > 1 else [None]
    clients = [CoreClient(engine_args(args, i, size), make_engine, i if size > 1 else None, gpu)
               for i, gpu in enumerate(gpus)]
    try:
        return clients, [c.wait_ready() for c in clients]
    except BaseException:
        for c in clients:
            c.stop(timeout=5)
        raise
