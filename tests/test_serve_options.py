"""`asynct serve`'s vLLM-shaped flags: --chat-template (file or inline), --seed,
--tensor-parallel-size, --trust-remote-code, --uvicorn-log-level, --disable-log-stats, CORS,
--max-logprobs, --enable-request-id-headers; chat `tools` through the template, and the fields it
cannot honour refused by name."""
import json

import httpx
import pytest

from asynct import LLM, SamplingParams
from asynct.entrypoints.cli import build_parser, main
from asynct.entrypoints.serve import cors_options, model_dir, server_limits
from asynct.entrypoints.serve.limits import ServerLimits
from asynct.entrypoints.serve.api_server import make_app
from asynct.entrypoints.serve.launch import ServerThread

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def test_flags_parse():
    a = build_parser().parse_args(["serve", "DIR", "--chat-template", "t.jinja", "--seed", "3", "-tp", "1",
                                   "--trust-remote-code", "--uvicorn-log-level", "warning", "--disable-log-stats",
                                   "--served-model-name", "m", "m2", "--no-enable-prefix-caching"])
    assert (a.chat_template, a.seed, a.tensor_parallel_size, a.trust_remote_code, a.uvicorn_log_level,
            a.disable_log_stats, a.served_model_name, a.enable_prefix_caching) == \
        ("t.jinja", 3, 1, True, "warning", True, ["m", "m2"], False)
    a = build_parser().parse_args(["serve", "DIR"])
    assert (a.chat_template, a.seed, a.tensor_parallel_size, a.uvicorn_log_level) == (None, None, 1, None)
    assert (model_dir(a), a.enable_prefix_caching) == ("DIR", True)
    # vLLM's command lines: `serve --model DIR`, --enable-prefix-caching (the default)
    a = build_parser().parse_args(["serve", "--model", "DIR", "--enable-prefix-caching"])
    assert (model_dir(a), a.enable_prefix_caching) == ("DIR", True)


def test_a_model_given_twice_or_never_is_one_error(capsys, tiny_ckpt):
    assert main(["serve", "A", "--model", "B"]) == 2
    assert "asynct serve: error: two models given: A and --model B" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "asynct serve: error: no model: give MODEL_DIR (or --model MODEL_DIR)\n" in capsys.readouterr().err
    assert main(["serve", "--served-model-name", "m", "DIR"]) == 2      # DIR is no checkpoint: a name
    assert "no model: give MODEL_DIR (or --model MODEL_DIR) (--served-model-name took m DIR as names)" in \
        capsys.readouterr().err
    # the form that ran while --served-model-name took one name: a checkpoint after it is the model
    a = build_parser().parse_args(["serve", "--served-model-name", "m", str(tiny_ckpt)])
    assert (model_dir(a), a.served_model_name) == (str(tiny_ckpt), ["m"])


