"""The server under load: ≥ 200 concurrent streams, a fifth of them leaving early, each of the rest
getting exactly its text alone (greedy); then nothing running and every KV block free. Also the
queue limit (429), clients that hang up at each point of a response, and the `asynct serve`
command itself."""
import asyncio
import json
import os
import random
import re
import signal
import time

import httpx
import pytest
import torch

from asynct import LLM, SamplingParams
from asynct.engine.llm_engine import LLMEngine
from asynct.entrypoints.serve.api_server import make_app
from asynct.entrypoints.serve.launch import ServerProcess, ServerThread
from asynct.model.checkpoint import make_checkpoint

NUM_REQUESTS, NUM_PROMPTS, MAX_TOKENS = 240, 20, 24


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    # a small KV pool, so that the load also preempts and recomputes
    app = make_app(tiny_ckpt, served_model_name="tiny", num_kv_blocks=400)
    with ServerThread(app) as url:
        yield url


def metrics(url) -> dict:
    return metrics_of(httpx.get(url + "/metrics").text)


def metrics_of(text: str) -> dict:
    return {m[1]: float(m[2]) for m in re.finditer(r"^asynct_(\w+)\{[^}]*\} (\S+)$", text, re.M)}


def wait_idle(url, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m["num_requests_running"] == m["num_requests_waiting"] == m["num_requests_in_flight"] == 0
        if (idle and m["kv_blocks_free"] == m["kv_blocks_total"]) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


async def stream_one(client, url, prompt, max_tokens, leave_after=None):
    """Streams one completion; with `leave_after`, hangs up after that many chunks."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": leave_after is not None}      # those that leave must still be running then
    text, chunks, done, finish = "", 0, False, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return None
    assert done and finish in ("length", "stop")
    return text


async def run_load(url, prompts, plan):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:
        return await asyncio.gather(*(stream_one(client, url, prompts[p], MAX_TOKENS if leave is None else 400,
                                                 leave) for p, leave in plan))


def test_load_with_disconnects(server, tiny_ckpt):
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.ABCDEFGHIJ0123456789é€"
    prompts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(3, 80))) for _ in range(NUM_PROMPTS)]
    llm = LLM(tiny_ckpt, num_kv_blocks=400)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].text for p in prompts]
    leaving = set(rng.sample(range(NUM_REQUESTS), NUM_REQUESTS // 5))
    plan = [(i % NUM_PROMPTS, rng.randint(1, 4) if i in leaving else None) for i in range(NUM_REQUESTS)]
    before = metrics(server)
    t0 = time.perf_counter()
    texts = asyncio.run(run_load(server, prompts, plan))
    elapsed = time.perf_counter() - t0
    mismatched = [i for i, ((p, leave), t) in enumerate(zip(plan, texts)) if leave is None and t != alone[p]]
    after = wait_idle(server)
    print(f"\n{NUM_REQUESTS} streams in {elapsed:.1f} s, {len(leaving)} left early, {len(mismatched)} mismatched, "
          f"preemptions {after['num_preemptions_total'] - before['num_preemptions_total']:.0f}, "
          f"blocks free {after['kv_blocks_free']:.0f}/{after['kv_blocks_total']:.0f}")
    assert not mismatched, [(texts[i], alone[plan[i][0]]) for i in mismatched[:3]]
    assert after["num_requests_running"] == after["num_requests_waiting"] == after["num_requests_in_flight"] == 0
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    assert after["requests_aborted_total"] - before["requests_aborted_total"] == len(leaving)


def test_disconnect_frees_blocks_at_once(server):
    """A stream that would run for thousands of steps: hanging up must abort it right away."""
    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream_one(client, server, "a long one " * 20, 1800, leave_after=2)
    before = metrics(server)
    t0 = time.perf_counter()
    asyncio.run(go())
    after = wait_idle(server, timeout=3.0)
    assert time.perf_counter() - t0 < 3.0
    assert after["kv_blocks_free"] == after["kv_blocks_total"] and after["num_requests_running"] == 0
    assert after["requests_aborted_total"] == before["requests_aborted_total"] + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 400


def test_non_streaming_disconnect_aborts(server):
    """A client that times out on a plain (non-streaming) request also frees its request."""
    before = metrics(server)
    body = {"model": "tiny", "prompt": "wait for me", "max_tokens": 1800, "temperature": 0, "ignore_eos": True}
    # an H200 makes the 1,800 tokens in ~0.4 s: the client leaves well before that there
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, timeout=0.05 if torch.cuda.is_available() else 0.5)
    after = wait_idle(server, timeout=3.0)
    assert after["kv_blocks_free"] == after["kv_blocks_total"] and after["num_requests_in_flight"] == 0
    assert after["requests_aborted_total"] == before["requests_aborted_total"] + 1


@pytest.fixture(scope="module")
def asgi(tiny_ckpt):
    """The app driven over ASGI in this thread, so that a test plays a client that leaves at an
    exact point of the response: (app, the loop it runs on)."""
    app = make_app(tiny_ckpt, served_model_name="tiny", log_stats_interval=None, num_kv_blocks=400)
    loop, life = asyncio.new_event_loop(), app.router.lifespan_context(app)
    loop.run_until_complete(life.__aenter__())
    yield app, loop
    loop.run_until_complete(life.__aexit__(None, None, None))
    loop.close()


def test_the_api_process_freezes_its_startup_heap(asgi):
    """The API process holds torch, transformers and FastAPI (some 416,000 objects: a full
    collection took 195 ms on a 2-core CPU, stalling every stream); once the app is built they
    are frozen out of the collector's sight while its engine lives (startup_heap.owners; the
    test harness unfreezes between tests on a GPU, conftest.py)."""
    from asynct.engine import startup_heap
    app, _ = asgi
    assert app.state.ctx.engine in startup_heap.owners()


def test_a_dropped_app_frees_its_engine(asgi, tiny_ckpt):
    """An app dropped once its server has stopped frees its engine, even with the heap still frozen
    for another (the `asgi` app's): FastAPI keeps every endpoint, which held the engine; the app's
    cycles, frozen with the heap, held it; so did its engine processes' callbacks. The engine and
    the frozen heap lived for the rest of the process, and its render threads idled on."""
    import gc
    import weakref
    from asynct.engine import startup_heap
    live = len(startup_heap.owners())
    app = make_app(tiny_ckpt, served_model_name="tiny", num_kv_blocks=400)
    with ServerThread(app) as url:
        body = {"model": "tiny", "prompt": "bye", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        workers = list(app.state.ctx.workers.threads)
    for t in workers:       # the app's render threads end with its server, not idle for good
        t.join(timeout=10)
    assert workers and not any(t.is_alive() for t in workers)
    engine = weakref.ref(app.state.ctx.engine)
    assert engine() in startup_heap.owners()
    del app
    gc.collect()
    assert engine() is None and len(startup_heap.owners()) == live and gc.get_freeze_count() > 10_000


async def leave_at(app, path, body, message_type, stuck):
    """POSTs `body`; the client goes away once the app writes a `message_type` message (None: at
    once). `stuck`: that write never completes (a client that stopped reading)."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    gone, sent, read = asyncio.Event(), [], False
    if message_type is None:
        gone.set()

    async def receive():
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg["type"])
        if msg["type"] == message_type:
            gone.set()
            if stuck:
                await asyncio.Event().wait()

    await app(scope, receive, send)
    return sent


