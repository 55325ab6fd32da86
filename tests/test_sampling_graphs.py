"""Decode graphs (engine/cuda_graph.py) take their inputs from static buffers that the backend
fills in one copy a step, and small ones run the LM head and the greedy argmax themselves, into
their input ids: the runner takes that argmax for steps whose every row would take the raw
logits' argmax, and samples from their logits otherwise. Outputs equal eager steps', for every
sampling option, under async scheduling. On the CPU the graphs' runner itself runs each replay
eagerly: the same buffers, copies and outputs, without the capture."""
import pytest
import torch

from asynct import LLM, SamplingParams
from asynct.engine import cuda_graph, model_runner
from asynct.engine.context import reset_context, set_context
from asynct.engine.cuda_graph import CudaGraphRunner

from test_async_scheduling import mixed_params, summary
from test_engine import random_prompts

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class EagerReplays(CudaGraphRunner):
    """CudaGraphRunner whose replays run the graph's work eagerly (on the CPU: no capture)."""

    def capture(self):
        self.replays = 0

    def replay(self, bs, metadata):
        self.replays += 1
        set_context(metadata)
        try:
            self.forward(bs)
        finally:
            reset_context()


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


@pytest.mark.parametrize("sampling_max", [cuda_graph.SAMPLING_MAX_BS, 2])
def test_graph_steps_give_every_option_the_tokens_of_eager_steps(tiny_ckpt, monkeypatch, sampling_max):
    """max_num_seqs 8: graphs of 1, 2, 4 and 8 rows, padded; with sampling_max 2 the larger two
    leave hidden states."""
    monkeypatch.setattr(cuda_graph, "SAMPLING_MAX_BS", sampling_max)
    # a device copy snapshots the buffer when it runs; on the CPU to_host would hand out the buffer
    monkeypatch.setattr(model_runner, "to_host", lambda t: t.clone())
    llms = [LLM(tiny_ckpt, device="cpu", attention_backend="triton", max_num_seqs=8, num_kv_blocks=300)
            for _ in range(2)]
    prompts, params, eos = mixed_workload(llms[0])
    runner = llms[1].llm_engine.runner
    graphs = runner.graphs = EagerReplays(runner, 8)
    from_graph = []     # per call of `sample`: whether it sampled a graph's logits
    real = model_runner.sample
    monkeypatch.setattr(model_runner, "sample", lambda logits, seqs, *a: from_graph.append(
        logits.data_ptr() == graphs.logits.data_ptr()) or real(logits, seqs, *a))
    assert generate(llms[1], prompts, params, eos) == generate(llms[0], prompts, params, eos)
    assert graphs.replays > 20 and any(from_graph)
    from_graph.clear()
    before = graphs.replays
    # plain greedy rows that end apart: each step's rows read the step before's argmax in place,
    # until one ends and the rest are gathered from it
    plain = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 3, 12, 5, 12, 7)]
    assert generate(llms[1], prompts[:6], plain, eos) == generate(llms[0], prompts[:6], plain, eos)
    # steps with prefill tokens go through `sample`, decode steps not: the argmax, or eager logits
    assert graphs.replays - before >= 10 and from_graph and not any(from_graph)


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


def test_graph_inputs_pack_each_part_16_byte_aligned_and_pad_empty_rows():
    """One copy holds every part; an odd batch size must not leave a part 8-byte aligned (Triton
    specialises pointers on 16). Rows past the step's: length 0, slot -1, position 0."""
    import numpy as np

    from asynct.attention import StepInputs
    from asynct.attention.graph_inputs import GraphStepInputs, longest_first
    g = GraphStepInputs(3, 5, "cpu")
    assert all(getattr(g, name).data_ptr() % 16 == 0 for name in ("positions", "slot_mapping", "seq_lens",
                                                                   "decode_order", "prefix_len", "block_table"))
    assert g.decode_order.tolist() == [0, 1, 2]     # a permutation before any step (capture reads it)
    step = StepInputs([1, 1], [7, 20], [[4, 2], [9]], [33, 150], 2)
    g.send(step, np.array([[4, 2], [9, 0]], dtype=np.int32), 16, longest_first(step.seq_lens, 3))
    assert g.positions.tolist() == [6, 19, 0] and g.seq_lens.tolist() == [7, 20, 0]
    assert g.slot_mapping.tolist() == [33, 150, -1] and g.prefix_len.tolist() == [16]
    assert g.decode_order.tolist() == [1, 0, 2]     # longest first; the empty row keeps its place
    assert g.block_table[:2, :2].tolist() == [[4, 2], [9, 0]] and not g.block_table[2:].any()


def test_a_one_token_prefill_chunk_keeps_its_step_off_the_graphs(tiny_ckpt, monkeypatch):
    """A step of one-token queries is not always a decode step: a prompt's chunk can be one
    token (the budget's last), mid-prompt. It neither samples nor, in a sampling graph, keeps the
    hidden state its prompt logprob needs: such steps run as before, and outputs (prompt
    logprobs too) equal eager steps'."""
    monkeypatch.setattr(model_runner, "to_host", lambda t: t.clone())
    kw = dict(device="cpu", attention_backend="triton", max_num_seqs=8, max_num_batched_tokens=5,
              num_kv_blocks=300)
    llms = [LLM(tiny_ckpt, **kw) for _ in range(2)]
    runner = llms[1].llm_engine.runner
    graphs = runner.graphs = EagerReplays(runner, 8)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, 2, 14, seed=3)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1, logprobs=1)
              if i % 2 else SamplingParams(temperature=0, max_tokens=9, ignore_eos=True) for i in range(8)]
    one_token_chunks = []
    real = runner.launch

    def launch(batch):
        if batch.is_decode_only:
            one_token_chunks.append(sum(s.is_prefilling for s in batch.seqs))
        return real(batch)
    monkeypatch.setattr(runner, "launch", launch)
    assert generate(llms[1], prompts, params, 0) == generate(llms[0], prompts, params, 0)
    assert any(one_token_chunks) and graphs.replays >= 3
