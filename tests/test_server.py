"""`asynct serve` against the real `openai` client on a live loopback server (tiny checkpoint):
greedy output equals `LLM.generate`, streaming, chat, echo logprobs, tokenizer routes, and every
kind of bad input answered with an OpenAI-style error, each followed by a good request."""
import json
import math
import shutil

import httpx
import openai
import pytest

from asynct import LLM, SamplingParams
from asynct.entrypoints.serve.api_server import make_app
from asynct.entrypoints.serve.launch import ServerThread

# module-scoped engines live beside each test's own: on a GPU an engine takes its share of what
# is free, leaving the next none, so these get a fixed cache
SHARED = dict(num_kv_blocks=4096)

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = SamplingParams(temperature=0, max_tokens=16)
PROMPTS = ["Hello world", "The quick brown fox", "1 + 1 ="]


@pytest.fixture(scope="module")
def url(tiny_ckpt):
    app = make_app(tiny_ckpt, served_model_name="tiny", api_key=KEY, max_body_bytes=64 << 10, **SHARED)
    with ServerThread(app) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, **SHARED)


def ref(llm, prompt, params=GREEDY):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def post(url, body, path="/v1/completions", **kw):
    return httpx.post(url + path, json=body, headers=kw.pop("headers", AUTH), timeout=60, **kw)


def test_completions_equal_llm_generate(client, llm, tiny_ckpt):
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, r.choices):
        assert choice.text == ref(llm, prompt).outputs[0].text
        assert choice.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == sum(len(p.encode()) for p in PROMPTS)   # byte tokenizer
    ids = [72, 105, 33, 32, 104]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == ref(llm, ids).outputs[0].text
    # n samples with a seed: reproducible, and indexed prompt * n + sample
    kw = dict(model="tiny", prompt=PROMPTS[:2], max_tokens=8, temperature=1.0, n=2, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 4 <= a.usage.completion_tokens <= 4 * 8 and a.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])


def test_streaming_equals_llm_generate(client, llm):
    for prompt in PROMPTS:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        want = ref(llm, prompt).outputs[0]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    # stop strings cut the same place as in the engine
    # (the random model: outputs of these prompts with printable characters to stop at). A stop
    # string's first characters are held back while streaming: they must never reach the client.
    outs = {p: ref(llm, p, SamplingParams(temperature=0, max_tokens=32)).outputs[0].text
            for p in [*PROMPTS, "abc", "Once upon a time", "x = 1\n", "Hi!"]}
    cases = [(p, text[k:k + n]) for n in (1, 2) for p, text in outs.items() for k in range(3, len(text) - n)
             if all(ch.isascii() and ch.isprintable() for ch in text[k:k + n])]
    assert {len(stop) for _, stop in cases} == {1, 2}
    for prompt, stop in (cases[0], cases[-1]):
        params = SamplingParams(temperature=0, max_tokens=32, stop=[stop])
        for stream in (False, True):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0, stop=[stop],
                                          stream=stream)
            text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
            assert text == ref(llm, prompt, params).outputs[0].text


