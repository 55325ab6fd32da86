"""`asynct serve MODEL_DIR`: an OpenAI-compatible HTTP server (FastAPI + uvicorn). Only argparse
lives here, so `asynct --help` works without the serving extras installed."""
import os


def add_parser(sub):
    from asynct.entrypoints.cli import add_engine_args
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    p.add_argument("model", metavar="MODEL_DIR")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("ASYNCT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and tokenizer routes (env ASYNCT_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL_DIR)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests that may wait beyond the running batch (--max-num-seqs); more get 429 "
                        "(default: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    p.add_argument("--log-level", default="info")
    p.add_argument("--access-log", action="store_true", help="log every request (slows heavy load)")
    add_engine_args(p)
    p.set_defaults(fn=cmd_serve)
    return p


def cmd_serve(a):
    import logging

    import uvicorn

    from asynct.entrypoints.cli import engine_kwargs
    from asynct.entrypoints.serve.api_server import make_app
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.max_queued_requests is not None and a.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    app = make_app(a.model, a.served_model_name, a.api_key, a.max_queued_requests, a.max_request_bytes,
                   **engine_kwargs(a))
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, access_log=a.access_log,
                timeout_graceful_shutdown=5)
