"""The start-up heap out of the garbage collector's sight, as vLLM's engine and API server do.
Once an engine is built, what is left of its start-up (torch, transformers, the model, its CUDA
graphs: some 400,000 objects) is frozen into the collector's permanent generation: every
oldest-generation collection walked all of it, 130-190 ms (H200 host; 185 ms on a 2-core CPU
host), and one fell inside a step about every hundred steps (256 decodes: one step of 130-160 ms
among 6.5 ms ones). Objects made later (requests, outputs) are collected as before."""
import gc
import weakref

_live_engines = 0


def freeze_startup_heap(engine) -> None:
    """Collects, then freezes the heap. When the last engine alive is freed the heap is unfrozen,
    so a process that drops its engine can still collect any cycles it left behind."""
    global _live_engines
    gc.collect()
    gc.freeze()
    _live_engines += 1
    weakref.finalize(engine, _engine_freed)


def _engine_freed() -> None:
    global _live_engines
    _live_engines -= 1
    if _live_engines == 0:
        gc.unfreeze()
