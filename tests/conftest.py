import os

import torch

# Triton kernels run under the interpreter where there is no GPU; this must be set before
# anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

import asynct  # noqa: E402,F401  (registers the Auto classes as transformers loads them)
from asynct.model.checkpoint import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A float32 tiny checkpoint with a byte-level tokenizer, shared by the whole session."""
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Each engine takes a share of free GPU memory: give it back between tests. Engines freeze
    the heap they start with (asynct/engine/startup_heap.py), and one a module's fixture keeps
    would keep it frozen, with any cycles a later test's engine leaves: unfrozen here."""
    yield
    if torch.cuda.is_available():
        import gc
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()
