"""`asynct eval`: lm-evaluation-harness's own command line (`lm-eval run | ls | validate`) with
the `asynct` model registered and the shipped tasks indexed.

Every `lm_eval` flag works as in `lm_eval`; what differs, and why:
- `--model` defaults to `asynct` and `pretrained` to the shipped model; `--model DIR` is short
  for `--model asynct --model_args pretrained=DIR` (a directory is never a registered model name);
- `--device` defaults to the engine's choice (a GPU if there is one), not lm-eval's cuda:0;
- `--tasks` defaults to `tiny_gsm,tiny_gsm_mc`;
- only the shipped tasks and `--include_path` are indexed: lm-eval's ~15k built-in tasks cost 5 s
  to index and their data comes from the Hugging Face hub; `--include_defaults` adds them;
- the hub is off (HF_HUB_OFFLINE=1) unless the environment says otherwise or the command asks
  for it (`--include_defaults`, `--hf_hub_log_args`);
- a line after the tables splits the run's wall time into engine start, generation and scoring,
  and lm-eval's own work.

    asynct eval --model asynct --model_args pretrained=models/tiny-gsm --tasks tiny_gsm --limit 100
"""
import argparse
import logging
import functools
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from asynct.data import SHIPPED_MODEL

DEFAULT_TASKS = ["tiny_gsm", "tiny_gsm_mc"]
_HUB_FLAGS = ("--include_defaults", "--hf_hub_log_args")
EXAMPLES = """examples:
  asynct eval --model asynct --model_args pretrained=models/tiny-gsm,dtype=float32 --tasks tiny_gsm --limit 100
  asynct eval --model models/tiny-gsm --tasks tiny_gsm_mc --output_path out --log_samples
  asynct eval ls tasks
  asynct eval --include_defaults --tasks gsm8k --num_fewshot 5
engine options go in --model_args (max_num_seqs=64,max_model_len=1024,attention_backend=torch,...);
--batch_size is accepted and ignored: the engine batches everything."""


def add_parser(sub):
    """A stub for `asynct --help`: `asynct eval ...` goes to `main` before asynct's parser."""
    sub.add_parser("eval", add_help=False, help="lm-evaluation-harness's CLI with the engine as model "
                   "`asynct` (all lm_eval flags; `asynct eval --help`)")


def main(argv: list[str]) -> int:
    if not any(a.split("=")[0] in _HUB_FLAGS for a in argv):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the shipped tasks and models are local
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError:
        print("asynct eval: error: needs lm-evaluation-harness: pip install 'asynct[eval]'", file=sys.stderr)
        return 2
    import asynct.integrations.lm_eval  # noqa: F401  (registers the model `asynct`)
    setup_logging()
    logging.getLogger("lm_eval.api.task").addFilter(_not_custom_dataset_advice)
    cli = HarnessCLI()
    args = parse_args(cli, argv)
    include_defaults = args.__dict__.pop("include_defaults", False)
    cache_prompt_templates()
    quiet_git_hash()
    t0 = time.perf_counter()
    try:
        with shipped_tasks(include_defaults):
            cli.execute(args)
    except ConnectionError as e:  # what `datasets` raises for data it cannot fetch
        return _fail(_explain_offline(e))
    except (ValueError, FileNotFoundError) as e:
        return _fail(_explain_missing_tasks(str(e)) if "Tasks not found" in str(e) else str(e))
    if args.command == "run":
        print_timing(time.perf_counter() - t0)
    return 0


def parse_args(cli, argv: list[str]) -> argparse.Namespace:
    """lm-eval's parse (with its legacy rule: no subcommand means `run`), then asynct's defaults."""
    subs = cli._subparsers.choices
    run = subs["run"]
    run.prog, run.usage, run.epilog = "asynct eval [run]", None, EXAMPLES
    run.description = "lm-eval's `run` with the engine as model `asynct`, the shipped tasks indexed and the hub off."
    run._option_string_actions["--model"].help = "lm-eval model name, or a checkpoint directory (default: asynct)"
    run._option_string_actions["--tasks"].help += f" (default: {','.join(DEFAULT_TASKS)})"
    run.add_argument("--include_defaults", action="store_true",
                     help="also index lm-eval's built-in tasks (their data comes from the Hugging Face hub)")
    if not argv or argv[0] not in subs and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    elif argv[0] in ("-h", "--help"):
        argv = ["run", "--help"]
    args = cli._parser.parse_args(argv)
    if args.command == "run":
        _model_defaults(args)
    return args


