"""lm-eval's scoring requests through `AsyncTLM`, without lm-eval's task machinery: multiple-choice
`loglikelihood` (questions x 4 choices after one shared few-shot prefix: arc_easy's shape) and
`loglikelihood_rolling` (perplexity documents, one window each), wall per round and a checksum
of the scores, so that a peer tree (its `asynct` first on PYTHONPATH) can be compared.

    PYTHONPATH=. python3 benchmarks/loglikelihood_bench.py --model /tmp/bench-0.6b-tok    # GPU
    PYTHONPATH=. python3 benchmarks/loglikelihood_bench.py --model CKPT --questions 8 --docs 2 --words 60   # CPU smoke

The checkpoint needs a tokenizer (`make_checkpoint('bench-0.6b', DIR, tokenizer=True)`)."""
import argparse
import random
import time

import torch
from lm_eval.api.instance import Instance

from asynct.integrations.lm_eval import AsyncTLM

WORDS = "the of and to in is was for on that with as by at from his her they one two three".split()


def requests(questions: int, docs: int, words: int, seed: int = 0):
    rng = random.Random(seed)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    shots = text(300)
    pairs = [Instance("loglikelihood", {}, (f"{shots}\n\nQuestion: {text(40)}\nAnswer:", " " + text(rng.randint(1, 6))), 0)
             for _ in range(questions) for _ in range(4)]
    rolling = [Instance("loglikelihood_rolling", {}, (text(words),), 0) for _ in range(docs)]
    return pairs, rolling


def timed(fn, reqs) -> tuple[float, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn(reqs, disable_tqdm=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t, sum(o[0] if isinstance(o, tuple) else o for o in out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--questions", type=int, default=500)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--words", type=int, default=2000, help="words a rolling document")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    a = ap.parse_args()
    t0 = time.perf_counter()
    lm = AsyncTLM(a.model, max_num_seqs=256, gpu_memory_utilization=a.gpu_memory_utilization)
    print(f"start {time.perf_counter() - t0:.1f} s, max_length {lm.max_length}")
    pairs, rolling = requests(a.questions, a.docs, a.words)
    for name, fn, reqs in (("mc", lm.loglikelihood, pairs), ("rolling", lm.loglikelihood_rolling, rolling)):
        for r in range(a.rounds):
            seconds, total = timed(fn, reqs)
            print(f"{name} round {r}: {len(reqs)} requests {seconds:.3f} s, score sum {total:.2f}")


if __name__ == "__main__":
    main()
