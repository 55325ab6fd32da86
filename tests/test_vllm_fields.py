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
    return LLM(tiny_ckpt, max_model_len=MAX_LEN, num_kv_blocks=128)   # two engines share one GPU


@pytest.fixture(scope="module")
def url(tiny_ckpt):
    app = make_app(tiny_ckpt, served_model_name="tiny", chat_template=TEMPLATE, log_stats_interval=None,
                   max_model_len=MAX_LEN, num_kv_blocks=128)
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


def test_stream_options_without_stream_are_400s(url):
    """As OpenAI's and vLLM's servers: stream_options only with stream: true (it was accepted and
    ignored); null is no option."""
    options = {"include_usage": True}
    for path, extra in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = post(url, {**extra, "max_tokens": 2, "stream_options": options}, path)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
        assert post(url, {**extra, "max_tokens": 2, "stream_options": None}, path).status_code == 200
        assert post(url, {**extra, "max_tokens": 2, "stream": True, "stream_options": options}, path).status_code == 200


# ---- bad_words -------------------------------------------------------------------------------
def reference_banned(output: list[int], words: list[list[int]]) -> set[int]:
    """vLLM V1's per-row rule: the last token of each word whose other tokens end the output."""
    return {w[-1] for w in words if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1:] == w[:-1]}


def fake_seq(words, output, pending=None, row=0):
    from types import SimpleNamespace
    params = SimpleNamespace(bad_words=["w"] if words else None, bad_words_token_ids=words)
    return SimpleNamespace(params=params, output_token_ids=output, num_pending_tokens=int(pending is not None),
                           sample_row=row if pending is not None else -1)


def test_bad_words_ban_what_a_per_row_reference_bans():
    """Rows with and without a pending token (async scheduling: the newest output token is still
    on the device, so the ban is decided there), one-token words, words two rows share a last
    token with, outputs shorter than a word, and rows without bad_words."""
    import torch

    from asynct.engine.bad_words import ban_bad_words
    words = [[5], [1, 2, 3], [7, 3], [9, 9, 4], [2, 4]]
    rows = [(words, [], None), (words, [1, 2], None), (words, [2], 1), (words, [0, 1], 2), (words, [9], 9),
            (words, [7], None), (None, [1, 2], None), (words, [9, 9], 1), ([[4, 6]], [], 4), (words, [1], 2)]
    prev = torch.tensor([3, 2, 2, 8, 4, 6, 6, 6, 4, 9, 2])     # previous step's samples
    seqs = [fake_seq(w, out, None if p is None else int(prev[p]), p if p is not None else -1)
            for w, out, p in rows]
    logits = torch.randn(len(rows), 12)
    got = logits.clone()
    ban_bad_words(got, seqs, prev)
    for i, (w, out, p) in enumerate(rows):
        full = out + ([] if p is None else [int(prev[p])])
        banned = reference_banned(full, w or [])
        want = logits[i].clone()
        want[sorted(banned)] = float("-inf")
        assert torch.equal(got[i], want), (i, banned)


class FakeTokenizer:
    """Tokens by word: a leading space makes another token, as BPE tokenizers' "Ġword"."""
    VOCAB = {"bad": [1], " bad": [2], "two words": [3, 4], " two words": [5, 4], "odd": [6], " odd": [7, 8],
             "same": [9], " same": [9]}

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return list(self.VOCAB[text])


def test_bad_words_tokenise_as_vllm():
    """As vLLM's update_from_tokenizer: the word less leading spaces, and with one leading space
    where that is another sequence of the same length."""
    from asynct.engine.bad_words import bad_words_token_ids
    ids = bad_words_token_ids(FakeTokenizer(), ["bad", "  two words", "odd", "same"], 100)
    assert ids == [[1], [2], [3, 4], [5, 4], [6], [9]]
    with pytest.raises(ValueError, match="bad_words .* outside the vocabulary"):
        bad_words_token_ids(FakeTokenizer(), ["two words"], 4)
    # at most 128 token sequences, as vLLM: "bad" is two; more than 128 words, none tokenised
    assert len(bad_words_token_ids(FakeTokenizer(), ["bad"] * 64, 100)) == 128
    with pytest.raises(ValueError, match="130 token sequences .* at most 128"):
        bad_words_token_ids(FakeTokenizer(), ["bad"] * 65, 100)
    with pytest.raises(ValueError, match="129 bad_words; at most 128"):
        bad_words_token_ids(None, ["bad"] * 129, 100)


LETTERS = list(range(97, 123))      # the outputs are held to ASCII letters: bad words are text