def _model_defaults(args):
    from lm_eval.api.registry import MODEL_REGISTRY
    model_args = args.model_args or {}
    if args.model and args.model not in MODEL_REGISTRY and Path(args.model).is_dir():
        model_args, args.model = {"pretrained": args.model, **model_args}, "asynct"
    elif args.model and args.model not in MODEL_REGISTRY and "/" in args.model:
        # a mistyped checkpoint path got lm-eval's "no model for this name found!" and its ~40 model names
        what = "a file, not a checkpoint directory" if Path(args.model).exists() else \
            "no such checkpoint directory, and no lm-eval model of that name (asynct loads local checkpoints only)"
        raise SystemExit(_fail(f"--model {args.model}: {what}"))
    args.model = args.model or "asynct"
    if args.model == "asynct":
        model_args.setdefault("pretrained", str(SHIPPED_MODEL))
        _one_device(args, model_args)
    args.model_args = model_args
    args.tasks = args.tasks or DEFAULT_TASKS


def _one_device(args, model_args: dict):
    """lm-eval passes its --device (default cuda:0) beside model_args, so a device in model_args
    was its TypeError ("multiple values for keyword argument"): it becomes --device. Without
    either, the engine picks (a GPU where there is one)."""
    if "device" in model_args:
        device = str(model_args.pop("device"))
        if args.device and args.device != device:
            raise SystemExit(_fail(f"the device is given twice: --device {args.device} and --model_args "
                                   f"device={device}; give one"))
        args.device = device
    args.device = args.device or "auto"


def task_manager(include_path=None, include_defaults: bool = False, metadata=None, **kw):
    """lm-eval's TaskManager over the shipped tasks, `include_path` and, with `include_defaults`,
    lm-eval's built-in tasks."""
    from lm_eval.tasks.manager import TaskManager  # the class, also while `shipped_tasks` is on

    from asynct.integrations.tasks import TASKS_DIR
    extra = include_path if isinstance(include_path, list) else [include_path] if include_path else []
    return TaskManager(include_path=[str(TASKS_DIR), *extra], include_defaults=include_defaults,
                       metadata=metadata, **kw)


@contextmanager
def shipped_tasks(include_defaults: bool):
    """lm-eval's commands build `lm_eval.tasks.TaskManager(include_path=...)` themselves; for the
    command's duration that name builds ours."""
    import lm_eval.tasks
    original = lm_eval.tasks.TaskManager
    lm_eval.tasks.TaskManager = functools.partial(task_manager, include_defaults=include_defaults)
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = original


def cache_prompt_templates():
    """lm-eval 0.4.13 compiles a task's Jinja templates anew for every document it renders
    (EleutherAI/lm-evaluation-harness#1286): 17k compilations, 7 s of CPU, for gsm8k's 1,319
    5-shot contexts. A template string always compiles to the same template, so compiling each
    once changes no prompt."""
    from lm_eval import utils
    if not hasattr(utils.env.from_string, "cache_info"):
        utils.env.from_string = functools.lru_cache(maxsize=1024)(utils.env.from_string)


def quiet_git_hash():
    """lm-eval records `git describe` of the working directory, and outside a repository git
    prints `fatal: not a git repository` to the terminal; the same lookup without that."""
    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_hash():
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())
    evaluator.get_git_commit_hash = git_hash


def print_timing(seconds: float):
    from asynct.engine.llm_engine import startup_text
    from asynct.integrations.lm_eval import AsyncTLM
    lm = AsyncTLM.latest
    if lm is None:  # another lm-eval model ran
        return
    load, engine = lm.timings["load"], lm.timings["engine"]
    startup = startup_text(lm.llm.llm_engine.startup_seconds)
    tokens = lm.prompt_tokens
    print(f"asynct eval: {seconds:.1f} s: engine start {load:.1f} s ({startup}), generation and scoring "
          f"{engine:.1f} s, lm-eval's own work {seconds - load - engine:.1f} s; prompt tokens "
          f"{tokens['total']}, {tokens['cached']} of them from the prefix cache")


def _not_custom_dataset_advice(record: logging.LogRecord) -> bool:
    """lm-eval warns on every task that loads its data with a `custom_dataset` function (as the
    shipped ones do, to find their files next to the YAML) that such a function takes --metadata
    kwargs: advice for task authors, not a problem of the run."""
    return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def _explain_missing_tasks(msg: str) -> str:
    from asynct.integrations.tasks import TASKS_DIR
    shipped = sorted(p.stem for p in TASKS_DIR.glob("*/*.yaml"))
    return (f"{msg}. asynct eval indexes its shipped tasks ({', '.join(shipped)}) and --include_path; "
            "--include_defaults adds lm-eval's built-in tasks, whose data is downloaded from the Hugging Face hub")


def _explain_offline(e: Exception) -> str:
    return (f"a task's dataset cannot be downloaded here ({type(e).__name__}: {e}). Without network only "
            "local data works: the shipped tasks, or task YAMLs with local data_files via --include_path")


def _fail(msg: str) -> int:
    print(f"asynct eval: error: {msg}", file=sys.stderr)
    return 2