def test_bad_values_fail_before_the_engine_starts(tiny_ckpt, tmp_path, capsys):
    assert main(["serve", str(tiny_ckpt), "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "asynct serve: error: tensor_parallel_size=2: an asynct engine runs on one GPU" in err
    assert "docs/vllm.md" in err
    assert main(["serve", str(tiny_ckpt), "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "looks like a file path, but it cannot be read" in capsys.readouterr().err


def test_a_port_in_use_fails_before_the_model_loads(tiny_ckpt, capsys, monkeypatch):
    """A second server on a busy port loaded its model first (minutes on a GPU) and only then
    failed, at uvicorn's bind."""
    import socket

    from asynct.entrypoints.serve import api_server
    monkeypatch.setattr(api_server, "make_app", lambda *a, **k: pytest.fail("the model loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tiny_ckpt), "--port", str(port)]) == 2
    assert f"asynct serve: error: cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err


def test_ctrl_c_stops_the_server_with_status_0(tiny_ckpt):
    """uvicorn re-raises the Ctrl-C it has shut down on: the command must not end in a
    KeyboardInterrupt traceback."""
    import signal

    from asynct.entrypoints.serve.launch import ServerProcess
    # started as a background job, this process ignores SIGINT, and so would the server
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server = ServerProcess(tiny_ckpt, "--disable-log-stats", timeout=120)
        server.__enter__()
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.__exit__()


def test_chat_template_file_and_seed(tiny_ckpt, tmp_path):
    f = tmp_path / "chat.jinja"
    f.write_text(TEMPLATE)
    app = make_app(tiny_ckpt, served_model_name=["tiny", "alias"], chat_template=str(f), seed=0,
                   trust_remote_code=True, log_stats_interval=None)
    with ServerThread(app) as url:
        # vLLM's several served names: each listed and taken, responses name the first
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["tiny", "alias"]
        msgs = [{"role": "user", "content": "hi"}]
        r = httpx.post(url + "/tokenize", json={"messages": msgs}).json()
        assert bytes(r["tokens"]).decode() == "<user>hi<assistant>"     # the byte-level tokenizer
        assert httpx.get(url + "/tokenizer_info").json()["chat_template"] == TEMPLATE
        body = {"messages": msgs, "max_tokens": 4, "temperature": 0, "model": "alias"}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert (r.status_code, r.json()["model"]) == (200, "tiny")
        r = httpx.post(url + "/v1/chat/completions", json={**body, "model": "other"})   # named the first alone
        assert r.json()["error"]["message"] == "the model 'other' does not exist; this server serves 'tiny' or 'alias'"



def test_cors_flags_parse():
    a = build_parser().parse_args(["serve", "DIR", "--allowed-origins", '["https://a.example", "http://b:3000"]',
                                   "--allowed-methods", "POST", "--allow-credentials"])
    assert cors_options(a) == dict(allow_origins=["https://a.example", "http://b:3000"], allow_methods=["POST"],
                                   allow_headers=["*"], allow_credentials=True)
    assert cors_options(build_parser().parse_args(["serve", "DIR"])) is None


def test_cors_answers_a_browser_preflight_before_the_api_key(tiny_ckpt):
    """vLLM's --allowed-origins: a page of an allowed origin calls the API from a browser (its
    preflight carries no key), other origins get no CORS headers, and without the flag none do."""
    app = make_app(tiny_ckpt, api_key="k", cors=dict(allow_origins=["http://ui.example"], allow_methods=["*"],
                                                     allow_headers=["*"], allow_credentials=False),
                   log_stats_interval=None)
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with ServerThread(app) as url:
        r = httpx.options(url + "/v1/completions", headers=preflight)
        assert (r.status_code, r.headers["access-control-allow-origin"]) == (200, "http://ui.example")
        body = {"prompt": "hi", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=body, headers={"Origin": "http://ui.example"})
        assert (r.status_code, r.headers["access-control-allow-origin"]) == (401, "http://ui.example")
        r = httpx.post(url + "/v1/completions", json=body, timeout=60,
                       headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
        assert (r.status_code, r.headers["access-control-allow-origin"]) == (200, "http://ui.example")
        r = httpx.options(url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    # with --enable-request-id-headers every response carries X-Request-Id, a preflight's too
    app = make_app(tiny_ckpt, cors=dict(allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                                        allow_credentials=False), request_id_headers=True, log_stats_interval=None)
    with ServerThread(app) as url:
        r = httpx.options(url + "/v1/completions", headers={**preflight, "X-Request-Id": "p1"})
        assert (r.status_code, r.headers.get("x-request-id")) == (200, "p1")
    app = make_app(tiny_ckpt, log_stats_interval=None)
    with ServerThread(app) as url:
        r = httpx.get(url + "/v1/models", headers={"Origin": "http://ui.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_max_logprobs_is_the_servers_cap(tiny_ckpt):
    """vLLM's --max-logprobs (its command lines failed to parse): logprobs, top_logprobs and
    prompt_logprobs up to it, a 400 naming the field past it."""
    assert build_parser().parse_args(["serve", "DIR"]).max_logprobs == 20
    assert server_limits(build_parser().parse_args(["serve", "DIR", "--max-logprobs", "30"])).max_logprobs == 30
    app = make_app(tiny_ckpt, limits=ServerLimits(max_logprobs=30), log_stats_interval=None)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True}
    with ServerThread(app) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 30}, timeout=60)
        assert r.status_code == 200, r.text     # its top_logprobs are keyed by text: byte tokens collide
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "top_logprobs": 30}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 30
        for path, body, param in (("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 31}, "logprobs"),
                                  ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "prompt_logprobs": 31},
                                   "prompt_logprobs"),
                                  ("/v1/chat/completions", {**chat, "top_logprobs": 31}, "top_logprobs")):
            r = httpx.post(url + path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "(--max-logprobs)" in r.json()["error"]["message"]


def test_request_id_headers_as_vllms(tiny_ckpt):
    """vLLM's X-Request-Id: a completion's id takes the client's, and --enable-request-id-headers
    puts it (or a new one) on every response; two requests may send the same one."""
    assert build_parser().parse_args(["serve", "DIR", "--enable-request-id-headers"]).enable_request_id_headers
    app = make_app(tiny_ckpt, request_id_headers=True, log_stats_interval=None)
    body = {"prompt": "hi", "max_tokens": 2}
    with ServerThread(app) as url:
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-7"}, timeout=60)
            assert (r.json()["id"], r.headers["x-request-id"]) == ("cmpl-trace-7", "trace-7")
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "t8"}) as r:
            assert r.headers["x-request-id"] == "t8"
            assert all(json.loads(line[6:])["id"] == "chatcmpl-t8" for line in r.iter_lines()
                       if line.startswith("data: {"))
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert len(r.headers["x-request-id"]) == 32 and r.json()["id"].startswith("cmpl-")
        # a client (or a proxy appending its own) sending two: the header echoed is the one the id took
        r = httpx.post(url + "/v1/completions", json=body, headers=[("X-Request-Id", "a"), ("X-Request-Id", "b")],
                       timeout=60)
        assert (r.json()["id"], r.headers.get_list("x-request-id")) == ("cmpl-a", ["a"])
        assert httpx.get(url + "/health").headers["x-request-id"]


def test_minus_one_logprobs_through_the_server_are_the_whole_vocabulary(tiny_ckpt):
    """With --max-logprobs -1 a request's -1 asks for every token's logprob (docs/serving.md):
    top_logprobs -1 gave all but the last (a [:-1] slice), prompt_logprobs -1 and echo's rows of
    logprobs -1 only the prompt's own token (rank <= -1), and beside another k the engine
    computed that k (max(-1, k))."""
    app = make_app(tiny_ckpt, limits=ServerLimits(max_logprobs=-1), log_stats_interval=None)
    vocab = json.loads((tiny_ckpt / "config.json").read_text())["vocab_size"]
    with ServerThread(app) as url:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True,
                "top_logprobs": -1}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == vocab
        for lp, plp in ((None, -1), (2, -1)):
            body = {"prompt": "hello", "max_tokens": 1, "prompt_logprobs": plp, "logprobs": lp, "echo": lp is not None}
            rows = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
            assert {len(e) for e in rows[1:]} == {vocab}, (body, [len(e) for e in rows[1:]])
        for plp in (None, 2):    # echo's prompt rows as its generated row: every token (keyed by text)
            body = {"prompt": "hello", "max_tokens": 1, "logprobs": -1, "echo": True, "prompt_logprobs": plp}
            top = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
            assert {len(t) for t in top["top_logprobs"][1:]} == {len(top["top_logprobs"][-1])} != {1}, body


@pytest.mark.parametrize("k,cap,refused", [(20, 20, False), (21, 20, True), (-1, 20, True), (None, 0, False),
                                            (0, 0, False), (10**6, -1, False), (-1, -1, False)])
def test_check_logprobs_as_vllms_server(k, cap, refused):
    """A request's -1 is the whole vocabulary: past any cap but --max-logprobs -1's."""
    from asynct.entrypoints.serve.protocol import Unsupported, check_logprobs
    if refused:
        with pytest.raises(Unsupported, match=f"top_logprobs must be at most {cap}"):
            check_logprobs("top_logprobs", k, cap)
    else:
        check_logprobs("top_logprobs", k, cap)


TOOLS_TEMPLATE = TEMPLATE + "{% for t in tools or [] %}<tool>{{ t.function.name }}{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_chat_tools_reach_the_template_and_unhonoured_fields_are_400(tiny_ckpt):
    """`tools` is rendered by the chat template as LLM.chat renders it (the server dropped it);
    response_format other than text is refused with a 400 that names the field (it was ignored:
    no guided decoding)."""
    msgs = [{"role": "user", "content": "hi"}]
    want = LLM(tiny_ckpt).chat(msgs, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=TOOLS_TEMPLATE,
                               tools=TOOLS)[0].prompt_token_ids
    assert bytes(want).decode() == "<user>hi<assistant><tool>get_weather"
    app = make_app(tiny_ckpt, served_model_name="tiny", chat_template=TOOLS_TEMPLATE, log_stats_interval=None)
    body = {"messages": msgs, "max_tokens": 1, "temperature": 0}
    with ServerThread(app) as url:
        def chat(**extra):
            return httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert chat().json()["usage"]["prompt_tokens"] == len("<user>hi<assistant>")
        assert chat(tools=TOOLS, tool_choice="none").json()["usage"]["prompt_tokens"] == len(want)
        tokenized = httpx.post(url + "/tokenize", json={"messages": msgs, "tools": TOOLS}, timeout=60).json()
        assert tokenized["tokens"] == want            # /tokenize renders a chat as the chat route does
        assert chat(response_format={"type": "text"}, repetition_penalty=1.0).status_code == 200
        for field, value in [("response_format", {"type": "json_object"}),
                             ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})]:
            for path, extra in (("/v1/chat/completions", body), ("/v1/completions", {"prompt": "hi"})):
                r = httpx.post(url + path, json={**extra, field: value}, timeout=60)
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == field and field in err["message"], r.text
                assert err["type"] == "invalid_request_error"
        assert chat(tools=[{"type": "function"}], tool_choice="none").status_code == 400    # a tool needs its function


# vLLM's request fields that change the output, with a value asynct cannot apply and their no-op
VLLM_UNAPPLIED = [
    ("use_beam_search", True, False),
    ("logprob_token_ids", [65], None),
    ("structured_outputs", {"choice": ["a", "b"]}, None), ("guided_json", {"type": "object"}, None),
    ("guided_regex", "a+", None), ("guided_choice", ["a", "b"], None), ("guided_grammar", "root ::= 'a'", None),
    ("return_tokens_as_token_ids", True, False), ("priority", 1, 0), ("thinking_token_budget", 4, -1),
    ("repetition_detection", {"max_pattern_size": 2, "min_count": 2}, None),
]


def test_vllm_fields_asynct_cannot_apply_are_400(tiny_ckpt):
    """Each was an unknown field, dropped: the answer came as if it had not been sent (no
    prompt_logprobs, logprob tokens as text...).
    At vLLM's no-op value it is still accepted."""
    app = make_app(tiny_ckpt, served_model_name="tiny", chat_template=TEMPLATE, log_stats_interval=None)
    bodies = {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}
    with ServerThread(app) as url:
        for path, body in bodies.items():
            body = {**body, "max_tokens": 1, "temperature": 0}
            noop = {field: value for field, _, value in VLLM_UNAPPLIED}
            assert httpx.post(url + path, json={**body, **noop}, timeout=60).status_code == 200
            for field, value, _ in VLLM_UNAPPLIED:
                r = httpx.post(url + path, json={**body, field: value}, timeout=60)
                assert r.status_code == 400, (path, field, r.text)
                err = r.json()["error"]
                assert err["param"] == field and field in err["message"], r.text


def test_chat_documents_reach_the_template(tiny_ckpt):
    """vLLM's `documents` (RAG) are the template's, as `tools` are; the field was dropped, so the
    prompt lacked them; chat_template_kwargs' own `documents` win, as vLLM's."""
    template = TEMPLATE + "{% for d in documents or [] %}<doc>{{ d.text }}{% endfor %}"
    app = make_app(tiny_ckpt, served_model_name="tiny", chat_template=template, log_stats_interval=None)
    msgs = [{"role": "user", "content": "hi"}]
    docs = [{"title": "t", "text": "abc"}]
    with ServerThread(app) as url:
        def tokens(**extra):
            return bytes(httpx.post(url + "/tokenize", json={"messages": msgs, **extra}, timeout=60).json()["tokens"])
        assert tokens(documents=docs).decode() == "<user>hi<assistant><doc>abc"
        assert tokens(documents=docs, chat_template_kwargs={"documents": [{"text": "x"}]}).decode().endswith("<doc>x")
        body = {"messages": msgs, "max_tokens": 1, "temperature": 0, "documents": docs}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        assert r["usage"]["prompt_tokens"] == len("<user>hi<assistant><doc>abc")
