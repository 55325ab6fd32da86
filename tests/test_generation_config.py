"""generation_config.json, read as vLLM reads it: sampling defaults for requests that leave them
unset, and its EOS ids as stop tokens. asynct ignored the file: a chat model whose end-of-turn
token is listed only there generated past its answer to max_tokens."""
import json
import shutil

import pytest

from asynct import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [72, 105, 33, 32, 50]}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def first_tokens(tiny_ckpt):
    """The tiny model's greedy tokens for PROMPT, with no generation config."""
    return LLM(tiny_ckpt, device="cpu").generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def with_generation_config(src, dst, **values):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(values))
    return dst


def test_its_eos_ids_stop_generation_as_stop_tokens(tiny_ckpt, tmp_path, first_tokens):
    stop_at = first_tokens[2]
    ckpt = with_generation_config(tiny_ckpt, tmp_path / "m", eos_token_id=[256, stop_at])
    llm = LLM(ckpt, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=8)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    cut = first_tokens.index(stop_at) + 1
    assert out.token_ids == first_tokens[:cut] and (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    # ignore_eos ignores them too, as vLLM; "vllm" does not drop them (vLLM reads them either way)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first_tokens
    again = LLM(ckpt, device="cpu", generation_config="vllm").generate(PROMPT, params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first_tokens[:cut]


def test_min_tokens_holds_its_eos_ids_back(tiny_ckpt, tmp_path, first_tokens):
    ckpt = with_generation_config(tiny_ckpt, tmp_path / "m", eos_token_id=first_tokens[0])
    out = LLM(ckpt, device="cpu").generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, min_tokens=2),
                                           use_tqdm=False)[0].outputs[0]
    assert first_tokens[0] not in out.token_ids[:2] and len(out.token_ids) >= 2


def test_its_sampling_values_are_the_defaults(tiny_ckpt, tmp_path):
    ckpt = with_generation_config(tiny_ckpt, tmp_path / "m", temperature=0.6, top_k=5, top_p=0.9,
                                  max_new_tokens=3, do_sample=True)
    llm = LLM(ckpt, device="cpu")
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 5, 0.9, 3)
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 3
    # vLLM's "vllm" keeps the engine's own defaults; overrides win over the file
    assert LLM(ckpt, device="cpu", generation_config="vllm").get_default_sampling_params() == SamplingParams()
    over = LLM(ckpt, device="cpu", override_generation_config={"temperature": 0.2}).get_default_sampling_params()
    assert (over.temperature, over.top_k) == (0.2, 5)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a valid generation config"),
    (json.dumps({"temperature": -1.0}), "generation config's sampling defaults: .*temperature"),
    (json.dumps({"eos_token_id": "2"}), "eos_token_id must be a token id"),
])
def test_a_bad_file_is_a_clear_error_before_the_model_loads(tiny_ckpt, tmp_path, content, message):
    ckpt = tmp_path / "m"
    shutil.copytree(tiny_ckpt, ckpt)
    (ckpt / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        LLM(ckpt, device="cpu")


@pytest.mark.parametrize("kwargs, message", [
    (dict(generation_config="/no/such/folder"), "no generation_config.json there"),
    (dict(generation_config=3), "generation_config must be"),
    (dict(override_generation_config={"temprature": 0.5}), r"\['temprature'\] are not sampling defaults"),
    (dict(override_generation_config="temperature=0.5"), "override_generation_config must be a dict"),
])
def test_bad_options_are_clear_errors(tiny_ckpt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_ckpt, device="cpu", **kwargs)


def test_a_folder_of_its_own(tiny_ckpt, tmp_path):
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 7}))
    assert LLM(tiny_ckpt, device="cpu", generation_config=str(folder)).get_default_sampling_params().top_k == 7


def test_the_server_takes_its_defaults_for_unset_fields(tiny_ckpt, tmp_path, first_tokens):
    """top_k 1 makes an unset-temperature request greedy; max_new_tokens caps max_tokens (vLLM's min)."""
    import httpx

    from asynct.entrypoints.serve.api_server import make_app
    from asynct.entrypoints.serve.launch import ServerThread
    ckpt = with_generation_config(tiny_ckpt, tmp_path / "m", top_k=1, max_new_tokens=3)
    body = {"prompt": PROMPT["prompt_token_ids"], "max_tokens": 16, "ignore_eos": True, "return_token_ids": True}
    with ServerThread(make_app(ckpt, device="cpu", log_stats_interval=None)) as url:
        got = [httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60).json()["choices"][0]
               for extra in ({}, {"max_tokens": 2}, {"top_k": 0, "temperature": 0})]
    assert got[0]["token_ids"] == first_tokens[:3] and got[0]["finish_reason"] == "length"
    assert got[1]["token_ids"] == first_tokens[:2] and got[2]["token_ids"] == first_tokens[:3]


def test_a_bad_file_stops_the_server_before_its_engine_starts(tiny_ckpt, tmp_path):
    from asynct.entrypoints.serve.api_server import make_app
    ckpt = with_generation_config(tiny_ckpt, tmp_path / "m", top_p=1.5)
    with pytest.raises(ValueError, match="generation config's sampling defaults: .*top_p"):
        make_app(ckpt, device="cpu")


def test_the_max_new_tokens_cap_is_checked_as_vllm_checks_it(tiny_ckpt, tmp_path):
    """The cap was applied to the request's SamplingParams after they were checked: min_tokens
    above it ran to the cap, silently short of min_tokens (vLLM's 400: min_tokens exceeds
    max_tokens); and, a completions request's prompts sharing those params, a later prompt was
    fitted in the context with the capped max_tokens and an earlier one with the request's, so
    that the order of the prompts decided between a 200 and a 400."""
    import httpx

    from asynct.entrypoints.serve.api_server import make_app
    from asynct.entrypoints.serve.launch import ServerThread
    ckpt = with_generation_config(tiny_ckpt, tmp_path / "m", max_new_tokens=3)
    short, long = [72, 105], [72] * 20      # 20 + 16 > max_model_len 32 (as vLLM: the request's max_tokens)
    with ServerThread(make_app(ckpt, device="cpu", max_model_len=32, log_stats_interval=None)) as url:
        def post(route, **body):
            return httpx.post(url + route, json={"max_tokens": 16, **body}, timeout=60)
        r = post("/v1/completions", prompt=short, min_tokens=5, ignore_eos=True)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        assert "max_new_tokens" in r.json()["error"]["message"]
        r = post("/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=None,
                 min_tokens=4)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        for prompts in ([short, long], [long, short]):
            r = post("/v1/completions", prompt=prompts)
            assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens", (prompts, r.text)
            assert "max_tokens is 16" in r.json()["error"]["message"]
        ok = post("/v1/completions", prompt=[short, short], min_tokens=3, ignore_eos=True, return_token_ids=True)
        assert [len(c["token_ids"]) for c in ok.json()["choices"]] == [3, 3], ok.text