async def engine_idle(engine, timeout=60.0):
    deadline = time.monotonic() + timeout
    while engine.num_in_flight or engine.snapshot["running"] or engine.snapshot["waiting"]:
        assert time.monotonic() < deadline, "the engine still runs the request"
        await asyncio.sleep(0.02)


LEAVING = [  # (how the client leaves, stream, the message whose write it leaves at, that write never completes)
    ("before the stream starts", True, "http.response.start", True),
    ("while a chunk is written", True, "http.response.body", True),
    ("while the next chunk is generated", True, "http.response.body", False),
    ("during a non-streamed request", False, None, False),
]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("how,stream,message_type,stuck", LEAVING, ids=[w[0] for w in LEAVING])
def test_client_that_leaves_aborts_its_request(asgi, path, n, how, stream, message_type, stuck):
    """However the client goes, its engine request is aborted, not run to max_tokens for nobody:
    a client gone while the headers were written had its stream cancelled before the chunks'
    generator started, whose `finally` was then never run, and the request ran on."""
    app, loop = asgi
    engine = app.state.ctx.engine
    prompt = {"prompt": "nobody reads this"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "nobody reads this"}]}
    body = {"model": "tiny", **prompt, "n": n, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    aborted, generated = engine.num_aborted, engine.snapshot["generation_tokens"]
    sent = loop.run_until_complete(leave_at(app, path, body, message_type, stuck))
    assert (message_type or "http.response.start") in sent
    loop.run_until_complete(engine_idle(engine))
    assert engine.num_aborted == aborted + 1, how
    assert engine.snapshot["generation_tokens"] - generated < 1000 * n


def test_queue_limit_429(tiny_ckpt):
    """One sequence at a time and one queued: a third request gets 429, and so does a second of
    n=2 (sequences count, as the engine counts them); below the limit all finish. A request larger
    than the batch and the queue together gets 400 (a 429 had it retry for good)."""
    app = make_app(tiny_ckpt, served_model_name="tiny", max_num_seqs=1, max_queued_requests=1, num_kv_blocks=400)
    body = {"model": "tiny", "prompt": "hold the line", "temperature": 0, "max_tokens": 4}

    async def until(client, url, key, value):
        while metrics_of((await client.get(url + "/metrics")).text)[key] < value:
            await asyncio.sleep(0.01)

    async def go(url):
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url + "/v1/completions",
                                     json={**body, "max_tokens": 1800, "stream": True, "ignore_eos": True}) as long:
                lines = long.aiter_lines()     # kept: a dropped iterator closes the response
                await anext(lines)             # running now, and it holds the only slot
                await until(client, url, "num_requests_running", 1)
                doubled = await client.post(url + "/v1/completions", json={**body, "n": 2, "temperature": 1})
                assert doubled.status_code == 429, doubled.text     # 1 + 2 sequences, past the 2 taken
                queued = asyncio.create_task(client.post(url + "/v1/completions", json=body))
                await until(client, url, "num_requests_in_flight", 2)
                refused = await client.post(url + "/v1/completions", json=body)
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["type"] == "rate_limit_error"
            # hanging up on the long one lets the queued one run
            assert (await queued).status_code == 200
            ok = await client.post(url + "/v1/completions", json=body)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            for big, param in (({"prompt": ["a", "b", "c"]}, "prompt"), ({"n": 3, "temperature": 1}, "n")):
                r = await client.post(url + "/v1/completions", json={**body, **big})
                assert r.status_code == 400 and "takes at most 2 at once" in r.json()["error"]["message"], r.text
                assert r.json()["error"]["param"] == param

    with ServerThread(app) as url:
        asyncio.run(go(url))
        m = wait_idle(url)
        assert m["kv_blocks_free"] == m["kv_blocks_total"] and m["requests_aborted_total"] == 1


