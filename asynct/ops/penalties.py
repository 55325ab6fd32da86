"""vLLM's repetition, frequency and presence penalties over fp32 logits [R, V], in place, from
the engine's kept counts (asynct.engine.penalty_counts): row i reads row rows[i] of the
output-token counts (int32 [slots, V]) and of the prompt marks (bool [slots, V], or None), and
counts one more of sampled[pending[i]] (the token the step before sampled, still on the device
under async scheduling; pending[i] = -1: none). The kernel reads that token itself: gathering it
in torch first took three more launches a step (a fill, a gather, a scatter).

In torch the penalties were ~10 passes over [R, V] (a gathered copy of the counts, masks,
two wheres, two products): at 256 rows of a 152k vocabulary, penalised steps ran 1.05-1.28x
plain ones (H200). The kernel reads each logit, count and mark once and writes the logit
once. Every row takes all three penalties: 1, 0, 0 leave a logit's bits as they are (x / 1,
x * 1, x - 0 * count), so no penalty needs a variant of its own to compile."""
import torch

from asynct.ops._triton import jit as _jit, cdiv, tl, triton

BLOCK = 2048


def apply_penalties_ref(logits, counts, rows, in_prompt, pending, sampled, rep, freq, pres):
    seen_counts = counts.index_select(0, rows)
    if sampled is not None:
        has = pending >= 0
        seen_counts[has, sampled[pending[has]]] += 1
    in_output = seen_counts > 0
    seen = in_output if in_prompt is None else in_output | in_prompt.index_select(0, rows)
    r = rep[:, None]
    logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    logits -= freq[:, None] * seen_counts
    logits -= pres[:, None] * in_output
    return logits


@_jit(do_not_specialize=["has_prompt", "has_sampled"])
def _penalties_kernel(logits_ptr, counts_ptr, rows_ptr, prompt_ptr, has_prompt, pending_ptr, sampled_ptr,
                      has_sampled, rep_ptr, freq_ptr, pres_ptr, V, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = v < V
    row = tl.load(rows_ptr + i) * V
    x = tl.load(logits_ptr + i.to(tl.int64) * V + v, mask=mask, other=0.0)
    src = tl.load(pending_ptr + i)
    token = tl.load(sampled_ptr + tl.maximum(src, 0), mask=(src >= 0) & (has_sampled != 0), other=-1)
    c = tl.load(counts_ptr + row + v, mask=mask, other=0) + (v == token).to(tl.int32)
    in_output = c > 0
    seen = in_output | (tl.load(prompt_ptr + row + v, mask=mask & (has_prompt != 0), other=0) != 0)
    r, f, p = tl.load(rep_ptr + i), tl.load(freq_ptr + i), tl.load(pres_ptr + i)
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, r), x * r), x)
    x = x - f * c.to(tl.float32)
    x = x - p * in_output.to(tl.float32)
    tl.store(logits_ptr + i.to(tl.int64) * V + v, x, mask=mask)


def apply_penalties_triton(logits, counts, rows, in_prompt, pending, sampled, rep, freq, pres):
    r, v = logits.shape
    if r:
        # one compiled variant: without marks (or samples) the masked-off loads point elsewhere
        prompt = counts.view(torch.uint8) if in_prompt is None else in_prompt.view(torch.uint8)
        # unfused products and differences, as torch's ops round them (no FMA)
        _penalties_kernel[(r, cdiv(v, BLOCK))](logits, counts, rows, prompt, int(in_prompt is not None),
                                                     pending, pending if sampled is None else sampled,
                                                     int(sampled is not None), rep, freq, pres, v, BLOCK=BLOCK,
                                                     num_warps=4, enable_fp_fusion=False)
    return logits


def apply_penalties(logits, counts, rows, in_prompt, pending, sampled, rep, freq, pres):
    """`logits` fp32 [R, V], contiguous, changed in place and returned; rows, pending int64 [R];
    sampled int64 (None: no pending token counts, whatever `pending` says); rep, freq, pres fp32 [R]."""
    if logits.dtype != torch.float32 or not logits.is_contiguous() or counts.shape[1] != logits.shape[1]:
        raise ValueError(f"penalties need contiguous fp32 logits [R, {counts.shape[1]}], got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    fn = apply_penalties_triton if logits.is_cuda and triton is not None else apply_penalties_ref
    return fn(logits, counts, rows, in_prompt, pending, sampled, rep, freq, pres)


def warmup_penalties(vocab: int, device):
    """Compiles the kernel at start-up (a penalised request mid-run would wait for it): one row
    of the model's vocabulary, the width whose divisibility the compile specialises on."""
    logits, counts = torch.zeros(1, vocab, device=device), torch.zeros(1, vocab, dtype=torch.int32, device=device)
    idx, ones = torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, device=device)
    apply_penalties(logits, counts, idx, None, idx, idx, ones, ones - 1, ones - 1)
