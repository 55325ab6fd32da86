"""Text prompts get the tokenizer's special tokens as vLLM and HF give them: a tokenizer that
prepends BOS (Llama's) gets it on LLM.generate's and /v1/completions' text prompts, not on token-id
prompts, and not a second time on chat, whose template writes its own. The shipped byte tokenizer
adds nothing, so these tests build one that does."""
import httpx
import pytest
from tokenizers import processors

from asynct import LLM, SamplingParams
from asynct.entrypoints.serve.api_server import make_app
from asynct.entrypoints.serve.launch import ServerThread
from asynct.model.checkpoint import make_checkpoint
from asynct.model.tokenizer import BOS, CHAT_TEMPLATE, byte_tokenizer

BOS_ID = 258
ONE = SamplingParams(temperature=0, max_tokens=1)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def bos_ckpt(tmp_path_factory):
    """The tiny checkpoint with a byte tokenizer that prepends BOS, as Llama's does, and a chat
    template that writes BOS itself, as Llama's does."""
    path = make_checkpoint("tiny", tmp_path_factory.mktemp("bos"), seed=1)
    tok = byte_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)])
    tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(bos_ckpt):
    return LLM(bos_ckpt)


@pytest.fixture(scope="module")
def url(bos_ckpt):
    with ServerThread(make_app(bos_ckpt, served_model_name="tiny")) as u:
        yield u


def post(url, path, body) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_prepends_bos_to_text_only(llm):
    text, ids = llm.generate(["hi", {"prompt_token_ids": [104, 105]}], ONE, use_tqdm=False)
    assert text.prompt_token_ids == [BOS_ID, 104, 105]
    assert ids.prompt_token_ids == [104, 105]


def test_an_empty_text_prompt_is_its_bos(llm, url):
    """As vLLM: "" with a BOS tokenizer is the prompt [BOS]; it was refused as empty."""
    assert llm.generate([""], ONE, use_tqdm=False)[0].prompt_token_ids == [BOS_ID]
    assert post(url, "/v1/completions", {"prompt": "", "max_tokens": 1})["usage"]["prompt_tokens"] == 1


def test_chat_has_one_bos(llm):
    out = llm.chat(MESSAGES, ONE, use_tqdm=False)[0]
    assert out.prompt.startswith(BOS)
    assert out.prompt_token_ids[:2] == [BOS_ID, ord("<")]      # the template's BOS, no second one


def test_completions_count_bos_unless_told_not_to(url):
    with_bos = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1})["usage"]["prompt_tokens"]
    without = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1,
                                            "add_special_tokens": False})["usage"]["prompt_tokens"]
    assert (with_bos, without) == (3, 2)


def test_chat_route_has_one_bos_unless_told_otherwise(url, llm):
    chat = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})["usage"]["prompt_tokens"]
    assert chat == len(llm.chat(MESSAGES, ONE, use_tqdm=False)[0].prompt_token_ids)
    doubled = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                 "add_special_tokens": True})["usage"]["prompt_tokens"]
    assert doubled == chat + 1


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/completions", {"prompt": "hi", "add_special_tokens": False}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/chat/completions", {"messages": MESSAGES, "add_special_tokens": True}),
])
def test_tokenize_counts_what_the_route_counts(url, path, body):
    used = post(url, path, {**body, "max_tokens": 1})["usage"]["prompt_tokens"]
    assert post(url, "/tokenize", body)["count"] == used