def test_cli_serves_a_checkpoint_without_tokenizer(tmp_path):
    """`asynct serve` as users run it, on a checkpoint with no tokenizer: token-id prompts work,
    text prompts and chat get a clear 400."""
    ckpt = make_checkpoint("tiny", tmp_path / "notok", seed=2, tokenizer=False)
    server = ServerProcess(ckpt, "--served-model-name", "m", "--api-key", "secret", timeout=120)
    with server as url:
        auth = {"Authorization": "Bearer secret"}
        models = httpx.get(url + "/v1/models", headers=auth).json()
        assert models["data"][0]["id"] == "m"
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "return_token_ids": True}
        r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ref = LLM(ckpt, num_kv_blocks=400).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
        assert choice["token_ids"] == ref.outputs[0].token_ids
        for path, bad in (("/v1/completions", {"model": "m", "prompt": "text"}),
                          ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})):
            r = httpx.post(url + path, json=bad, headers=auth)
            assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        assert httpx.get(url + "/health").status_code == 200
    # SIGTERM ends it by itself (uvicorn re-raises the signal after shutting down), no SIGKILL needed
    assert server.proc.returncode in (0, -signal.SIGTERM)


class FlakyEngine(LLMEngine):
    """Its third step raises; built inside the engine process (so defined at module level)."""

    def step(self):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("injected")
        return super().step()


