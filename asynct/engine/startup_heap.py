"""The start-up heap out of the garbage collector's sight, as vLLM's engine and API server do.
Once an engine (or the API server's app) is built, what is left of its start-up (torch,
transformers, the model, its CUDA graphs; FastAPI in the API process: 240,000-420,000 objects)
is frozen into the collector's permanent generation. Every oldest-generation collection walked
all of it, 160 ms on the H200's host and 185-210 ms on a 2-core CPU, and one fell inside a step
about every hundred steps (256 decodes: one step of 167 ms among 6.5 ms ones). Objects made
later (requests, outputs) are collected as before."""
import gc
import weakref

_finalizers: list = []


def freeze_startup_heap(owner) -> None:
    """Collects, then freezes the heap while `owner` lives. When the last owner is freed the heap
    is unfrozen, so a process that drops its engine can still collect any cycles it left."""
    gc.collect()
    gc.freeze()
    _finalizers.append(weakref.finalize(owner, _owner_freed))


def owners() -> list:
    """The live objects the heap is frozen for."""
    return [f.peek()[0] for f in _finalizers if f.alive]


def _owner_freed() -> None:
    _finalizers[:] = [f for f in _finalizers if f.alive]
    if not _finalizers:
        gc.unfreeze()
