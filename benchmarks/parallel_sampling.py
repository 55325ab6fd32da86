"""Parallel sampling (pass@k, RL rollouts, self-consistency): requests of n samples each, every
sample's prompt shared. The engine admits a request's samples in one step, the first computes the
prompt and the others share its blocks in that step, so a round computes each prompt about once,
not n times. Prints the wall time, the prompt positions the engine computed, and the output rate a
round, so that a peer tree (its `asynct` first on PYTHONPATH) can be compared in the same run.

    PYTHONPATH=. python3 benchmarks/parallel_sampling.py --model /tmp/bench-0.6b              # GPU
    PYTHONPATH=. python3 benchmarks/parallel_sampling.py --preset tiny --requests 4 --prompt-len 60 --max-tokens 8   # CPU"""
import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

import asynct
from asynct import LLM, SamplingParams
from asynct.model.checkpoint import make_checkpoint


def round_(llm, prompts, params) -> dict:
    stats = llm.llm_engine.stats
    before = stats["prompt_tokens"]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"wall_s": wall, "prompt_positions": stats["prompt_tokens"] - before, "output_tokens": tokens,
            "output_tok_s": tokens / wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--preset", default="bench-0.6b", help="a checkpoint made for the run where --model is not given")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="asynct-ps-") as tmp:
        model = a.model or make_checkpoint(a.preset, Path(tmp) / a.preset, tokenizer=False)
        kw = {"gpu_memory_utilization": a.gpu_memory_utilization} if torch.cuda.is_available() else {"device": "cpu"}
        t0 = time.perf_counter()
        llm = LLM(str(model), max_num_seqs=256, **kw)
        print(f"asynct from {Path(asynct.__file__).parent}; start {time.perf_counter() - t0:.1f} s", flush=True)
        rng = random.Random(0)
        vocab = llm.llm_engine.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.requests)]
        params = [SamplingParams(n=a.n, temperature=1.0, seed=i, max_tokens=a.max_tokens, ignore_eos=True)
                  for i in range(a.requests)]
        print(f"{a.requests} requests x n={a.n}, prompts of {a.prompt_len} tokens, {a.max_tokens} new")
        for r in range(a.rounds):
            # a fresh prompt set each round: the last round's blocks would serve this one's prompts
            shifted = [[(t + r) % vocab for t in p] for p in prompts]
            res = round_(llm, shifted, params)
            print(f"round {r}: {res['wall_s']:.3f} s, prompt positions computed {res['prompt_positions']}, "
                  f"{res['output_tokens']} tokens, {res['output_tok_s']:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