def test_engine_failure_fails_requests_not_the_server(tiny_ckpt):
    """A step that raises (a bug, not bad input) answers the requests it held with a 500 and
    frees their blocks; the next request is served."""
    app = make_app(tiny_ckpt, served_model_name="tiny", make_engine=FlakyEngine, num_kv_blocks=400)
    body = {"model": "tiny", "prompt": "boom", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with ServerThread(app) as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        lines = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=30).text.splitlines()
        assert lines[-2] == "data: [DONE]" and json.loads(lines[-4][6:])["choices"][0]["finish_reason"] == "length"
        m = wait_idle(url)
        assert m["kv_blocks_free"] == m["kv_blocks_total"] and m["num_requests_in_flight"] == 0


def test_engine_process_death_is_reported(tiny_ckpt):
    """The engine process killed under a running stream: the stream ends with an error event, and
    the server stays up answering /health and new requests with 503 and the reason."""
    app = make_app(tiny_ckpt, served_model_name="tiny", num_kv_blocks=400)
    body = {"model": "tiny", "prompt": "doomed", "max_tokens": 1800, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with ServerThread(app) as url:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(app.state.ctx.engine.engines[0].client.proc.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "engine process exited" in rest[-2]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "engine process exited" in health.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False})
        assert r.status_code == 503 and "restart the server" in r.json()["error"]["message"]


class SlowEngine(LLMEngine):
    """Each step takes 20 ms more: a long request outlasts any graceful shutdown."""

    def step(self):
        time.sleep(0.02)
        return super().step()


def shut_down_under_a_stream(ckpt, max_tokens, signal_engine=False):
    """Streams `max_tokens` from a SlowEngine, then shuts the server down as its SIGTERM does
    (and, with signal_engine, SIGTERMs the engine process first, as a process group's signal
    does); returns the stream's remaining lines, the seconds they took and the app."""
    app = make_app(ckpt, served_model_name="tiny", make_engine=SlowEngine, log_stats_interval=None, num_kv_blocks=400)
    body = {"model": "tiny", "prompt": "long", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    server = ServerThread(app)
    with server as url:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            if signal_engine:
                os.kill(app.state.ctx.engine.engines[0].client.proc.pid, signal.SIGTERM)
            server.server.should_exit = True      # what uvicorn's signal handler does
            start = time.monotonic()
            rest = [line for line in lines if line]
            took = time.monotonic() - start
    return rest, took, app


def test_shutdown_ends_a_running_stream_with_an_error_event(tiny_ckpt):
    """SIGTERM or Ctrl-C under a stream that outlasts the graceful timeout: the stream ends with
    an error event and [DONE] (uvicorn cancelled its task: the connection was cut mid-stream, a
    CancelledError traceback in the log), soon, and the engine process is gone after."""
    rest, took, app = shut_down_under_a_stream(tiny_ckpt, 1800)
    assert rest[-1] == "data: [DONE]" and "the server is shutting down" in rest[-2]
    assert took < 10      # the graceful timeout is 2 s; the stream alone runs ~40 s
    assert all(e.client.exited for e in app.state.ctx.engine.engines)


def test_sigterm_to_the_process_group_lets_running_requests_finish(tiny_ckpt):
    """`systemctl stop` (KillMode=control-group) and `kill -TERM -<pgid>` signal the engine process
    too: it ignored only SIGINT and died at once, failing the requests the server's graceful
    shutdown would have finished. A stream shorter than the graceful timeout now completes."""
    rest, _, app = shut_down_under_a_stream(tiny_ckpt, 30, signal_engine=True)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length", rest[-2]
    assert all(e.client.exited for e in app.state.ctx.engine.engines)


def test_one_engine_hashes_no_prefix_keys(server, monkeypatch):
    """The prefix keys route requests between data-parallel engines: with one, hashing every block
    of each prompt (ms for a long one) held the event loop for nothing."""
    import asynct.entrypoints.serve.async_engine as async_engine

    def unexpected(*args):
        raise AssertionError("prefix keys hashed for a single engine")
    monkeypatch.setattr(async_engine, "prefix_keys", unexpected)
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "x" * 64, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
