"""vLLM's request fields that asynct once refused: truncate_prompt_tokens, the server's
prompt_logprobs and bad_words, on `LLM` and on both server routes, each against a reference
run without it (a tiny checkpoint with a byte tokenizer, max_model_len 64)."""
import httpx
import pytest

from asynct import LLM, SamplingParams
from asynct.entrypoints.serve.api_server import make_app
from asynct.entrypoints.serve.launch import ServerThread

MAX_LEN = 64
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
LONG = list(range(65, 65 + 26)) * 4          # 104 token ids: past max_model_len


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def url(tiny_ckpt):
    app = make_app(tiny_ckpt, served_model_name="tiny", chat_template=TEMPLATE, log_stats_interval=None,
                   max_model_len=MAX_LEN)
    with ServerThread(app) as u:
        yield u


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 6), ignore_eos=True, **kw)


def post(url, body, path="/v1/completions"):
    return httpx.post(url + path, json={"model": "tiny", "temperature": 0, "ignore_eos": True, **body}, timeout=60)


# ---- truncate_prompt_tokens ------------------------------------------------------------------
def test_truncation_equals_running_the_prompt_s_last_tokens(llm):
    """truncate_prompt_tokens was refused; as vLLM, k keeps the prompt's last k tokens and -1 its
    last max_model_len, before the prompt is checked: a prompt past the context runs truncated,
    and the output's prompt_token_ids are the ones that ran."""
    ids = LONG[:30]
    out, ref = llm.generate([ids, ids[-9:]], [greedy(truncate_prompt_tokens=9), greedy()], use_tqdm=False)
    assert out.prompt_token_ids == ids[-9:] and out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.generate([ids[:5]], greedy(truncate_prompt_tokens=9), use_tqdm=False)[0].prompt_token_ids == ids[:5]
    with pytest.raises(ValueError, match="104 tokens"):
        llm.llm_engine.add_request("too-long", LONG, greedy())
    for k, keep in ((-1, MAX_LEN), (40, 40)):
        out, ref = llm.generate([LONG, LONG[-keep:]], [greedy(max_tokens=1, truncate_prompt_tokens=k),
                                                        greedy(max_tokens=1)], use_tqdm=False)
        assert out.prompt_token_ids == LONG[-keep:] and out.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize("value,match", [(0, ">= 1 .* or -1"), (-2, ">= 1 .* or -1"), ("8", "an integer"),
                                         (True, "an integer"), (1.0, "an integer")])
def test_bad_truncation_names_the_field(value, match):
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens must be {match}") as e:
        SamplingParams(truncate_prompt_tokens=value)
    assert e.value.param == "truncate_prompt_tokens"


def test_served_truncation_counts_the_truncated_prompt(url, llm):
    """As vLLM's server: usage.prompt_tokens is the truncated prompt's, the fit in the context is
    checked with it, and -1 keeps what max_tokens leaves of the context."""
    ids = LONG[:30]
    r = post(url, {"prompt": ids, "max_tokens": 6, "truncate_prompt_tokens": 9, "echo": True}).json()
    ref = llm.generate([ids[-9:]], greedy(), use_tqdm=False)[0].outputs[0]
    assert r["usage"]["prompt_tokens"] == 9 and r["choices"][0]["text"] == bytes(ids[-9:]).decode() + ref.text
    r = post(url, {"prompt": bytes(LONG).decode(), "max_tokens": 4, "truncate_prompt_tokens": -1}).json()
    assert r["usage"]["prompt_tokens"] == MAX_LEN - 4, r
    chat = {"messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 3, "truncate_prompt_tokens": 20}
    r = post(url, chat, "/v1/chat/completions").json()
    assert r["usage"] == {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}
    assert post(url, {"prompt": LONG, "max_tokens": 4}).status_code == 400     # untruncated, it does not fit


@pytest.mark.parametrize("body", [{"truncate_prompt_tokens": 61}, {"truncate_prompt_tokens": 0},
                                  {"truncate_prompt_tokens": -2}, {"truncate_prompt_tokens": "8"}])
def test_served_truncation_past_the_room_is_a_400(url, body):
    """k above max_model_len - max_tokens could not fit (vLLM: "request a smaller truncation size")."""
    for path, extra in (("/v1/completions", {"prompt": LONG}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = post(url, {**extra, "max_tokens": 4, **body}, path)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


# ---- the server's prompt_logprobs ------------------------------------------------------------
def entry_json(entry: dict, k: int) -> dict:
    """An engine prompt logprob entry as vLLM's server writes it: the prompt's token and the top k."""
    return {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items() if t == next(iter(entry)) or lp.rank <= k}


def assert_prompt_logprobs(got: list, want, k: int):
    assert len(got) == len(want.prompt_token_ids) and got[0] is None
    for g, e, tid in zip(got[1:], want.prompt_logprobs[1:], want.prompt_token_ids[1:]):
        w = entry_json(e, k)
        assert list(g) == list(w) and str(tid) == next(iter(g)) and len(g) >= min(k, 1)
        for key in w:
            assert g[key]["rank"] == w[key]["rank"] and g[key]["decoded_token"] == w[key]["decoded_token"]
            assert g[key]["logprob"] == pytest.approx(w[key]["logprob"], abs=1e-4)


def test_prompt_logprobs_on_both_routes_equal_the_engine_s(url, llm):
    """prompt_logprobs was a 400; as vLLM's server, a completion's choices each carry the prompt's
    logprobs (None first, then token id -> logprob, rank, decoded_token: the prompt's token and
    the top k) and a chat response carries them once."""
    ids = [72, 101, 108, 108, 111, 32, 119]
    r = post(url, {"prompt": [ids, ids[:4]], "max_tokens": 2, "n": 2, "prompt_logprobs": 3}).json()
    for choice, prompt in zip(r["choices"], (ids, ids, ids[:4], ids[:4])):
        want = llm.generate([prompt], greedy(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
        assert_prompt_logprobs(choice["prompt_logprobs"], want, 3)
    messages = [{"role": "user", "content": "hi"}]
    r = post(url, {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}, "/v1/chat/completions").json()
    want = llm.generate([list(b"<user>hi<assistant>")], greedy(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert_prompt_logprobs(r["prompt_logprobs"], want, 0)
    assert "prompt_logprobs" not in post(url, {"prompt": ids, "max_tokens": 1}).json()["choices"][0]


def test_prompt_logprobs_leave_echo_s_rows_as_they_were(url):
    """The engine computes the larger of echo's logprobs and prompt_logprobs; echo's top_logprobs
    keep its own k (lm-eval's is_greedy reads them)."""
    body = {"prompt": [72, 101, 108, 108, 111], "max_tokens": 1, "echo": True, "logprobs": 1}
    alone, both = post(url, body).json()["choices"][0], post(url, {**body, "prompt_logprobs": 5}).json()["choices"][0]
    assert both["logprobs"] == alone["logprobs"] and "prompt_logprobs" not in alone
    assert all(len(e) >= 5 for e in both["prompt_logprobs"][1:])


@pytest.mark.parametrize("body", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True}])
def test_bad_prompt_logprobs_are_400s(url, body):
    """More than 20 (as logprobs) or a stream (as vLLM's: a stream carries none) is a 400 naming it."""
    for path, extra in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = post(url, {**extra, "max_tokens": 2, **body}, path)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert post(url, {"prompt": "hi", "max_tokens": 2, "stream": True, "prompt_logprobs": 0}).status_code == 200