def test_min_tokens_keeps_an_early_stop_string(client, llm):
    """As vLLM: stop strings are not looked for in the first min_tokens tokens' text, which stays
    whole (streamed or not); the first stop string after it ends the output."""
    prompt, m = "1 + 1 =", 10
    whole = ref(llm, prompt, SamplingParams(temperature=0, max_tokens=32, min_tokens=m)).outputs[0]
    early = len(llm.get_tokenizer().decode(whole.token_ids[:m]))
    # a character of the early text that comes again later (the random model: "O")
    stop = next(ch for ch in whole.text[:early] if ch.isascii() and ch.isprintable() and ch in whole.text[early:])
    want = whole.text[:whole.text.index(stop, early)]
    kw = dict(model="tiny", prompt=prompt, max_tokens=32, temperature=0, stop=[stop], extra_body={"min_tokens": m})
    r = client.completions.create(**kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want


def test_stop_token_text_is_left_out(client, llm):
    """As vLLM: the stop_token_ids token that ends a completion is in its tokens, not its text,
    streamed or not (the stream's last chunk once decoded every token again)."""
    prompt = "1 + 1 ="
    base = ref(llm, prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)).outputs[0]
    tok = next(t for t in base.token_ids[3:] if 32 < t < 127)       # a printable byte
    ids = base.token_ids[:base.token_ids.index(tok) + 1]
    want = llm.get_tokenizer().decode(ids[:-1])
    kw = dict(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
              extra_body={"stop_token_ids": [tok], "ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw).choices[0]
    assert (r.text, r.token_ids, r.finish_reason, r.stop_reason) == (want, ids, "stop", tok)
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == want and sum((c.token_ids for c in chunks), []) == ids


def test_return_token_ids_as_vllm(client, llm):
    """vLLM's return_token_ids: the prompt's ids (completions: on each choice; chat: on the response)
    and each choice's generated ids; streamed, the prompt's come once (a completion choice's first
    chunk; chat: the chunk of each choice's role) and each chunk has its new ids."""
    kw = dict(model="tiny", max_tokens=6, temperature=0, n=2, extra_body={"return_token_ids": True})
    r = client.completions.create(prompt=PROMPTS[:2], **kw)
    wants = [ref(llm, p, SamplingParams(temperature=0, max_tokens=6)) for p in PROMPTS[:2]]
    for c in r.choices:
        want = wants[c.index // 2]
        assert (c.prompt_token_ids, c.token_ids) == (want.prompt_token_ids, want.outputs[0].token_ids)
    for c in range(4):
        chunks = [ch.choices[0] for ch in client.completions.create(prompt=PROMPTS[:2], stream=True, **kw)
                  if ch.choices and ch.choices[0].index == c]
        want = wants[c // 2]
        assert chunks[0].prompt_token_ids == want.prompt_token_ids
        assert all(getattr(ch, "prompt_token_ids", None) is None for ch in chunks[1:])
        assert sum((ch.token_ids for ch in chunks), []) == want.outputs[0].token_ids
    messages = [{"role": "user", "content": "Hi there"}]
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    want = ref(llm, ids, SamplingParams(temperature=0, max_tokens=6)).outputs[0]
    r = client.chat.completions.create(messages=messages, **kw)
    assert r.prompt_token_ids == ids and [c.token_ids for c in r.choices] == [want.token_ids] * 2
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    for c in range(2):
        mine = [ch for ch in chunks if ch.choices[0].index == c]
        assert mine[0].choices[0].delta.role == "assistant" and mine[0].prompt_token_ids == ids
        assert all(getattr(ch, "prompt_token_ids", None) is None for ch in mine[1:])
        assert sum((ch.choices[0].token_ids for ch in mine[1:]), []) == want.token_ids


def test_chat(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    want = ref(llm, ids).outputs[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)   # greedy = top-1


def test_null_n_stream_echo_logprobs_take_their_defaults(client):
    """OpenAI's API and vLLM's server take null for these: the client sends `n=None` as null, and
    code that passes its own None through got a 400 here."""
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=None, stream=None, echo=None,
                                  extra_body={"return_token_ids": None})
    assert len(r.choices) == 1 and not r.choices[0].text.startswith("Hi")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       n=None, stream=None, logprobs=None, extra_body={"return_token_ids": None})
    assert len(r.choices) == 1 and r.choices[0].logprobs is None


def test_echo_logprobs_equal_prompt_logprobs(url, llm):
    """lm-eval's loglikelihood request: max_tokens 1, logprobs 1, echo: the prompt's logprobs
    must be the engine's own (what every loglikelihood score is summed from)."""
    prompts = ["Question: 2 + 3 =\nAnswer: 5", [10, 20, 30, 40, 50, 60], [7, 8, 9]]
    body = {"model": "tiny", "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    choices = post(url, {**body, "prompt": prompts[0]}).json()["choices"]
    choices += post(url, {**body, "prompt": prompts[1:]}).json()["choices"]     # token lists, batched
    assert [c["index"] for c in choices] == [0, 0, 1]
    for prompt, choice in zip(prompts, choices):
        want = ref(llm, prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, logprobs=1))
        lp = choice["logprobs"]
        n = len(want.prompt_token_ids)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, n):
            entry = want.prompt_logprobs[i]
            assert math.isclose(lp["token_logprobs"][i], entry[want.prompt_token_ids[i]].logprob, abs_tol=1e-4)
            assert math.isclose(max(lp["top_logprobs"][i].values()), max(e.logprob for e in entry.values()),
                                abs_tol=1e-4)
        if isinstance(prompt, str):
            assert choice["text"] == prompt + want.outputs[0].text
            assert lp["text_offset"][:3] == [0, 1, 2]
    # max_tokens 0 scores the prompt alone
    r = post(url, {**body, "prompt": prompts[0], "max_tokens": 0}).json()
    assert r["choices"][0]["text"] == prompts[0] and r["usage"]["completion_tokens"] == 0
    assert len(r["choices"][0]["logprobs"]["tokens"]) == len(prompts[0])
    # streamed echo: the prompt comes first, once
    lines = [ln for ln in httpx.post(url + "/v1/completions", json={**body, "prompt": prompts[0], "max_tokens": 4,
                                     "stream": True}, headers=AUTH).text.splitlines() if ln.startswith("data: {")]
    texts = [json.loads(ln[6:])["choices"][0]["text"] for ln in lines]
    assert texts[0].startswith(prompts[0]) and not any(t.startswith(prompts[0]) for t in texts[1:])


def test_streamed_text_offsets_equal_the_response(url):
    """While a stop string may still be forming, the stream holds its characters back but sends
    the tokens' logprobs: each chunk's text_offset goes on from the tokens sent before it (not
    from the text), so streamed offsets equal the response's, with and without echo."""
    for prompt in ("Hello world", "héllo wörld"):        # (byte tokens: "é" is two of them)
        for echo in (False, True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1,
                    "echo": echo, "stop": ["not in this text"]}
            want = post(url, body).json()["choices"][0]["logprobs"]
            r = post(url, {**body, "stream": True})
            blocks = [json.loads(ln[6:])["choices"][0]["logprobs"] for ln in r.text.splitlines()
                      if ln.startswith("data: {")]
            assert [o for b in blocks if b for o in b["text_offset"]] == want["text_offset"]
            assert [t for b in blocks if b for t in b["tokens"]] == want["tokens"]


def sse_choices(r) -> list[dict]:
    return [c for ln in r.text.splitlines() if ln.startswith("data: {") for c in json.loads(ln[6:])["choices"]]


def test_streamed_choices_finish_once(url):
    """n > 1, streamed: a choice that ended early was sent again, with its finish_reason and no
    text, at every later step of the other choices; as OpenAI, each choice finishes in one chunk,
    its last."""
    body = {"model": "tiny", "max_tokens": 40, "n": 4, "seed": 1, "stop": list("aeiou"), "stream": True}
    whole = post(url, {**body, "prompt": "Hello", "stream": False, "return_token_ids": True}).json()
    assert len({len(c["token_ids"]) for c in whole["choices"]}) > 1     # they end at different steps
    for path, extra in (("/v1/completions", {"prompt": "Hello"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        choices = sse_choices(post(url, {**body, **extra}, path))
        for i in range(4):
            mine = [c for c in choices if c["index"] == i]
            assert [bool(c["finish_reason"]) for c in mine].count(True) == 1 and mine[-1]["finish_reason"], path


def test_engine_process_sends_a_finished_choice_once(llm):
    """n > 1, streamed: the engine process sent a choice that had ended again at every later step
    of the others (no new tokens, its finish_reason again) for the front end to drop. Each
    choice's last delta must be its one finished one, and the deltas must still rebuild the output."""
    from asynct.engine.core_proc import EngineCore, apply_delta
    from asynct.engine.outputs import RequestOutput

    class Outbox(list):
        send = list.append

    outbox, engine = Outbox(), llm.llm_engine
    params = SamplingParams(n=4, seed=1, max_tokens=40, stop=list("aeiou"))
    core = EngineCore(engine, outbox)
    core._apply(("add", [("r", "Hello", params, True)]))
    while engine.has_unfinished_requests():
        core._step()
    steps = [[seq for delta in msg[1] for seq in delta[4]] for msg in outbox if msg[0] == "outputs"]
    finished_at = {}
    for step, seqs in enumerate(steps):
        for index, *_, finish_reason, _ in seqs:
            assert index not in finished_at, f"choice {index} sent again after its finish"
            if finish_reason is not None:
                finished_at[index] = step
    assert sorted(finished_at) == [0, 1, 2, 3] and len(set(finished_at.values())) > 1   # they end apart
    rebuilt = RequestOutput("r", None, [], None, [], False)
    for msg in outbox:
        for delta in msg[1] if msg[0] == "outputs" else []:
            apply_delta(rebuilt, delta)
    want = ref(llm, "Hello", params)
    assert rebuilt.finished and [(c.text, c.token_ids, c.finish_reason) for c in rebuilt.outputs] == \
        [(c.text, c.token_ids, c.finish_reason) for c in want.outputs]


def test_tokenizer_routes(url, llm):
    from lm_eval.utils import check_remote_tokenizer_support
    r = post(url, {"prompt": "héllo"}, "/tokenize").json()
    assert r["tokens"] == list("héllo".encode()) and r["count"] == 6
    assert post(url, {"tokens": r["tokens"]}, "/detokenize").json()["prompt"] == "héllo"
    info = httpx.get(url + "/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == llm.get_tokenizer().eos_token and info["chat_template"]
    chat = post(url, {"messages": [{"role": "user", "content": "x"}]}, "/tokenize").json()
    assert chat["count"] > 1
    both = post(url, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "/tokenize")
    assert both.status_code == 400 and both.json()["error"]["message"] == "give prompt or messages, not both"
    assert check_remote_tokenizer_support(url + "/v1/completions", auth_token=KEY)


def test_tokenize_returns_token_strs_as_vllm(url, llm):
    """vLLM's return_token_strs: each token as the vocabulary spells it; the flag was ignored."""
    r = post(url, {"prompt": "hi", "return_token_strs": True}, "/tokenize").json()
    assert r["token_strs"] == llm.get_tokenizer().convert_ids_to_tokens(r["tokens"]) == ["h", "i"]
    assert "token_strs" not in post(url, {"prompt": "hi"}, "/tokenize").json()


def test_models_health_metrics(url, tiny_ckpt):
    models = httpx.get(url + "/v1/models", headers=AUTH).json()
    card = models["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == 2048
    # vLLM's card: the checkpoint as root, a permission object
    assert (card["root"], card["parent"], card["permission"][0]["object"]) == (str(tiny_ckpt), None, "model_permission")
    assert httpx.get(url + "/health").json() == {"status": "ok"}     # open without the key
    from asynct import __version__
    assert httpx.get(url + "/version").json() == {"version": __version__}     # vLLM's, open too
    text = httpx.get(url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_free",
                 "prefix_cache_hit_rate", "generation_tokens_per_second", "generation_tokens_total"):
        assert f"# TYPE asynct_{name} " in text and f"\nasynct_{name}{{" in text



def histograms(text: str) -> dict:
    """name -> {"buckets": [(le, cumulative count)], "sum": s, "count": n}, read from /metrics."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("asynct_"):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{")[0]
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name.endswith(("seconds" + suffix)):
                h = out.setdefault(name[:-len(suffix)], {"buckets": []})
                if suffix == "_bucket":
                    le = series.split('le="')[1].split('"')[0]
                    h["buckets"].append((float(le), int(value)))
                else:
                    h[suffix[1:]] = float(value)
    return out


def test_latency_histograms(url, client):
    names = ["asynct_time_to_first_token_seconds", "asynct_inter_token_latency_seconds",
             "asynct_e2e_request_latency_seconds"]
    text = httpx.get(url + "/metrics").text
    for name in names:
        assert f"# TYPE {name} histogram" in text
    before = histograms(text)
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks
    client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=0)
    after = histograms(httpx.get(url + "/metrics").text)
    grew = {n: after[n]["count"] - before[n]["count"] for n in names}
    # 4 requests ended; first and inter-token times are seen for the streamed one (1 + 3) and the
    # one-token one; the non-streaming 5-token ones come back whole: no first-token time there
    assert grew == {names[0]: 2, names[1]: 3, names[2]: 4}
    bounds = {names[0]: 0.001, names[1]: 0.01, names[2]: 0.3}      # vLLM's first bucket bounds
    for n in names:
        h = after[n]
        les = [le for le, _ in h["buckets"]]
        assert les[0] == bounds[n] and les[-1] == math.inf and les == sorted(les)
        counts = [c for _, c in h["buckets"]]
        assert counts == sorted(counts) and counts[-1] == h["count"]      # cumulative, +Inf = count
        assert h["sum"] > before[n]["sum"]
    assert after[names[2]]["sum"] - before[names[2]]["sum"] >= after[names[0]]["sum"] - before[names[0]]["sum"]


BAD = [  # (why, body or raw bytes, headers, status, words in the message)
    ("malformed JSON", b'{"model": "tiny", "prompt": "x",', None, 400, "malformed JSON"),
    ("JSON that is not an object", b"[1, 2]", None, 400, ""),
    ("missing prompt", {"model": "tiny"}, None, 400, "prompt"),
    ("wrong type", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, None, 400, "max_tokens"),
    ("negative temperature", {"model": "tiny", "prompt": "x", "temperature": -1}, None, 400, "temperature"),
    ("top_p above 1", {"model": "tiny", "prompt": "x", "top_p": 1.5}, None, 400, "top_p"),
    ("n = 0", {"model": "tiny", "prompt": "x", "n": 0}, None, 400, "n must be"),
    ("max_tokens = 0", {"model": "tiny", "prompt": "x", "max_tokens": 0}, None, 400, "max_tokens"),
    ("too many logprobs", {"model": "tiny", "prompt": "x", "logprobs": 100}, None, 400, "logprobs"),
    ("penalty out of range", {"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, None, 400, "presence_penalty"),
    ("logit_bias key not a token id", {"model": "tiny", "prompt": "x", "logit_bias": {"x": 1}}, None, 400,
     "logit_bias"),
    ("empty prompt", {"model": "tiny", "prompt": ""}, None, 400, "empty"),
    ("empty prompt list", {"model": "tiny", "prompt": []}, None, 400, "empty"),
    ("token outside vocab", {"model": "tiny", "prompt": [1, 99999]}, None, 400, "outside the vocabulary"),
    ("prompt too long", {"model": "tiny", "prompt": "x" * 3000}, None, 400, "at most 2048 prompt tokens"),
    ("unknown model", {"model": "gpt-5", "prompt": "x"}, None, 404, "does not exist"),
    ("missing API key", {"model": "tiny", "prompt": "x"}, {}, 401, "API key"),
    ("wrong API key", {"model": "tiny", "prompt": "x"}, {"Authorization": "Bearer nope"}, 401, "API key"),
    ("body over the limit", {"model": "tiny", "prompt": "x" * (70 << 10)}, None, 413, "exceeds"),
]


@pytest.mark.parametrize("why,body,headers,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_then_good(url, llm, why, body, headers, status, words):
    h = {**(AUTH if headers is None else headers), "Content-Type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + "/v1/completions", content=data, headers=h)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] and "param" in err
    good = post(url, {"model": "tiny", "prompt": "ok", "max_tokens": 4, "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == ref(llm, "ok", SamplingParams(
        temperature=0, max_tokens=4)).outputs[0].text


def test_penalties_and_logit_bias_as_openai_sends_them(url, client, llm):
    """OpenAI's clients send logit_bias with token ids as string keys, and penalties: they were a
    400. As vLLM's server, a bias is clamped to [-100, 100]; null is the default."""
    first = ref(llm, "hi", SamplingParams(temperature=0, max_tokens=1, logprobs=259)).outputs[0].logprobs[0]
    low, high = min(first, key=lambda t: first[t].logprob), max(first, key=lambda t: first[t].logprob)
    # unclamped, +1000 would win for the least likely token; at +100 each, the likelier does
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0,
                                  logit_bias={str(low): 1000, str(high): 100})
    clamped = ref(llm, "hi", SamplingParams(temperature=0, max_tokens=4, logit_bias={low: 100.0, high: 100.0}))
    assert r.choices[0].text == clamped.outputs[0].text
    assert ref(llm, "hi", SamplingParams(temperature=0, max_tokens=1, logit_bias={low: 1000.0})).outputs[0].token_ids \
        == [low]
    kw = dict(frequency_penalty=1.5, presence_penalty=-0.5)
    want = ref(llm, "hi", SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, **kw)).outputs[0].text
    assert want != ref(llm, "hi").outputs[0].text
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=16, temperature=0, **kw,
                                  extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == want
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0, "allowed_token_ids": [65]}
    assert post(url, body).json()["choices"][0]["text"] == "AAA"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 16, "temperature": 0}
    nulls = dict.fromkeys(("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                           "allowed_token_ids"))
    assert post(url, {**body, **nulls}).json()["choices"][0]["text"] == ref(llm, "hi").outputs[0].text


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
NAMED = [  # (path, body, the field `param` must name): each once answered param null, or "prompt"
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 70}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "top_k": 100000}, "top_k"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [100000]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-40}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1, "five": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"259": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [259]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": -2.5}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1.5": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),
    # past max_model_len (2048) with the prompt: as vLLM, "input_tokens"; alone: the field
    ("/v1/completions", {"prompt": [65] * 2040}, "input_tokens"),        # max_tokens' default 16
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2048}, "input_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 5000}, "max_completion_tokens"),
    ("/detokenize", {"tokens": [1, 259]}, "tokens"),
    ("/tokenize", {"messages": []}, "messages"),
]


