"""The `asynct` command: make-checkpoint, generate, demo, serve, eval, bench.

Only argparse and plain data are imported to build the parser, so `asynct --help` and argument
errors come back at once; each command imports what it needs when it runs."""
import argparse
import json
import logging
import sys
from contextlib import contextmanager

from asynct.presets import PRESETS

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's --dtype also takes half and float (EngineArgs resolves them): its command lines run here
ENGINE_DTYPES = (*DTYPES, "half", "float")
# the attention backends the engine registers (asynct/attention), named here to keep --help light
ATTENTION_BACKENDS = ("auto", "triton", "torch")
CUDAGRAPH_MODES = ("full_and_piecewise", "full_decode_only", "none")   # EngineArgs checks the same
# `asynct generate`'s sampling where neither a flag nor the model's generation config sets a value
GENERATE_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 64}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every flag's help; descriptions and epilogs keep their line breaks. A help that
    names its own default, a default of None and an off-switch (`--no-prefix-caching`, whose
    stored default True read as the flag being on) get no "(default: ...)" added."""

    def _get_help_string(self, action):
        if (action.default is None or "(default" in (action.help or "")
                or isinstance(action, argparse._StoreFalseAction)):
            return action.help
        return super()._get_help_string(action)


def add_engine_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=ENGINE_DTYPES,
                   help="compute dtype (half: float16, float: float32, as vLLM's); auto: the checkpoint's "
                        "on a GPU, float32 on the CPU")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a folder holding the tokenizer files (default: the checkpoint's)")
    g.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when there is one)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens in one engine step")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default and most: the checkpoint's max_position_embeddings)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights, activations and the KV cache")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: triton on a GPU, torch elsewhere")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cudagraph-mode", default="full_and_piecewise", choices=CUDAGRAPH_MODES,
                   help="full graphs for decode steps and piecewise graphs (attention eager) for "
                        "steps with prefill tokens, or decode graphs only")
    # vLLM's spellings too: --enable-prefix-caching (the default) and --no-enable-prefix-caching
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help=argparse.SUPPRESS)
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="do not reuse the KV cache of shared prompt prefixes")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="finish each step before scheduling the next (debugging, comparisons)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="fp8: e4m3 KV cache, static scales from the weights (docs/fp8_kv.md)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine processes, one per GPU, each with the whole model (docs/serving.md)")
    g.add_argument("--generation-config", default="auto",
                   help="auto: the model's generation_config.json gives sampling defaults and EOS ids; "
                        "vllm: asynct's own defaults; or a folder holding such a file")
    g.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                   help='sampling defaults over the file\'s, e.g. \'{"temperature": 0.5}\'')


def engine_kwargs(a) -> dict:
    keys = ("dtype", "tokenizer", "device", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "gpu_memory_utilization", "attention_backend", "enforce_eager", "cudagraph_mode", "enable_prefix_caching",
            "async_scheduling", "kv_cache_dtype", "data_parallel_size", "generation_config",
            "override_generation_config")
    return {k: getattr(a, k) for k in keys}


def cmd_make_checkpoint(a):
    from asynct.model.checkpoint import make_checkpoint
    out = make_checkpoint(a.preset, a.out, seed=a.seed, dtype=a.dtype, max_shard_size=a.max_shard_size)
    print(f"wrote a random-weight {a.preset!r} checkpoint to {out}")


def cmd_generate(a):
    from asynct import LLM, SamplingParams
    prompts = read_prompts(a)
    llm = LLM(a.model, **engine_kwargs(a))
    # flags left unset: the generation config's values, else the command's own defaults
    given = {k: getattr(a, k) for k in ("temperature", "top_p", "top_k", "max_tokens") if getattr(a, k) is not None}
    params = SamplingParams(**{**GENERATE_DEFAULTS, **llm.default_sampling_params, **given},
                            seed=a.seed, stop=a.stop or None)
    with _quiet_request_failures():
        outs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outs, 1):
        if out.error:
            print(f"error: {_prompt_label(i, out)}: {out.error}", file=sys.stderr)
        elif a.json:
            print(json.dumps({"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
                              "text": out.outputs[0].text, "token_ids": list(out.outputs[0].token_ids),
                              "finish_reason": out.outputs[0].finish_reason}))
        elif out.prompt is None:  # token ids in: the text, or token ids where there is no tokenizer
            print(out.outputs[0].text or " ".join(map(str, out.outputs[0].token_ids)))
        else:
            print(out.prompt + out.outputs[0].text)
    return 1 if any(out.error for out in outs) else 0     # a script sees that a prompt failed


@contextmanager
def _quiet_request_failures():
    """The engine logs a failed request under its request id, and the command then said the
    same again: here only the command's line, which names the prompt, says it."""
    from asynct.engine.request_failure import FAILED_REQUEST
    logger = logging.getLogger("asynct")

    def quiet(record: logging.LogRecord) -> bool:
        return not hasattr(record, FAILED_REQUEST)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _prompt_label(i: int, out) -> str:
    """A prompt as the user can find it: its place among the outputs and its start."""
    shown = repr(out.prompt) if out.prompt is not None else "token ids " + ",".join(map(str, out.prompt_token_ids))
    return f"prompt {i} ({shown if len(shown) <= 40 else shown[:37] + '...'})"


