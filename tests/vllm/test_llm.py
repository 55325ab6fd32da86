"""`vllm.LLM` on AsyncT checkpoints: greedy tokens equal asynct's reference model, and the AsyncT
backend (not vLLM's CPU_ATTN) did the attention."""
import gc
import json
from importlib.metadata import entry_points

import pytest

from vllm_helpers import HAVE_VLLM, MAX_TOKENS, make_prompts, reference_greedy

if not HAVE_VLLM:
    pytest.skip("vLLM not installed (see scripts/ci_vllm.sh)", allow_module_level=True)

from asynct.integrations.vllm import backend  # noqa: E402


@pytest.fixture
def cpu_attn_calls(monkeypatch):
    """Counts calls into vLLM's own CPU attention (must stay 0)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    calls = []
    original = CPUAttentionBackendImpl.forward

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", spy)
    return calls


def run_llm(ckpt, prompts, rounds=1, **engine_args):
    """Greedy generations of `prompts`, `rounds` times on one engine (later rounds hit the
    prefix cache), and the backend's STATS delta."""
    from vllm import LLM, SamplingParams
    before = backend.STATS.copy()
    engine_args = {"dtype": "float32", "enforce_eager": True, **engine_args}
    llm = LLM(model=ckpt, max_model_len=256, seed=0, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        results = []
        for _ in range(rounds):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            results.append([list(o.outputs[0].token_ids) for o in outs])
    finally:
        del llm
        gc.collect()
    return results, backend.STATS - before


def test_entry_point_is_declared():
    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "asynct.integrations.vllm:register" in names


def test_greedy_matches_reference(tiny_ckpt, monkeypatch, cpu_attn_calls):
    """The shared asynct.ops path (the one CUDA takes; torch references on the CPU): vLLM's
    reorder puts decodes first, and decode and prefill calls read vLLM's cache in place."""
    monkeypatch.setenv("ASYNCT_VLLM_ATTN", "ops")
    prompts = make_prompts()
    (got,), stats = run_llm(tiny_ckpt, prompts)
    assert got == reference_greedy(tiny_ckpt, prompts)
    assert stats["forwards_ops"] > 0 and not cpu_attn_calls


def test_chunked_prefill_small_blocks_prefix_cache(tiny_ckpt, monkeypatch, cpu_attn_calls):
    """16-token steps split the long prompts into chunks mixed with decodes; 4-token blocks make
    every sequence span many blocks; the second round starts from cached prefixes. Runs the
    torch path, the CPU default (the first test runs the shared asynct.ops)."""
    prompts = make_prompts()
    rounds, stats = run_llm(tiny_ckpt, prompts, rounds=2, block_size=4,
                            max_num_batched_tokens=16, max_num_seqs=4,
                            enable_chunked_prefill=True, enable_prefix_caching=True)
    want = reference_greedy(tiny_ckpt, prompts)
    assert rounds[0] == want and rounds[1] == want
    assert stats["forwards_torch"] > 0 and not stats["forwards_ops"] and not cpu_attn_calls


def test_tied_head_per_channel_alpha_odd_head(tied_ckpt, cpu_attn_calls):
    prompts = make_prompts(seed=5)
    (got,), stats = run_llm(tied_ckpt, prompts, block_size=8)
    assert got == reference_greedy(tied_ckpt, prompts)
    assert stats["forwards"] > 0 and not cpu_attn_calls


def test_bfloat16_runs(tiny_ckpt, cpu_attn_calls):
    """bf16 weights and cache: no token equality (docs/model.md allows bf16 rounding), only that it
    runs through the backend and stays close to the fp32 reference."""
    prompts = make_prompts()
    (got,), stats = run_llm(tiny_ckpt, prompts, dtype="bfloat16")
    want = reference_greedy(tiny_ckpt, prompts)
    assert [len(g) for g in got] == [MAX_TOKENS] * len(prompts)
    # The first token has no bf16 history to diverge on; allow one near-tie among the prompts.
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= len(prompts) - 1
    assert stats["forwards"] > 0 and not cpu_attn_calls


@pytest.mark.parametrize("load_format", ["auto", "hf"])
def test_checkpoint_problems_fail_the_load(tmp_path, load_format):
    """vLLM checks no linear layer's weights, and sigma's loader took any length: a missing
    k_proj ran with uninitialised rows, a [1] sigma was broadcast, an int8 weight was cast. All
    fail the load, named,
    whichever of vLLM's names for reading the directory's safetensors is asked ("hf" is what
    "auto" resolves to; it ran unchecked)."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM

    from asynct.model.checkpoint import make_checkpoint
    ckpt = make_checkpoint("tiny", tmp_path, seed=0)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    tensors["model.layers.1.self_attn.sigma"] = tensors["model.layers.1.self_attn.sigma"][:1].clone()
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].to(torch.int8)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"(?s)model\.layers\.1\.mlp\.down_proj\.weight has dtype I8"
                                         r".*missing tensor model\.layers\.0\.self_attn\.k_proj"
                                         r".*model\.layers\.1\.self_attn\.sigma has shape \[1\]"):
        LLM(model=str(ckpt), dtype="float32", enforce_eager=True, max_model_len=64,
            load_format=load_format)
    gc.collect()


def test_tied_config_with_an_lm_head_fails_the_load(tmp_path):
    """A config that ties the head while the checkpoint holds an lm_head: asynct refuses it,
    but vLLM quietly unties such a config before the model is built (`ModelConfig
    .maybe_untie_word_embeddings`), so the check passed and vLLM ran the stray head instead of
    the embedding the config names. The check reads the config as the checkpoint wrote it."""
    from vllm import LLM

    from asynct.model.checkpoint import make_checkpoint
    ckpt = make_checkpoint("tiny", tmp_path, seed=0)   # untied: it writes lm_head.weight
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match=r"unexpected tensor lm_head\.weight .*tie_word_embeddings=true"):
        LLM(model=str(ckpt), dtype="float32", enforce_eager=True, max_model_len=64)
    gc.collect()


def test_max_model_len_past_the_rope_table_fails_at_start(tmp_path):
    """AsyncT's RoPE is unscaled and ends at max_position_embeddings (docs/model.md: asynct's
    most). vLLM multiplies its default max_model_len by a config's rope_scaling factor (512
    here), and every position past 128 read beyond the model's RoPE table: greedy tokens 0, 0,
    0, ... where asynct refuses the prompt. Such a max_model_len now stops the start, named."""
    from vllm import LLM

    from asynct.model.checkpoint import make_checkpoint
    ckpt = make_checkpoint("tiny", tmp_path, seed=0, max_position_embeddings=128)
    config = json.loads((ckpt / "config.json").read_text())
    scaling = {"rope_type": "linear", "factor": 4.0}
    (ckpt / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    with pytest.raises(ValueError, match=r"max_model_len=512 .*max_position_embeddings=128"):
        LLM(model=str(ckpt), dtype="float32", enforce_eager=True)
    gc.collect()


def test_config_without_architectures(tmp_path):
    """docs/model.md requires five sizes and model_type of config.json, and asynct runs a config
    with no more; vLLM picks its model class by `architectures` and stopped at start ("No model
    architectures are specified"). The AsyncT config names its one architecture by default."""
    from asynct.model.checkpoint import make_checkpoint
    ckpt = make_checkpoint("tiny", tmp_path, seed=0)
    config = json.loads((ckpt / "config.json").read_text())
    del config["architectures"]
    (ckpt / "config.json").write_text(json.dumps(config))
    prompts = make_prompts(seed=2)[:2]
    (got,), stats = run_llm(str(ckpt), prompts)
    assert got == reference_greedy(str(ckpt), prompts) and stats["forwards"] > 0
