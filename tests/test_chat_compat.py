"""Chat as vLLM's users meet it, on `LLM.chat` and /v1/chat/completions alike: content parts,
assistant tool calls, and the request fields that change the rendered prompt or the answer."""
import json

import httpx
import pytest

from asynct import LLM, SamplingParams
from asynct.entrypoints.serve.api_server import make_app
from asynct.entrypoints.serve.launch import ServerThread

# module-scoped engines live beside each test's own: on a GPU an engine takes its share of what
# is free, leaving the next none, so these get a fixed cache
SHARED = dict(num_kv_blocks=4096)

ONE = SamplingParams(temperature=0, max_tokens=1)
# the server's --chat-template: messages, each closed by "|", and an assistant's tool calls as
# templates write them
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.city }})]{% endfor %}"
            "|{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, **SHARED)


@pytest.fixture(scope="module")
def app(tiny_ckpt):
    return make_app(tiny_ckpt, served_model_name="tiny", chat_template=TEMPLATE, log_stats_interval=None,
                    **SHARED)


@pytest.fixture(scope="module")
def url(app):
    with ServerThread(app) as u:
        yield u


def post(url, path, body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def prompt_ids(url, messages, **extra) -> list[int]:
    r = post(url, "/tokenize", {"messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_text_parts_are_joined_a_part_a_line(llm, url):
    """As vLLM: several text parts of one message are one string, joined with newlines; they
    were joined with nothing ("Hi " + "there"), a prompt vLLM never renders."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hi\nthere"}]
    assert llm.chat(parts, ONE, use_tqdm=False)[0].prompt == llm.chat(joined, ONE, use_tqdm=False)[0].prompt
    assert prompt_ids(url, parts) == prompt_ids(url, joined)
    r = post(url, "/v1/chat/completions", {"messages": parts, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(prompt_ids(url, joined))
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    err = post(url, "/v1/chat/completions", {"messages": image}).json()["error"]
    assert err["param"] == "messages" and "only text content parts" in err["message"]


def test_refusal_and_responses_text_parts_are_text(llm, url):
    """As vLLM: an assistant's refusal part (the openai client's typed assistant content) and the
    Responses API's input_text / output_text parts are text; each was a 400."""
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Yes"}, {"type": "refusal", "refusal": "No"}]}]
    joined = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes\nNo"}]
    assert llm.chat(parts, ONE, use_tqdm=False)[0].prompt == llm.chat(joined, ONE, use_tqdm=False)[0].prompt
    assert prompt_ids(url, parts) == prompt_ids(url, joined)
    r = post(url, "/v1/chat/completions", {"messages": parts, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(prompt_ids(url, joined))


def call(arguments) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}


def test_tool_call_arguments_reach_the_template_as_a_dict(llm, url):
    """As vLLM: an assistant's tool call arguments, a JSON string in OpenAI's API, are parsed for
    the template (tool-use templates read them as a dict); the template got the string, so
    `arguments.city` rendered nothing. Arguments that are not JSON are a 400 naming messages."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call('{"city": "Paris"}')]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    want = "<user>hi|<assistant>[weather(Paris)]|<tool>sunny|<assistant>"
    assert llm.chat(messages, ONE, use_tqdm=False, chat_template=TEMPLATE)[0].prompt == want
    assert bytes(prompt_ids(url, messages)).decode() == want
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'     # the caller's, untouched
    bad = [messages[0], {"role": "assistant", "tool_calls": [call("{city")]}]
    err = post(url, "/v1/chat/completions", {"messages": bad}).json()["error"]
    assert err["param"] == "messages" and "not JSON" in err["message"]
    with pytest.raises(ValueError, match="not JSON"):
        llm.chat(bad, ONE, use_tqdm=False, chat_template=TEMPLATE)


def test_continue_final_message(llm, url):
    """As vLLM's continue_final_message: the last message is left open (no "|" closing it) for the
    model to continue; the field was ignored, the prompt closed it. With add_generation_prompt
    (true unless told) it is a 400, as vLLM's."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    want = "<user>hi|<assistant>Hel"
    assert llm.chat(messages, ONE, use_tqdm=False, chat_template=TEMPLATE, add_generation_prompt=False,
                    continue_final_message=True)[0].prompt == want
    options = {"add_generation_prompt": False, "continue_final_message": True}
    assert bytes(prompt_ids(url, messages, **options)).decode() == want
    r = post(url, "/v1/chat/completions", {"messages": messages, **options, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    for path in ("/v1/chat/completions", "/tokenize"):
        err = post(url, path, {"messages": messages, "continue_final_message": True}).json()["error"]
        assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"]


def test_a_request_chat_template_is_rendered_or_refused(app, url):
    """vLLM's request field chat_template was ignored: the server's template rendered the
    messages. As vLLM, a server that does not trust request templates refuses it with a 400, and
    one that does (--trust-request-chat-template) renders with it."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "chat_template": "[{{ messages[0].content }}]", "max_tokens": 1}
    for path in ("/v1/chat/completions", "/tokenize"):
        err = post(url, path, body).json()["error"]
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    app.state.limits.trust_request_chat_template = True
    try:
        assert bytes(prompt_ids(url, messages, chat_template=body["chat_template"])).decode() == "[hi]"
        assert post(url, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"] == len("[hi]")
    finally:
        app.state.limits.trust_request_chat_template = False


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("choice", [None, "auto", "required", {"type": "function", "function": {"name": "weather"}}])
def test_tool_choice_other_than_none_is_a_400(url, choice):
    """As vLLM without --enable-auto-tool-choice: no tool call parser, so tool_choice "auto" (the
    default where tools are given), "required" or a named function is a 400; "auto" answered 200
    with the model's call as plain content, read by clients as "no call"."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 1}
    if choice is not None:
        body["tool_choice"] = choice
    err = post(url, "/v1/chat/completions", body).json()["error"]
    assert err["param"] == "tool_choice" and "'none'" in err["message"]
    assert post(url, "/v1/chat/completions", {**body, "tool_choice": "none"}).status_code == 200
    no_tools = {k: v for k, v in body.items() if k != "tools"}
    if choice is not None:
        assert "needs tools" in post(url, "/v1/chat/completions", no_tools).json()["error"]["message"]


def test_tool_choice_null_renders_the_tools(url):
    """As vLLM: "auto" is the default only where tool_choice is not sent; sent as null (clients
    that write every field) it renders the tools and answers, as "none" does. It was a 400."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 1}
    r = post(url, "/v1/chat/completions", {**body, "tool_choice": None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == post(url, "/v1/chat/completions", {**body, "tool_choice": "none"}).json()["usage"]


def test_echo_puts_the_continued_message_in_front(url):
    """As vLLM's echo: where the answer continues the last message (no generation prompt, or an
    assistant message last), that message's content comes first, streamed or not; it was ignored."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 4, "temperature": 0}
    plain = post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(url, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Hel" + plain
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "echo": True, "stream": True, "n": 2,
                                                                  "temperature": 1, "seed": 0}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == i)
             for i in (0, 1)]
    assert all(t.startswith("Hel") and len(t) > 3 for t in texts)
    asked = {"messages": messages[:1], "echo": True, "max_tokens": 4, "temperature": 0}      # a new answer
    assert post(url, "/v1/chat/completions", asked).json()["choices"][0]["message"]["content"] == \
        post(url, "/v1/chat/completions", {**asked, "echo": False}).json()["choices"][0]["message"]["content"]


def test_the_response_role_is_the_continued_messages(url):
    """As vLLM: without a generation prompt the answer continues the last message, so it carries
    that message's role (it was always "assistant"), streamed or not."""
    for last, want in (("user", "user"), ("assistant", "assistant")):
        messages = [{"role": "system", "content": "s"}, {"role": last, "content": "Hel"}]
        for extra, role in (({"add_generation_prompt": False, "continue_final_message": True}, want), ({}, "assistant")):
            body = {"messages": messages, "max_tokens": 2, **extra}
            assert post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["role"] == role
            with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
                first = next(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
            assert first["choices"][0]["delta"]["role"] == role


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": ["hi", "a longer prompt"]}),
])
def test_continuous_usage_stats(url, path, body):
    """vLLM's stream_options.continuous_usage_stats (with include_usage) puts usage in every
    chunk; it was ignored: only the last chunk had usage. As vLLM's, a chunk's usage is its
    choice's (its prompt's tokens, that choice's tokens so far); the last chunk sums the request."""
    n = 2
    body = {**body, "max_tokens": 5, "n": n, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        *chunks, last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    tokens, prompts = {}, {}
    for c in chunks:
        index = c["choices"][0]["index"]
        tokens.setdefault(index, []).append(c["usage"]["completion_tokens"])
        prompts.setdefault(index // n, set()).add(c["usage"]["prompt_tokens"])
    assert all(t == sorted(t) and t[-1] == 5 for t in tokens.values())
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5 * len(tokens)
    assert all(len(p) == 1 for p in prompts.values())
    assert sum(p.pop() for p in prompts.values()) == last["usage"]["prompt_tokens"]
