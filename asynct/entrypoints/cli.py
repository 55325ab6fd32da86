"""The `asynct` command: make-checkpoint, generate, demo (and serve, eval, bench as they land)."""
import argparse
import json
import sys


def add_engine_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--attention-backend", default="auto")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")


def engine_kwargs(a) -> dict:
    keys = ("dtype", "device", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "gpu_memory_utilization", "attention_backend", "enforce_eager", "enable_prefix_caching")
    return {k: getattr(a, k) for k in keys}


def cmd_make_checkpoint(a):
    from asynct.model.checkpoint import make_checkpoint
    out = make_checkpoint(a.preset, a.out, seed=a.seed, dtype=a.dtype, max_shard_size=a.max_shard_size)
    print(f"wrote a random-weight {a.preset!r} checkpoint to {out}")


def cmd_generate(a):
    from asynct import LLM, SamplingParams
    llm = LLM(a.model, **engine_kwargs(a))
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                            seed=a.seed, stop=a.stop or None)
    prompts = a.prompt or [line.rstrip("\n") for line in sys.stdin]
    for out in llm.generate(prompts, params, use_tqdm=False):
        if out.error:
            print(f"error: {out.error}", file=sys.stderr)
        elif a.json:
            print(json.dumps({"prompt": out.prompt, "text": out.outputs[0].text,
                              "finish_reason": out.outputs[0].finish_reason}))
        else:
            print(out.prompt + out.outputs[0].text)


def cmd_demo(a):
    """The README's main job: the shipped trained model answers a question (a random tiny
    checkpoint stands in where none is shipped)."""
    from asynct.entrypoints.demo import run_demo
    run_demo(a.model)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asynct", description="Fast inference for AsyncT models")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint of a named preset")
    m.add_argument("out")
    m.add_argument("--preset", default="tiny")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default=None)
    m.add_argument("--max-shard-size", default=None)
    m.set_defaults(fn=cmd_make_checkpoint)
    g = sub.add_parser("generate", help="generate text from prompts (arguments or stdin lines)")
    g.add_argument("model")
    g.add_argument("--prompt", action="append")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--json", action="store_true")
    add_engine_args(g)
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="set-up check: generate with a shipped or freshly made model")
    d.add_argument("--model", default=None)
    d.set_defaults(fn=cmd_demo)
    for name, module in (("serve", "asynct.entrypoints.serve"), ("eval", "asynct.integrations.lm_eval_cli"),
                         ("bench", "asynct.entrypoints.bench")):
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
        args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"asynct {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
