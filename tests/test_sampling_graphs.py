"""Small decode graphs run the LM head and the greedy argmax themselves (engine/cuda_graph.py):
the runner takes their argmax for steps whose every row would take the raw logits' argmax, and
samples from their logits otherwise. Outputs equal an engine's whose graphs leave the hidden
states, for every sampling option, under async scheduling. On the CPU a stand-in replays the
same contract: static buffers that every replay overwrites."""
import pytest
import torch

from asynct import LLM, SamplingParams, ops
from asynct.engine import cuda_graph, model_runner
from asynct.engine.cuda_graph import GraphLogits

from test_async_scheduling import mixed_params, summary
from test_engine import random_prompts

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class StaticSamplingGraphs:
    """A sampling graph's contract on the CPU: the forward, then logits and their argmax into
    static buffers, which the next run overwrites (a replay does)."""

    def __init__(self, runner, rows):
        self.runner, self.rows, self.runs = runner, rows, 0
        self.logits = torch.full((rows, runner.config.vocab_size), float("nan"))
        self.greedy = torch.full((rows,), -1, dtype=torch.long)

    def can_run(self, metadata) -> bool:
        return metadata.num_prefills == 0 and 0 < metadata.num_decodes <= self.rows

    def run(self, input_ids, positions, metadata):
        n, self.runs = metadata.num_decodes, self.runs + 1
        hidden = self.runner._forward(input_ids, positions, metadata)
        ops.argmax(self.runner.model.compute_logits(hidden, out=self.logits[:n]), out=self.greedy[:n])
        return GraphLogits(self.logits[:n], self.greedy[:n])


def mixed_workload(llm):
    """Prompts and per-request parameters that meet every sampling path (mixed_params), over a
    greedy run's own tokens; the EOS id is the most frequent generated token."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(21, 1, 60, seed=9, prefix=range(20))]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    own = [o.outputs[0].token_ids for o in greedy]
    eos = torch.bincount(torch.tensor([t for o in own for t in o[1:]])).argmax().item()
    params = [mixed_params(o, eos, i) for i, o in enumerate(own)]
    params += [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                              frequency_penalty=0.4) for _ in range(3)]
    return prompts + prompts[:3], params, eos


def generate(llm, prompts, params, eos):
    llm.llm_engine.eos_token_ids = llm.llm_engine.runner.eos_token_ids = [eos]
    return summary(llm.generate(prompts, params, use_tqdm=False))


def test_a_static_sampling_graph_gives_every_option_the_tokens_of_eager_steps(tiny_ckpt, monkeypatch):
    # a device copy snapshots the buffer when it runs; on the CPU to_host would hand out the buffer
    monkeypatch.setattr(model_runner, "to_host", lambda t: t.clone())
    llms = [LLM(tiny_ckpt, device="cpu", max_num_seqs=8, num_kv_blocks=300) for _ in range(2)]
    prompts, params, eos = mixed_workload(llms[0])
    stand_in = llms[1].llm_engine.runner.graphs = StaticSamplingGraphs(llms[1].llm_engine.runner, 8)
    from_graph = []     # per call of `sample`: whether it sampled a graph's logits
    real = model_runner.sample
    monkeypatch.setattr(model_runner, "sample", lambda logits, seqs, *a: from_graph.append(
        logits.data_ptr() == stand_in.logits.data_ptr()) or real(logits, seqs, *a))
    assert generate(llms[1], prompts, params, eos) == generate(llms[0], prompts, params, eos)
    assert stand_in.runs > 20 and any(from_graph)
    from_graph.clear()
    before = stand_in.runs
    llms[1].generate(prompts[:6], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    # only steps with prefill tokens go through `sample`: decode steps take the graph's argmax
    assert stand_in.runs - before >= 10 and from_graph and not any(from_graph)


@gpu
def test_sampling_graphs_give_the_tokens_of_graphs_that_leave_hidden_states(monkeypatch):
    """bf16, graphs up to 16 sequences: every option's tokens and logprobs equal, bit for bit,
    those of graphs without the LM head (the same GEMM, torch's argmax of the same logits)."""
    from asynct.model.checkpoint import make_checkpoint
    import tempfile
    ckpt = make_checkpoint("small", tempfile.mkdtemp(), seed=4, dtype="bfloat16", hidden_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)
    outs = []
    for sampling_max in (cuda_graph.SAMPLING_MAX_BS, 0):
        monkeypatch.setattr(cuda_graph, "SAMPLING_MAX_BS", sampling_max)
        llm = LLM(ckpt, max_num_seqs=16, gpu_memory_utilization=0.2)
        assert llm.llm_engine.runner.graphs is not None
        prompts, params, eos = mixed_workload(llm)
        outs.append(generate(llm, prompts, params, eos))
        del llm
    assert outs[0] == outs[1]
