"""What a rolling-loglikelihood step costs: peak GPU memory and seconds of prompt logprobs at every
position of full-budget prompts (lm-eval's `loglikelihood_rolling` asks for this), beside the
peak the engine profiled at start-up for its KV budget, and the KV blocks that budget left.

    PYTHONPATH=. python3 benchmarks/prompt_logprobs_memory.py MODEL [--tokens 8000] [--prompts 4]"""
import argparse
import time

import torch

from asynct import LLM, SamplingParams
from asynct.engine.runner_startup import RunnerStartup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--prompts", type=int, default=4)
    a = ap.parse_args()
    profiled, profile = [], RunnerStartup.profile_activation_memory
    RunnerStartup.profile_activation_memory = lambda self: profiled.append(profile(self)) or profiled[-1]
    llm = LLM(a.model, gpu_memory_utilization=0.45)
    vocab = llm.llm_engine.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (a.tokens,), generator=gen).tolist()}
               for _ in range(a.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    llm.generate(prompts[:1], params, use_tqdm=False)          # anything first-time, outside the timing
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    lp = sum(e[t].logprob for o, p in zip(outs, prompts)
             for e, t in zip(o.prompt_logprobs[1:], p["prompt_token_ids"][1:]))
    profiled_gib = profiled[0] / 2**30 if profiled else float("nan")   # none with num_kv_blocks given
    print(f"vocab {vocab}, {a.prompts} prompts x {a.tokens} tokens: {seconds:.3f} s, peak {peak / 2**30:.2f} GiB "
          f"over the engine's memory; profiled at start-up {profiled_gib:.2f} GiB; "
          f"KV blocks {llm.llm_engine.runner.num_kv_blocks}; sum of logprobs {lp:.4f}")


if __name__ == "__main__":
    main()