@pytest.mark.parametrize("path,body,param", NAMED,
                         ids=[f"{'chat' if 'chat' in p else p.split('/')[-1]}-{f}" for p, _, f in NAMED])
def test_bad_value_400_names_its_param(url, path, body, param):
    r = post(url, {"model": "tiny", **body}, path)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("depth", [1, 5000])     # 5,000 levels: past json's encoder, so walked
def test_first_invalid_unicode_names_its_path(depth):
    from asynct.entrypoints.serve.protocol import first_invalid_unicode
    nest = inner = []
    for _ in range(depth - 1):
        inner.append([])
        inner = inner[0]
    inner += ["ok", "\ud800"]
    assert first_invalid_unicode({"prompt": "fine", "x": nest}) == "body.x" + "[0]" * (depth - 1) + "[1]"
    inner[1] = "fine"
    assert first_invalid_unicode({"prompt": "fine", "x": nest}) is None
    assert first_invalid_unicode({"a": {"b\udc00": 1}}) == "body.a key"


def test_malformed_json_names_no_param(url):
    """pydantic locates a parse error by its character offset: it was answered as param "31"."""
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": "x",',
                   headers={**AUTH, "Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and "malformed JSON" in err["message"] and err["param"] is None, r.text


def test_json_nested_past_the_recursion_limit_says_so(url):
    """Well-formed JSON nested 20,000 deep makes the parser recurse past Python's limit: a 400
    that says so (it was FastAPI's "There was an error parsing the body"), and the server serves on."""
    body = b'{"model": "tiny", "prompt": ' + b"[" * 20_000 + b"1" + b"]" * 20_000 + b"}"
    r = httpx.post(url + "/v1/completions", content=body, headers={**AUTH, "Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and "nests deeper" in err["message"] and err["param"] is None, r.text
    assert post(url, {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_max_tokens_past_the_context_is_a_400(url):
    """A prompt and max_tokens past max_model_len together were accepted, and stopped at the end
    of the context with finish_reason "length", as if max_tokens had been reached. As vLLM: 400,
    naming the numbers; without max_tokens, chat generates to the end of the context."""
    messages = [{"role": "user", "content": "x" * 2000}]
    n = post(url, {"messages": messages}, "/tokenize").json()["count"]
    room = 2048 - n
    for path, body, fits in (("/v1/completions", {"prompt": [65] * 2040, "max_tokens": 16}, 8),
                             ("/v1/chat/completions", {"messages": messages, "max_tokens": room + 1}, room),
                             ("/v1/chat/completions", {"messages": messages, "max_tokens": room + 1, "stream": True},
                              room)):
        r = post(url, {"model": "tiny", "ignore_eos": True, **body}, path)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "input_tokens"
        tokens = len(body["prompt"]) if "prompt" in body else n
        for number in (tokens, body["max_tokens"], 2048, fits):
            assert str(number) in err["message"], (number, err["message"])
    whole = post(url, {"model": "tiny", "messages": messages, "ignore_eos": True}, "/v1/chat/completions").json()
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == room
    fits = post(url, {"model": "tiny", "messages": messages, "max_tokens": room, "ignore_eos": True},
                "/v1/chat/completions")
    assert fits.status_code == 200 and fits.json()["usage"]["total_tokens"] == 2048


def test_a_whole_context_prompt_leaves_no_room_to_generate(url):
    """The engine takes a prompt of max_model_len tokens (as vLLM's LLM, for its prompt logprobs),
    but a served request must generate: without max_tokens too, as vLLM's server, a 400."""
    messages = [{"role": "user", "content": "x" * 2000}]
    n = post(url, {"messages": messages}, "/tokenize").json()["count"]
    messages[0]["content"] += "x" * (2048 - n)
    assert post(url, {"messages": messages}, "/tokenize").json()["count"] == 2048
    r = post(url, {"model": "tiny", "messages": messages}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens", r.text
    assert "2048" in r.json()["error"]["message"]


def test_a_chat_past_max_prompt_chars_names_messages(tiny_ckpt):
    """The rendered chat's length check named "prompt", a field chat requests do not have."""
    from asynct.entrypoints.serve.limits import ServerLimits
    with ServerThread(make_app(tiny_ckpt, served_model_name="tiny", limits=ServerLimits(max_prompt_chars=100))) as u:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 200}]}
        for path in ("/v1/chat/completions", "/tokenize"):
            r = post(u, chat, path)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (path, r.text)
        assert post(u, {"model": "tiny", "prompt": "x" * 200}).json()["error"]["param"] == "prompt"


def test_a_given_max_prompt_chars_is_named_as_the_reason(tiny_ckpt):
    """A prompt past --max-prompt-chars was refused as one that "cannot fit in max_model_len=2048
    tokens", though 12 characters fit; the message now names the flag's limit as the reason, and
    the default limit still names max_model_len."""
    from asynct.entrypoints.serve.limits import ServerLimits
    with ServerThread(make_app(tiny_ckpt, served_model_name="tiny", limits=ServerLimits(max_prompt_chars=10))) as u:
        for extra in ({}, {"truncate_prompt_tokens": 3}):
            r = post(u, {"model": "tiny", "prompt": "x" * 12, "max_tokens": 1, **extra})
            msg = r.json()["error"]["message"]
            assert r.status_code == 400 and "at most 10" in msg and "--max-prompt-chars" in msg, r.text
            assert "max_model_len" not in msg, msg
    with ServerThread(make_app(tiny_ckpt, served_model_name="tiny")) as u:
        r = post(u, {"model": "tiny", "prompt": "x" * 100_000, "max_tokens": 1})
        assert r.status_code == 400 and "cannot fit in max_model_len=2048" in r.json()["error"]["message"], r.text


def test_more_bad_requests_then_good(url, client):
    def chunks():        # a chunked body states no length up front: counted as it arrives
        for _ in range(80):
            yield b" " * 1024
    assert httpx.post(url + "/v1/completions", content=chunks(), headers=AUTH).status_code == 413
    chat = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert post(url, chat, "/v1/chat/completions").status_code == 400
    assert post(url, {"model": "tiny", "messages": []}, "/v1/chat/completions").status_code == 400
    assert httpx.get(url + "/v1/nothing", headers=AUTH).json()["error"]["code"] == 404
    assert httpx.get(url + "/v1/completions", headers=AUTH).status_code == 405
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_chat_without_template_is_a_clear_400(tmp_path, tiny_ckpt):
    plain = shutil.copytree(tiny_ckpt, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink()
    with ServerThread(make_app(plain, served_model_name="plain")) as u:
        r = post(u, {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert post(u, {"model": "plain", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_throughput_log_line():
    from types import SimpleNamespace

    from asynct.entrypoints.serve.metrics import ThroughputLogger
    snap = {"prompt_tokens": 0, "generation_tokens": 0, "running": 0, "waiting": 0, "blocks_total": 100,
            "blocks_free": 100, "prefix_cache_hit_rate": 0.0}
    engine = SimpleNamespace(snapshot=dict(snap))
    logger = ThroughputLogger(engine, interval=10)
    assert logger.line() is None                  # idle: nothing to say
    t = logger.last[0]
    logger.last = (t - 10, 0, 0)
    engine.snapshot = {**snap, "prompt_tokens": 500, "generation_tokens": 200, "running": 3, "waiting": 1,
                       "blocks_free": 75, "prefix_cache_hit_rate": 0.5}
    line = logger.line()
    assert line.startswith("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, ")
    assert line.endswith("Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%")


def test_startup_summary_line(tiny_ckpt):
    from asynct.entrypoints.serve.metrics import summary_line
    llm = LLM(tiny_ckpt, device="cpu")    # the CPU defaults, on a GPU machine too
    s = llm.llm_engine.summary()
    line = summary_line("tiny", str(tiny_ckpt), s, 2.345)
    blocks = llm.llm_engine.block_manager.num_blocks
    assert line.startswith(f"model tiny ({tiny_ckpt}): float32 on cpu, max_model_len 2048, "
                           f"KV cache {blocks} blocks x 16 = {16 * blocks} tokens (")
    assert line.endswith("GiB, float32), attention torch, CUDA graphs off, engine started in 2.3 s")
    assert 0.9 < s["kv_cache_gib"] <= 1.0        # the CPU default: 1 GiB of KV cache


def test_stop_strings_without_a_tokenizer_are_a_400_before_the_stream(tmp_path):
    """The front end left this check to the engine process: a streamed request got 200 and then an
    error event, a plain one a 400 naming no param. Both are a 400 naming `stop`, as other bad values."""
    from asynct.model.checkpoint import make_checkpoint
    ckpt = make_checkpoint("tiny", tmp_path / "notok", tokenizer=False)
    with ServerThread(make_app(ckpt, served_model_name="m")) as u:
        for stream in (False, True):
            r = post(u, {"model": "m", "prompt": [5, 6], "max_tokens": 4, "stop": ["a"], "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
            assert "stop strings need a tokenizer" in r.json()["error"]["message"]
        assert post(u, {"model": "m", "prompt": [5, 6], "max_tokens": 4, "stop_token_ids": [0]}).status_code == 200
