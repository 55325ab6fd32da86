"""FP8 KV accuracy on CPU (docs/fp8_kv.md): the static bounds against the largest |k|, |v| seen,
and the teacher-forced logprob error of the FP8-KV engine against the fp32 one.

    PYTHONPATH=. python3 benchmarks/fp8_kv_accuracy.py [--long 3072]
"""
import argparse
import json
import tempfile
from pathlib import Path

import torch

from asynct import LLM, SamplingParams
from asynct.model.checkpoint import make_checkpoint
from asynct.model.kv_scales import bound_to_scale, layer_bounds, observed_kv_max

TASKS = Path(__file__).resolve().parents[1] / "asynct/integrations/tasks/tiny_gsm"


def tiny_gsm_texts(n):
    rows = [json.loads(line) for line in open(TASKS / "test.jsonl")][:n]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]


def random_prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 256), (length,), generator=g).tolist() for _ in range(n)]


def bound_report(name, llm, prompts):
    """Rows of (layer, k: bound/max overall, v: bound/max overall, v: median per-channel ratio)."""
    model = llm.llm_engine.runner.model
    rows = []
    for i, (k_max, v_max) in enumerate(observed_kv_max(llm, prompts)):
        kb, vb = layer_bounds(model, i)
        per_ch = (vb / v_max.clamp_min(1e-12)).flatten()
        rows.append(dict(model=name, layer=i, k_ratio=float(kb.max() / k_max.max()),
                         k_ratio_ch_median=float((kb / k_max.clamp_min(1e-12)).median()),
                         v_ratio=float(vb.max() / v_max.max()),
                         v_ratio_ch_median=float(per_ch.median()), v_ratio_ch_max=float(per_ch.max()),
                         v_max=float(v_max.max()), v_bound=float(vb.max())))
    return rows


def prompt_logprobs(llm, prompts):
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [torch.tensor([next(iter(e.values())).logprob for e in o.prompt_logprobs if e])
            for o in outs]


def logprob_error(ref, test):
    d = torch.cat([(a - b).abs() for a, b in zip(ref, test)])
    nll_ref = -torch.cat(ref).mean()
    nll_test = -torch.cat(test).mean()
    return dict(tokens=d.numel(), mean_abs=float(d.mean()), p99_abs=float(d.quantile(0.99)),
                max_abs=float(d.max()), nll_ref=float(nll_ref), nll_rel_diff=float((nll_test - nll_ref) / nll_ref))


def engines(path, **kw):
    common = dict(dtype="float32", attention_backend="torch", max_num_seqs=32, **kw)
    return LLM(str(path), **common), LLM(str(path), kv_cache_dtype="fp8", **common)


def schemes(model, observed):
    """Per layer (k_scale, v_scale) of each static scheme compared: the weight bounds per
    channel (shipped), the bounds' max per layer (coarser), and calibrated per-channel amax
    (what the bound gives up, measured on the evaluated prompts themselves: optimistic)."""
    out = {"bound": [], "bound-per-layer": [], "amax-calibrated": []}
    for i, (k_max, v_max) in enumerate(observed):
        kb, vb = layer_bounds(model, i)
        out["bound"].append((kb, vb))
        out["bound-per-layer"].append((kb.max().expand_as(kb), vb.max().expand_as(vb)))
        out["amax-calibrated"].append((k_max, v_max))
    return out


def set_scales(model, pairs):
    for layer, (kb, vb) in zip(model.layers, pairs):
        layer.attn.impl.k_scale, layer.attn.impl.v_scale = bound_to_scale(kb), bound_to_scale(vb)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--long", type=int, default=3072, help="tokens of the long random prompts")
    p.add_argument("--presets", default="tiny,small")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    cases = [("tiny-gsm", Path(__file__).resolve().parents[1] / "models/tiny-gsm", None)]
    for preset in a.presets.split(","):
        cases.append((preset, make_checkpoint(preset, tmp / preset, seed=0, max_position_embeddings=4096), preset))
    for name, path, preset in cases:
        ref, fp8 = engines(path)
        vocab = ref.llm_engine.config.vocab_size
        short = tiny_gsm_texts(64) if preset is None else random_prompts(32, 256, vocab)
        for row in bound_report(name, ref, short):
            print(json.dumps(row))
        sets = [("short", short)]
        if a.long and preset:      # tiny-gsm knows 2,048 positions and was trained on 768
            sets.append((f"long{a.long}", random_prompts(2, a.long, vocab, seed=1)))
        model = fp8.llm_engine.runner.model
        for scheme, pairs in schemes(model, observed_kv_max(ref, [x for _, ps in sets for x in ps])).items():
            set_scales(model, pairs)
            for label, prompts in sets:
                err = logprob_error(prompt_logprobs(ref, prompts), prompt_logprobs(fp8, prompts))
                print(json.dumps(dict(model=name, scheme=scheme, prompts=label, **err)))


if __name__ == "__main__":
    main()
