"""`asynct serve MODEL_DIR`: an OpenAI-compatible HTTP server (FastAPI + uvicorn). Only argparse
lives here, so `asynct --help` works without the serving extras installed."""
import os
from pathlib import Path

from asynct.entrypoints.serve.limits import ServerLimits


def add_parser(sub):
    from asynct.entrypoints.cli import HelpFormatter, add_engine_args
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
                       formatter_class=HelpFormatter)
    # vLLM's `serve --model DIR` too (its positional form is newer)
    p.add_argument("model", metavar="MODEL_DIR", nargs="?")
    p.add_argument("--model", dest="model_flag", metavar="MODEL_DIR", default=None, help="MODEL_DIR, as a flag")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port, 0-65535")
    # vLLM's VLLM_API_KEY too: a deployment moved from `vllm serve` with it set served with no key at all
    p.add_argument("--api-key", default=os.environ.get("ASYNCT_API_KEY") or os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and tokenizer routes (default: env ASYNCT_API_KEY, "
                        "else env VLLM_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model ids clients may send; responses name the first (default: MODEL_DIR)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, in place of the tokenizer's")
    p.add_argument("--seed", type=int, default=None,
                   help="seeds the engine's sampling: requests without a seed of their own draw from it")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="1: an engine runs on one GPU (tensor parallelism: vLLM with asynct's plugin, docs/vllm.md)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; asynct checkpoints run no code of their own")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="sequences (prompts x n) that may wait beyond the running batch (--max-num-seqs); "
                        "more get 429 (default: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger bodies get 413 (default: 16 MiB)")
    add_limit_args(p)
    add_cors_args(p)
    p.add_argument("--log-level", default="info", help="asynct's log level")
    p.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: --log-level)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput line (it comes every 10 s while requests run)")
    p.add_argument("--access-log", action="store_true", help="log every request (slows heavy load)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the client's own where it sent one (vLLM's); "
                        "a completion's id takes the client's either way")
    add_engine_args(p)
    p.set_defaults(fn=cmd_serve)
    return p


def model_dir(a) -> str:
    """MODEL_DIR, given once: as the positional or as --model."""
    if a.model and a.model_flag and a.model != a.model_flag:
        raise ValueError(f"two models given: {a.model} and --model {a.model_flag}")
    names = a.served_model_name or []
    if not (a.model or a.model_flag) and len(names) > 1 and Path(names[-1], "config.json").exists():
        # `--served-model-name NAME MODEL_DIR` ran while the flag took one name; taking several
        # (vLLM's), it reads the path as a name: a checkpoint is no name
        a.model = names.pop()
    if not (a.model or a.model_flag):
        eaten = f" (--served-model-name took {' '.join(names)} as names)" if names else ""
        raise ValueError("no model: give MODEL_DIR (or --model MODEL_DIR)" + eaten)
    return a.model or a.model_flag


def port(s: str) -> int:
    """A TCP port: beyond 65535 the resolver wraps it silently (99999 served on 34463 while the
    log said 99999)."""
    import argparse
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a port number") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"port {n} is outside 0-65535")
    return n


def add_limit_args(p):
    d = ServerLimits()
    g = p.add_argument_group("limits (docs/serving.md)")
    g.add_argument("--max-n", type=int, default=d.max_n, help="most completions one request may ask for")
    g.add_argument("--max-choices", type=int, default=d.max_choices,
                   help="most choices (prompts x n) one request may ask for")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer text prompts get 400 before tokenising (default: the most characters "
                        "max_model_len tokens can spell)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chat templates sent in requests (chat_template, chat_template_kwargs.chat_template)")
    g.add_argument("--render-timeout", type=float, default=d.render_timeout,
                   help="seconds to tokenise a prompt or render a chat template; then 400")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a connection has to send a request's headers; then it is closed")
    g.add_argument("--keep-alive-timeout", type=int, default=d.keep_alive_timeout,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections; more are closed at once")
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help="stop strings one request may give; more get 400")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="most logprobs / top_logprobs / prompt_logprobs a request may ask for, as vLLM's "
                        "(-1: the vocabulary)")


def add_cors_args(p):
    from asynct.entrypoints.cli import json_list
    g = p.add_argument_group("CORS: web pages of other origins calling the API from a browser")
    # opt-in, where vLLM allows every origin: any page a user of this machine opens could then
    # read the server's answers (it listens on loopback by default, behind no key)
    g.add_argument("--allowed-origins", type=json_list, default=None, metavar="JSON",
                   help='origins whose pages may call the API, as vLLM\'s JSON list: \'["*"]\' for any '
                        '(default: none, no CORS headers; vLLM\'s default is any)')
    g.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON",
                   help="HTTP methods those pages may use (default: any)")
    g.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON",
                   help="request headers those pages may send (default: any)")
    g.add_argument("--allow-credentials", action="store_true", help="let those pages send cookies")


def cors_options(a) -> dict | None:
    """Starlette's CORSMiddleware options, or None where no origin is allowed."""
    if a.allowed_origins is None:
        return None
    return dict(allow_origins=a.allowed_origins, allow_methods=a.allowed_methods,
                allow_headers=a.allowed_headers, allow_credentials=a.allow_credentials)


def server_limits(a):
    return ServerLimits(a.max_n, a.max_choices, a.max_prompt_chars, a.trust_request_chat_template, a.render_timeout,
                        a.header_timeout, a.keep_alive_timeout, a.max_connections, a.max_stop_strings,
                        a.max_logprobs)


def cmd_serve(a):
    import contextlib
    import logging

    import uvicorn

    from asynct.entrypoints.cli import engine_kwargs
    from asynct.entrypoints.serve.api_server import Server, make_app
    from asynct.entrypoints.serve.launch import connection_options, listen_socket
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.max_queued_requests is not None and a.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    with listen_socket(a.host, a.port) as sock:
        app = make_app(model_dir(a), a.served_model_name, a.api_key, a.max_queued_requests, a.max_request_bytes,
                       limits=server_limits(a), chat_template=a.chat_template,
                       log_stats_interval=None if a.disable_log_stats else 10.0, seed=a.seed,
                       tensor_parallel_size=a.tensor_parallel_size, trust_remote_code=a.trust_remote_code,
                       cors=cors_options(a), request_id_headers=a.enable_request_id_headers, **engine_kwargs(a))
        config = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.uvicorn_log_level or a.log_level,
                                access_log=a.access_log, timeout_graceful_shutdown=5, **connection_options(app))
        server = Server(config)
        # uvicorn says where it listens only on a socket it bound itself
        host = f"[{a.host}]" if ":" in a.host else a.host
        logging.getLogger("asynct.serve").info("serving on http://%s:%d", host, sock.getsockname()[1])
        with contextlib.suppress(KeyboardInterrupt):    # uvicorn re-raises the Ctrl-C it shut down on
            server.run(sockets=[sock])
    return 0 if server.started else 3      # uvicorn's exit status for a failed start-up
