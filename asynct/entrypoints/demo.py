"""`asynct demo`: the shipped trained model (or a fresh random tiny one) through the engine."""
import tempfile
import time
from pathlib import Path

from asynct.data import SHIPPED_MODEL as SHIPPED

# In the shipped model's training format (scripts/train_tiny.py): gsm8k's "Question: ...\nAnswer:".
QUESTIONS = ["Question: Tom has 3 apples and buys 4 more. How many apples does Tom have now?\nAnswer:",
             "Question: A box holds 9 pens. Sara takes 2 pens out. How many pens are left in the box?\nAnswer:",
             "Question: Mia has 4 boxes with 6 cookies in each box and finds 5 more cookies. "
             "How many cookies does Mia have?\nAnswer:"]


def run_demo(model=None):
    from asynct import LLM, SamplingParams
    from asynct.model.checkpoint import make_checkpoint
    if model is None and (SHIPPED / "config.json").exists():
        model = SHIPPED
    if model is None:
        model = make_checkpoint("tiny", Path(tempfile.mkdtemp()) / "tiny", seed=0)
        print(f"no shipped model found; made a random tiny checkpoint at {model}")
    llm = LLM(str(model))
    eng = llm.llm_engine
    name = "tiny-gsm (shipped)" if Path(model) == SHIPPED else model
    print(f"model {name}: device {eng.device}, dtype {eng.dtype}, backend {eng.runner.backend.name}, "
          f"{eng.block_manager.num_blocks} KV blocks")
    t0 = time.perf_counter()
    outs = llm.generate(QUESTIONS, SamplingParams(temperature=0, max_tokens=96, stop=["\n\n", "Question:"]),
                        use_tqdm=False)
    for out in outs:
        print("-" * 60 + f"\n{out.prompt}{out.outputs[0].text}")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("-" * 60 + f"\n{n} tokens in {time.perf_counter() - t0:.2f} s")
