"""Streamed chunks written from templates (responses.ChunkFrame, the handlers' _plain_choice) are
the text json.dumps(..., ensure_ascii=False) gives for the whole chunk dict, byte for byte, and a
stream writes once per update, its last update together with usage and [DONE]."""
import asyncio
import copy
import json
from types import SimpleNamespace

import pytest

from asynct.engine.outputs import CompletionOutput, RequestOutput
from asynct.entrypoints.serve.async_engine import EngineError, RequestHandle
from asynct.entrypoints.serve.chat import Chat
from asynct.entrypoints.serve.chat_protocol import ChatCompletionRequest
from asynct.entrypoints.serve.completions import Completion
from asynct.entrypoints.serve.protocol import CompletionRequest

TEXTS = ["", " plain", 'quote " and \\ backslash', "line\nbreak\ttab\r", "\x00\x1f\x7f", "é ünï 中文 🙂",
         "\u2028\u2029", "\ud800 lone surrogate", "</script>"]


def dumps(obj) -> str:       # what every chunk was before the templates
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def steps(texts, finish_reason, stop_reason, index=0):
    """Cumulative outputs of one choice, one token and text piece a step; the last one finished."""
    outs, c = [], CompletionOutput(index, "", [], None, None)
    for k, piece in enumerate(texts):
        c.text += piece
        c.token_ids.append(1000 + k)
        if k == len(texts) - 1:
            c.finish_reason, c.stop_reason = finish_reason, stop_reason
        outs.append(copy.deepcopy(c))
    return outs


class FakeEngine:
    def abort(self, rids, client_left=True):
        pass


def run_stream(stream_fn, updates) -> list[str]:
    """The pieces (writes) of a stream fed `updates`: each a list of {prompt index: output}."""
    async def feed(handle):
        for update in updates:      # the next once the stream has taken this one
            for idx, out in update.items():
                handle.put(idx, out)
            while handle.ready:
                await asyncio.sleep(0)

    async def go():
        handle = RequestHandle(FakeEngine(), [f"r-{i}" for i in range(max(len(u) for u in updates))])
        feeder = asyncio.ensure_future(feed(handle))
        pieces = [piece async for piece in stream_fn(handle)]
        await feeder
        return pieces
    return asyncio.run(go())


def request_output(rid, outputs) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2, 3], None, outputs, all(c.finished for c in outputs))


CTX = SimpleNamespace(model_name="m", decode=lambda ids, skip=True: "")


@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("usage", ["none", "final", "continuous"])
@pytest.mark.parametrize("reasons", [("length", None), ("stop", "</s>"), ("stop", 7)])
def test_completion_chunks_equal_the_encoded_dicts(return_token_ids, usage, reasons):
    stream_options = {"none": None, "final": {"include_usage": True},
                      "continuous": {"include_usage": True, "continuous_usage_stats": True}}[usage]
    body = CompletionRequest(model="m", prompt=[[1, 2, 3], [4, 5]], stream=True, return_token_ids=return_token_ids,
                             stream_options=stream_options, max_tokens=len(TEXTS))
    job = Completion(CTX, body, "cmpl-x", ["", ""], [[1, 2, 3], [4, 5]])
    a, b = steps(TEXTS, *reasons), steps(TEXTS[::-1], "length", None)
    # the first update holds both prompts' first token, later ones one prompt each (b runs ahead)
    updates = [{0: request_output("a", [a[0]]), 1: request_output("b", [b[0]])}] + \
        [{1: request_output("b", [c])} for c in b[1:]] + [{0: request_output("a", [c])} for c in a[1:]]
    pieces = run_stream(job.stream, updates)

    head = {"id": "cmpl-x", "object": "text_completion", "created": job.created, "model": "m"}
    want = []
    for update in updates:
        events = ""
        for i, out in sorted(update.items()):
            c = out.outputs[0]
            k = len(c.token_ids)
            choice = {"index": i, "text": (TEXTS if i == 0 else TEXTS[::-1])[k - 1], "logprobs": None,
                      "finish_reason": c.finish_reason}
            if return_token_ids:      # as vLLM's: the prompt's ids with a choice's first chunk
                choice.update({"prompt_token_ids": [[1, 2, 3], [4, 5]][i]} if k == 1 else {})
                choice["token_ids"] = c.token_ids[k - 1:k]
            if c.finished:
                choice["stop_reason"] = c.stop_reason
            chunk = {**head, "choices": [choice]}
            if usage == "continuous":
                chunk["usage"] = {"prompt_tokens": 3 - i, "completion_tokens": k, "total_tokens": 3 - i + k}
            events += dumps(chunk)
        want.append(events)
    total = 2 * len(TEXTS)
    closing = dumps({**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": total,
                                                      "total_tokens": 5 + total}}) if usage != "none" else ""
    want[-1] += closing + "data: [DONE]\n\n"
    assert pieces == want      # one write per update: the first one carries both prompts' events