def check_steps(out, words: list[list[int]]):
    """Each greedy token is the model's best that the letters and the words leave (raw logprobs)."""
    tokens = out.outputs[0].token_ids
    for j, (tok, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        banned = reference_banned(tokens[:j], words)
        allowed = [(lp.logprob, t) for t, lp in entry.items() if t not in banned and t in LETTERS]
        assert tok == max(allowed)[1], (j, tok, banned)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_words_in_greedy_generation(tiny_ckpt, async_scheduling):
    """bad_words was refused at any value but None or []: now, as vLLM, no output ends with one;
    with async scheduling too, where a row's newest token is still on the device when it samples."""
    llm = LLM(tiny_ckpt, max_model_len=MAX_LEN, async_scheduling=async_scheduling)
    prompts = ["Hello world", "The quick brown fox", [72, 105]]
    free = llm.generate(prompts, greedy(max_tokens=16, allowed_token_ids=LETTERS), use_tqdm=False)
    for prompt, out in zip(prompts, free):
        text = bytes(out.outputs[0].token_ids).decode()
        words = [text[0], text[3:5], " " + text[6:9]]
        params = greedy(max_tokens=16, logprobs=250, bad_words=words, allowed_token_ids=LETTERS)
        got = llm.generate([prompt, prompt], [params, greedy(max_tokens=16, allowed_token_ids=LETTERS)],
                           use_tqdm=False)
        assert params.bad_words_token_ids == [list(w.strip().encode()) for w in words]
        check_steps(got[0], params.bad_words_token_ids)
        assert got[0].outputs[0].token_ids != out.outputs[0].token_ids
        assert got[1].outputs[0].token_ids == out.outputs[0].token_ids      # its batch neighbour: untouched


def test_bad_words_need_a_tokenizer(tmp_path, llm):
    from asynct.model.checkpoint import make_checkpoint
    ckpt = make_checkpoint("tiny", tmp_path / "notok", tokenizer=False)
    notok = LLM(ckpt, max_model_len=MAX_LEN)
    assert "bad_words need a tokenizer" in notok.generate([[5, 6]], greedy(bad_words=["a"]), use_tqdm=False)[0].error
    with pytest.raises(ValueError, match="bad_words need a tokenizer") as e:
        notok.llm_engine.add_request("x", [5, 6], greedy(bad_words=["a"]))
    assert e.value.param == "bad_words"
    for bad in ([""], "ab", [1], ["a\ud800"]):     # a lone surrogate: the tokenizer's TypeError
        with pytest.raises(ValueError, match="bad_words") as e:
            llm.llm_engine.add_request("bad", [5, 6], greedy(bad_words=bad))
        assert e.value.param == "bad_words"


def test_served_bad_words_equal_llm_generate(url, llm):
    words = ["e", "lo"]
    want = llm.generate(["Hello world"], greedy(max_tokens=8, bad_words=words), use_tqdm=False)[0].outputs[0].text
    r = post(url, {"prompt": "Hello world", "max_tokens": 8, "bad_words": words}).json()
    assert r["choices"][0]["text"] == want
    ref = llm.generate([list(b"<user>hi<assistant>")], greedy(max_tokens=8, bad_words=words), use_tqdm=False)[0]
    r = post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "bad_words": words},
              "/v1/chat/completions").json()
    assert r["choices"][0]["message"]["content"] == ref.outputs[0].text
    r = post(url, {"prompt": "hi", "max_tokens": 2, "bad_words": [""], "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_words_through_preemption(tiny_ckpt, async_scheduling):
    """A preempted sequence's last sample row is that of a step long gone: the device compare
    indexed the newest step's samples with it for every row with a word that can end (pending
    token or not), an IndexError that failed the request where that step sampled fewer rows."""
    words = ["a", "bc", " de", "xy z", "q"]
    ps = lambda: [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True,
                                 allowed_token_ids=LETTERS, bad_words=words) for _ in range(2)]
    got = {}
    for name, kw in (("roomy", dict()), ("preempting", dict(num_kv_blocks=8))):
        llm = LLM(tiny_ckpt, max_model_len=32, block_size=4, async_scheduling=async_scheduling, **kw)
        outs = llm.generate(["Hello there", "The fox"], ps(), use_tqdm=False)
        assert not any(o.error for o in outs), [o.error for o in outs]
        got[name] = [[c.token_ids for c in o.outputs] for o in outs]
        if name == "preempting":
            assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got["preempting"] == got["roomy"]
    for tokens in got["roomy"]:
        for t in tokens:
            assert len(t) == 12 and ord("a") not in t and ord("q") not in t


def test_bad_words_are_tokenised_once_per_request_off_the_event_loop(url, llm, monkeypatch):
    """A long bad_words list takes the tokenizer seconds (20k words: ~1 s): it was tokenised on
    the server's event loop, once per prompt of a completions request (every stream stalled
    meanwhile), and again in the engine for each prompt and each LLM.generate prompt."""
    import threading

    import asynct.engine.inputs as inputs
    calls = []
    real = inputs.bad_words_token_ids

    def counted(*args):
        calls.append(threading.current_thread().name)
        return real(*args)
    monkeypatch.setattr(inputs, "bad_words_token_ids", counted)
    r = post(url, {"prompt": ["Hello", "world", "again"], "max_tokens": 2, "bad_words": ["e", "lo"]})
    assert r.status_code == 200, r.text
    r = post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "bad_words": ["e"]},
             "/v1/chat/completions")
    assert r.status_code == 200, r.text
    assert len(calls) == 2 and all(name.startswith("asynct-render") for name in calls), calls
    calls.clear()
    params = greedy(max_tokens=2, bad_words=["e", "lo"])
    outs = llm.generate(["Hello", "world", "again", [72, 105]], params, use_tqdm=False)
    assert not any(o.error for o in outs) and len(calls) == 1
    params.bad_words = ["x"]          # changed words are tokenised anew
    llm.generate(["Hello"], params, use_tqdm=False)
    assert len(calls) == 2 and params.bad_words_token_ids == [[ord("x")]]


def test_bad_words_read_a_row_s_output_once_a_step():
    """Each word copied the row's whole output (Sequence.output_token_ids slices it): 500 words
    and a 3000-token output took ~3 ms of host time per row and step, growing with the output."""
    import torch

    from asynct.engine.bad_words import ban_bad_words

    class Seq:
        reads = 0
        num_pending_tokens, sample_row = 0, -1
        params = fake_seq([[1, 2], [2, 3], [4]], []).params

        @property
        def output_token_ids(self):
            Seq.reads += 1
            return [7, 1]
    logits = torch.zeros(2, 8)
    ban_bad_words(logits, [Seq(), Seq()], None)
    assert Seq.reads == 2
    assert logits[0].tolist() == [0, 0, float("-inf"), 0, float("-inf"), 0, 0, 0]
