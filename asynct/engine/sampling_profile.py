"""The sampling half of the start-up memory profile (RunnerStartup.profile_activation_memory).
The sampler runs after the forward, on up to max_num_seqs rows of the whole vocabulary: at 256
rows of a 152k vocabulary its fp32 copies, filters, noise, logprobs and penalty counts come to over
a gigabyte by their sizes, which a KV cache sized by the forward's peak alone left no room for
(out of memory mid-run at a high gpu_memory_utilization). As vLLM's profile run, dummy sequences
sample that many rows, each on the costliest path."""
import torch

from asynct.engine.penalty_counts import PenaltyCounts
from asynct.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from asynct.engine.scheduler import ScheduledBatch
from asynct.engine.sequence import Sequence
from asynct.ops.sampling_filters import FP32_KERNEL_MIN_ROWS


def costliest_params(vocab_size: int) -> SamplingParams:
    """Every option that adds a pass over [rows, vocab]: the penalties (an fp32 copy, counts and
    prompt marks), top-k / top-p / min-p (both bisections), temperature (noise), the most logprobs."""
    return SamplingParams(temperature=0.8, top_k=min(50, vocab_size), top_p=0.9, min_p=0.01,
                          repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                          logprobs=min(MAX_LOGPROBS, vocab_size))


def dummy_sequences(n: int, vocab_size: int, block_size: int) -> list[Sequence]:
    """n sequences with a one-token prompt each, which a one-token step completes: all sample."""
    params = costliest_params(vocab_size)
    return [Sequence(i, "memory-profile", i, [i % vocab_size], params, block_size) for i in range(n)]


def profiled_row_counts(max_rows: int) -> list[int]:
    """The row counts the profile samples: the most a step gives, and the most whose fp32 (the
    dummies' penalised) logits are sorted, not filtered by the kernel (FP32_KERNEL_MIN_ROWS):
    those buffers can outweigh the kernel's at a few rows more (31 sorted rows ~1.7x 32)."""
    return sorted({max_rows, min(max_rows, FP32_KERNEL_MIN_ROWS - 1)}, reverse=True)


def sample_dummy_rows(runner, hidden: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Samples `num_rows` dummy sequences from the last rows of `hidden` (a forward's output;
    zero rows added where it has fewer) with the runner's own sampling and logprobs; returns the
    samples. The runner's last samples, penalty counts and random state stay as they were: the
    dummies count in a throwaway set of the same size, and their noise comes from a forked
    generator (LLM(seed=...) seeded it before the profile)."""
    seqs = dummy_sequences(num_rows, runner.config.vocab_size, runner.block_size)
    if hidden.shape[0] < num_rows:   # a forward of max_model_len tokens, a step of more rows
        hidden = torch.cat([hidden, hidden.new_zeros(num_rows - hidden.shape[0], hidden.shape[1])])
    # each dummy's query ends at one of the forward's last rows: below a full batch, the logits
    # are taken from a gathered copy of those rows, as in a mixed step
    n = hidden.shape[0]
    qsl = (0, *range(n - num_rows + 1, n + 1))
    last, counts = runner.last_sampled, runner.penalty_counts
    runner.penalty_counts = PenaltyCounts(rows_hint=counts.rows_hint)
    try:
        with torch.random.fork_rng(devices=[hidden.device] if hidden.is_cuda else []):
            batch = ScheduledBatch(seqs, [1] * num_rows, num_rows)
            runner._sample(batch, batch.sampling_rows, hidden, qsl)
        return runner.last_sampled
    finally:
        runner.last_sampled, runner.penalty_counts = last, counts