@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("texts", [TEXTS, [" a", ""]])    # an empty last piece: the finished delta is {}
def test_chat_chunks_equal_the_encoded_dicts(continuous, texts, return_token_ids):
    stream_options = {"include_usage": True, "continuous_usage_stats": continuous}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                                 stream_options=stream_options, return_token_ids=return_token_ids)
    job = Chat(CTX, body, "chatcmpl-x", [1, 2, 3, 4])
    outs = steps(texts, "stop", None)
    pieces = run_stream(job.stream, [{0: request_output("a", [c])} for c in outs])

    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": job.created, "model": "m"}

    def event(choice, k, **fields):
        use = {"usage": {"prompt_tokens": 4, "completion_tokens": k, "total_tokens": 4 + k}} if continuous else {}
        return dumps({**head, "choices": [choice], **use, **fields})
    # as vLLM's: the prompt's ids on the role's chunk
    ids = {"prompt_token_ids": [1, 2, 3, 4]} if return_token_ids else {}
    want = [event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}, 0, **ids)]
    for k, c in enumerate(outs, 1):
        delta = {"content": texts[k - 1]} if texts[k - 1] or not c.finished else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": c.finish_reason}
        if c.finished:
            choice["stop_reason"] = c.stop_reason
        if return_token_ids:
            choice["token_ids"] = c.token_ids[k - 1:k]
        want.append(event(choice, k))
    want[:2] = [want[0] + want[1]]            # the role chunk goes with the first token's
    want[-1] += dumps({**head, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": len(texts),
                                                        "total_tokens": 4 + len(texts)}}) + "data: [DONE]\n\n"
    assert pieces == want


def test_an_engine_error_ends_the_stream_with_its_event_and_done():
    body = CompletionRequest(model="m", prompt=[1, 2, 3], stream=True, max_tokens=4)
    job = Completion(CTX, body, "cmpl-x", [""], [[1, 2, 3]])
    first = steps([" a", " b"], "length", None)[0]
    pieces = run_stream(job.stream, [{0: request_output("a", [first])}, {0: EngineError("boom", 500)}])
    assert len(pieces) == 2 and json.loads(pieces[0][6:])["choices"][0]["text"] == " a"
    assert pieces[1] == dumps({"error": {"message": "boom", "type": "server_error", "param": None, "code": 500}}) + \
        "data: [DONE]\n\n"


def test_a_bug_while_streaming_ends_the_stream_with_an_error_event_and_done(monkeypatch):
    """An exception of ours mid-stream (here: the second chunk cannot be written) cut the
    connection after the 200, so the client saw a dropped connection; as vLLM, it gets an error
    event and [DONE]."""
    body = CompletionRequest(model="m", prompt=[1, 2, 3], stream=True, max_tokens=4)
    job = Completion(CTX, body, "cmpl-x", [""], [[1, 2, 3]])
    first, second = steps([" a", " b"], "length", None)
    calls, plain = [], job._plain_choice

    def breaks_second(*args):
        calls.append(1)
        if len(calls) > 1:
            raise KeyError("oops")
        return plain(*args)
    monkeypatch.setattr(job, "_plain_choice", breaks_second)
    pieces = run_stream(job.stream, [{0: request_output("a", [first])}, {0: request_output("a", [second])}])
    assert json.loads(pieces[0][6:])["choices"][0]["text"] == " a"
    assert pieces[-1] == dumps({"error": {"message": "internal error while streaming: KeyError: 'oops'",
                                          "type": "server_error", "param": None, "code": 500}}) + "data: [DONE]\n\n"


def test_a_bug_in_the_closing_events_keeps_the_last_updates_chunks(monkeypatch):
    """The last update's chunks wait to go out with the closing ones (usage); a bug while those
    were written replaced them with the error event, so the client never got the final text."""
    from asynct.entrypoints.serve import completions
    body = CompletionRequest(model="m", prompt=[1, 2, 3], stream=True, max_tokens=2,
                             stream_options={"include_usage": True})
    job = Completion(CTX, body, "cmpl-x", [""], [[1, 2, 3]])
    first, last = steps([" a", " b"], "length", None)
    monkeypatch.setattr(completions, "usage", lambda *a: 1 / 0)
    pieces = run_stream(job.stream, [{0: request_output("a", [first])}, {0: request_output("a", [last])}])
    events = [e for e in pieces[-1].split("\n\n") if e]
    assert json.loads(events[0][6:])["choices"][0] == {"index": 0, "text": " b", "logprobs": None,
                                                       "finish_reason": "length", "stop_reason": None}
    assert json.loads(events[1][6:])["error"]["message"] == \
        "internal error while streaming: ZeroDivisionError: division by zero"
    assert events[2:] == ["data: [DONE]"]
