"""`asynct eval`: lm-evaluation-harness through the engine.

lm-eval's own CLI cannot import models from outside lm-eval, so this wraps `simple_evaluate`
with the `asynct` backend. By default only the shipped local tasks are indexed (indexing
lm-eval's ~15k built-in tasks costs seconds and they need the hub for their data anyway).

    asynct eval --model models/tiny-gsm --tasks tiny_gsm,tiny_gsm_mc --limit 100
"""
import argparse
import functools
import json
import os
import time
from pathlib import Path

SHIPPED_MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-gsm"


def add_parser(sub):
    from asynct.entrypoints.cli import add_engine_args
    p = sub.add_parser("eval", help="run lm-evaluation-harness tasks through the engine",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=str(SHIPPED_MODEL), help="checkpoint directory")
    p.add_argument("--tasks", default="tiny_gsm,tiny_gsm_mc", help="comma-separated task or tag names")
    p.add_argument("--num_fewshot", "--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    p.add_argument("--batch_size", "--batch-size", default=None,
                   help="accepted for lm-eval compatibility and ignored: the engine batches everything")
    p.add_argument("--max_gen_toks", "--max-gen-toks", type=int, default=256,
                   help="default for tasks that set none")
    p.add_argument("--output_path", "--output-path", default=None, help="write results (and samples) here")
    p.add_argument("--log_samples", "--log-samples", action="store_true")
    p.add_argument("--include_path", "--include-path", default=None,
                   help="more task YAMLs, in addition to the shipped ones")
    p.add_argument("--include_defaults", "--include-defaults", action="store_true",
                   help="also index lm-eval's built-in tasks (their data needs the hub)")
    p.add_argument("--apply_chat_template", "--apply-chat-template", action="store_true")
    p.add_argument("--gen_kwargs", "--gen-kwargs", default=None, help='e.g. "temperature=0.7,do_sample=True"')
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--verbose", action="store_true", help="print the run's wall time")
    add_engine_args(p)
    p.set_defaults(fn=cmd_eval)
    return p


def task_manager(include_path=None, include_defaults=False):
    from lm_eval.tasks import TaskManager

    from asynct.integrations.tasks import TASKS_DIR
    paths = [str(TASKS_DIR)] + ([include_path] if include_path else [])
    return TaskManager(include_path=paths, include_defaults=include_defaults)


def cache_prompt_templates():
    """lm-eval 0.4.13 compiles a task's Jinja templates anew for every document it renders
    (EleutherAI/lm-evaluation-harness#1286): 17k compilations, 7 s of CPU, for gsm8k's 1,319
    5-shot contexts. A template string always compiles to the same template, so compiling each
    once changes no prompt."""
    from lm_eval import utils
    if not hasattr(utils.env.from_string, "cache_info"):
        utils.env.from_string = functools.lru_cache(maxsize=1024)(utils.env.from_string)


def cmd_eval(a):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub anywhere: local models, local tasks
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import lm_eval
    except ImportError:
        raise ValueError("needs lm-evaluation-harness: pip install 'asynct[eval]'") from None
    from lm_eval.utils import make_table

    from asynct.entrypoints.cli import engine_kwargs
    from asynct.integrations.lm_eval import AsyncTLM
    cache_prompt_templates()
    t0 = time.perf_counter()
    lm = AsyncTLM(a.model, max_gen_toks=a.max_gen_toks, **engine_kwargs(a))
    limit = a.limit if a.limit is None or a.limit < 1 else int(a.limit)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=a.tasks.split(","), num_fewshot=a.num_fewshot, limit=limit,
        task_manager=task_manager(a.include_path, a.include_defaults), log_samples=a.log_samples,
        apply_chat_template=a.apply_chat_template, gen_kwargs=a.gen_kwargs,
        random_seed=a.seed, numpy_random_seed=a.seed, torch_random_seed=a.seed, fewshot_random_seed=a.seed)
    seconds = time.perf_counter() - t0
    if a.output_path:
        save(results, a.output_path)
    load, engine = lm.timings["load"], lm.timings["engine"]
    print(f"asynct ({a.model}), limit: {limit}, num_fewshot: {a.num_fewshot}, {seconds:.1f} s: "
          f"engine start {load:.1f} s ({_startup(lm)}), generation and scoring {engine:.1f} s, "
          f"lm-eval's own work {seconds - load - engine:.1f} s")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return results


def _startup(lm) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in lm.llm.llm_engine.startup_seconds.items())


def save(results, output_path):
    """results.json (lm-eval's aggregate) and, with --log_samples, samples_<task>.jsonl."""
    from lm_eval.utils import handle_non_serializable
    out = Path(output_path)
    out.mkdir(parents=True, exist_ok=True)
    samples = results.get("samples") or {}
    agg = {k: v for k, v in results.items() if k != "samples"}
    (out / "results.json").write_text(json.dumps(agg, indent=2, default=handle_non_serializable))
    for task, rows in samples.items():
        with open(out / f"samples_{task}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, default=handle_non_serializable) + "\n")
