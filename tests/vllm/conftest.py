"""Shared pieces of the vLLM plugin tests. They run in their own venv (scripts/ci_vllm.sh); every
test module skips itself when `vllm` is not importable, so the main suite stays green."""
import atexit
import os
import shutil
import tempfile

import pytest
from vllm_helpers import HAVE_VLLM, perturb_dyht

if HAVE_VLLM:
    # Small KV cache, in-process engine (fast start, and STATS stay visible), no network.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "VLLM_CACHE_ROOT" not in os.environ:  # scripts/ci_vllm.sh sets (and removes) its own
        os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="asynct-vllm-cache-")
        atexit.register(shutil.rmtree, os.environ["VLLM_CACHE_ROOT"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The `tiny` preset: head_dim 16 (below CPU_ATTN's minimum 32), untied head, alpha [1]."""
    from asynct.model.checkpoint import make_checkpoint
    out = make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)
    perturb_dyht(out)
    return str(out)


@pytest.fixture(scope="session")
def tied_ckpt(tmp_path_factory):
    """Tied head, per-channel alpha [C], an odd-sized head (24), GQA 3:1."""
    from asynct.model.checkpoint import make_checkpoint
    out = make_checkpoint("tiny", tmp_path_factory.mktemp("tied"), seed=3,
                          tie_word_embeddings=True, dyht_alpha_per_channel=True,
                          num_attention_heads=6, num_key_value_heads=2, head_dim=24)
    perturb_dyht(out)
    return str(out)