def read_prompts(a) -> list:
    """--prompt and --prompt-token-ids, each repeatable; without either, all of stdin is one prompt."""
    prompts = list(a.prompt or []) + [{"prompt_token_ids": ids} for ids in a.prompt_token_ids or []]
    if not prompts:
        if sys.stdin.isatty():
            print("reading one prompt from stdin (end with Ctrl-D)", file=sys.stderr)
        prompts = [sys.stdin.read()]
    return prompts


def json_object(s: str) -> dict:
    try:
        value = json.loads(s)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{s!r} is not a JSON object such as '{{\"temperature\": 0.5}}'")
    return value


def json_list(s: str) -> list[str]:
    """vLLM's JSON list of strings ('["*"]'), or one bare string (an origin, a method)."""
    try:
        value = json.loads(s) if s.lstrip().startswith("[") else [s]
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"{s!r} is not a JSON list of strings such as '[\"*\"]'")
    return value


def token_ids(s: str) -> list[int]:
    try:
        ids = [int(t) for t in s.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a list of token ids such as 1,2,3") from None
    if not ids:
        raise argparse.ArgumentTypeError("an empty list of token ids")
    return ids


def cmd_demo(a):
    """The README's main job: the shipped trained model answers a question (a random tiny
    checkpoint stands in where none is shipped)."""
    from asynct.entrypoints.demo import run_demo
    run_demo(a.model)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asynct", description="Fast inference for AsyncT models",
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint of a named preset",
                       formatter_class=HelpFormatter)
    m.add_argument("out", help="directory to write (made if missing)")
    m.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape (asynct/presets.py)")
    m.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    m.add_argument("--dtype", default=None, choices=DTYPES[1:], help="weights dtype (default: the preset's)")
    m.add_argument("--max-shard-size", default=None, help='shard the weights, e.g. "200MB" (default: one file)')
    m.set_defaults(fn=cmd_make_checkpoint)
    g = sub.add_parser("generate", help="generate from prompts (text, token ids, or all of stdin as one prompt)",
                       formatter_class=HelpFormatter,
                       epilog="several prompts: repeat --prompt / --prompt-token-ids; without either, "
                              "stdin is read to its end as one prompt")
    g.add_argument("model", help="checkpoint directory")
    g.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    g.add_argument("--prompt-token-ids", action="append", type=token_ids, metavar="IDS",
                   help="a prompt as token ids, e.g. 1,2,3 (repeatable; needs no tokenizer)")
    # unset, these take the model's generation config's values (--generation-config), else GENERATE_DEFAULTS
    g.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per prompt (default: the generation config's max_new_tokens, else 64)")
    g.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (default: the generation config's, else 0)")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass (default: the generation config's, else 1.0)")
    g.add_argument("--top-k", type=int, default=None, help="0: no top-k cut (default: the generation config's, else 0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, with token ids")
    add_engine_args(g)
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="set-up check: the shipped trained model answers three questions",
                       formatter_class=HelpFormatter)
    d.add_argument("--model", default=None, help="checkpoint directory (default: the shipped tiny-gsm)")
    d.set_defaults(fn=cmd_demo)
    for name, module in (("serve", "asynct.entrypoints.serve"), ("eval", "asynct.integrations.lm_eval_cli"),
                         ("bench", "asynct.entrypoints.bench_cli")):
        add_optional(sub, name, module)
    return p


def add_optional(sub, name, module):
    """Subcommands whose modules may need extras (serve, eval); they add their own arguments."""
    try:
        mod = __import__(module, fromlist=["add_parser"])
    except ImportError:
        return
    if hasattr(mod, "add_parser"):
        mod.add_parser(sub)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:  # lm-eval's own command line parses the rest
        from asynct.integrations.lm_eval_cli import main as eval_main
        return eval_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        status = args.fn(args)
    except (ValueError, OSError) as e:   # OSError: any path the user gave (exists, not a directory, no access)
        print(f"asynct {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from asynct.engine.core_client import EngineDeadError   # here: the CLI starts without torch
        if not isinstance(e, EngineDeadError):
            raise
        print(f"asynct {args.command}: error: {e}", file=sys.stderr)
        return 1
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
