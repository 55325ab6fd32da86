"""vLLM's options on `LLM` (seed, tensor_parallel_size, trust_remote_code), `LLM.chat`, and
`--chat-template`'s file-or-inline rule."""
import pytest

from asynct import LLM, SamplingParams
from asynct.engine.sampling_params import SamplingParamsError
from asynct.entrypoints.chat_utils import load_chat_template

PROMPTS = ["Hello world", "The quick brown fox", "1 + 1 ="]
SAMPLE = SamplingParams(temperature=1.0, max_tokens=12)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


# on a GPU each engine would take 90 % of the free memory, and the module's engine lives on while
# the tests make their own: every engine here sizes its KV cache by hand
SMALL = dict(num_kv_blocks=64)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, trust_remote_code=True, tensor_parallel_size=1, **SMALL)


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_ckpt, llm):
    a = texts(LLM(tiny_ckpt, seed=0, **SMALL).generate(PROMPTS, SAMPLE, use_tqdm=False))
    b = texts(LLM(tiny_ckpt, seed=0, **SMALL).generate(PROMPTS, SAMPLE, use_tqdm=False))
    c = texts(LLM(tiny_ckpt, seed=1, **SMALL).generate(PROMPTS, SAMPLE, use_tqdm=False))
    assert a == b and a != c
    # a request's own seed wins over the engine's
    own = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    assert texts(LLM(tiny_ckpt, seed=3, **SMALL).generate(PROMPTS, own, use_tqdm=False)) == \
        texts(llm.generate(PROMPTS, own, use_tqdm=False))


def test_tensor_parallel_size_other_than_one_is_a_clear_error(tiny_ckpt):
    with pytest.raises(ValueError, match="one GPU.*vLLM.*docs/vllm.md"):
        LLM(tiny_ckpt, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="seed must be an integer"):
        LLM(tiny_ckpt, seed="0")


BAD_SIZES = [dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(block_size=0), dict(block_size=-16),
             dict(max_model_len=0), dict(num_kv_blocks=-1), dict(admission_batch=0), dict(data_parallel_size=0),
             dict(max_num_seqs=True), dict(max_num_seqs=2.0), dict(gpu_memory_utilization=0),
             dict(gpu_memory_utilization=1.5), dict(gpu_memory_utilization=float("nan")),
             dict(kv_cache_memory="1G"), dict(kv_cache_memory=0), dict(kv_cache_memory=1.5)]


@pytest.mark.parametrize("bad", BAD_SIZES, ids=[str(b) for b in BAD_SIZES])
def test_sizes_below_one_are_clear_errors(tiny_ckpt, bad):
    """max_num_seqs=0 or max_num_batched_tokens=0 made an engine that admitted nothing (generate
    waited forever) and block_size=0 a bare ZeroDivisionError: now each is refused by name."""
    (name, _), = bad.items()
    with pytest.raises(ValueError, match=f"^{name} must be "):
        LLM(tiny_ckpt, **bad)


@pytest.mark.parametrize("name", ["enforce_eager", "enable_prefix_caching", "async_scheduling"])
def test_flags_read_as_vllm_reads_them(tiny_ckpt, name):
    """A string "false" read as true: enable_prefix_caching="false" kept prefix caching on, silently.
    As vLLM (pydantic), "false"/"no"/"off"/0 are false and "true"/"yes"/"on"/1 true; "ture" is an
    error naming the flag."""
    from asynct.engine.engine_args import EngineArgs
    for value, want in (("false", False), ("No", False), (0, False), ("TRUE", True), ("on", True), (1, True)):
        assert getattr(EngineArgs(str(tiny_ckpt), **{name: value}), name) is want
    with pytest.raises(ValueError, match=f"^{name} must be True or False .*got 'ture'"):
        LLM(tiny_ckpt, **{name: "ture"})


def test_a_torch_dtype_that_is_not_floating_is_a_clear_error(tiny_ckpt):
    """dtype=torch.int8 raised nn.Module.to's TypeError from deep in the model runner."""
    import torch
    with pytest.raises(ValueError, match="dtype=torch.int8 is not a floating dtype"):
        LLM(tiny_ckpt, dtype=torch.int8)


def test_a_tokenizer_path_without_a_tokenizer_is_a_clear_error(tiny_ckpt, tmp_path):
    """A mistyped tokenizer= path was ignored: the engine ran without a tokenizer (text prompts
    failed, outputs had no text) and said nothing."""
    with pytest.raises(ValueError, match="tokenizer=.*has no tokenizer files"):
        LLM(tiny_ckpt, tokenizer=str(tmp_path / "nope"))
    assert LLM(tiny_ckpt, tokenizer=str(tiny_ckpt), **SMALL).get_tokenizer() is not None


def test_admission_batch_beyond_max_num_seqs_is_a_clear_error(tiny_ckpt):
    """A step admits new sequences only when admission_batch slots are free: with more than
    max_num_seqs, generate waited forever."""
    with pytest.raises(ValueError, match="admission_batch=8 exceeds max_num_seqs=4"):
        LLM(tiny_ckpt, max_num_seqs=4, admission_batch=8)
    llm = LLM(tiny_ckpt, max_num_seqs=4, admission_batch=4, **SMALL)
    outs = llm.generate([[1, 2, i] for i in range(10)], SamplingParams(max_tokens=2), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)


def test_generate_takes_tuples_of_prompts_and_params_as_lists(llm):
    """As vLLM's sequences: a tuple of prompts was taken as one prompt (an error: "token ids
    must be integers") and a tuple of SamplingParams failed every request."""
    greedy = SamplingParams(temperature=0, max_tokens=4)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy, use_tqdm=False)]
    for prompts, params in ((tuple(PROMPTS[:2]), greedy), (PROMPTS[:2], (greedy, greedy))):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.error for o in outs] == [None, None]
        assert [o.outputs[0].token_ids for o in outs] == want


def test_prompt_token_ids_must_be_exact_integers(llm):
    """A bool, a float or a NumPy integer among the ids fails its request by name; the others run."""
    import numpy as np
    bad = [[1, True, 3], [1, 2.0, 3], [1, np.int64(2), 3]]
    outs = llm.generate([{"prompt_token_ids": p} for p in [*bad, [1, 2, 3]]], SamplingParams(max_tokens=1),
                        use_tqdm=False)
    assert all("prompt token ids must be integers" in o.error for o in outs[:3])
    assert outs[3].error is None and len(outs[3].outputs[0].token_ids) == 1


def test_chat_renders_with_the_template_and_generates(llm):
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    out = llm.chat(MESSAGES, greedy, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == want
    assert out[0].outputs[0].text == llm.generate([want], greedy, use_tqdm=False)[0].outputs[0].text
    # a list of conversations; OpenAI's text parts (a part a line, as vLLM); no generation prompt
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    outs = llm.chat([MESSAGES, parts], greedy, use_tqdm=False, add_generation_prompt=False)
    assert [o.prompt for o in outs] == [tok.apply_chat_template(m, tokenize=False) for m in
                                        (MESSAGES, [{"role": "user", "content": "Hi \nthere"}])]
    # a template of the caller's own
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}> "
    assert llm.chat(MESSAGES, greedy, use_tqdm=False, chat_template=template)[0].prompt == \
        "[system] Be brief.\n[user] Hi there\n> "


def test_chat_without_template_or_tokenizer_is_a_clear_error(llm, monkeypatch):
    tok = llm.get_tokenizer()
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template: pass chat_template"):
        llm.chat(MESSAGES, use_tqdm=False)
    monkeypatch.setattr(llm.llm_engine, "detokenizer", None)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat(MESSAGES, use_tqdm=False)
    with pytest.raises(ValueError, match="list of messages"):
        llm.chat("hi")


@pytest.mark.parametrize("messages,words", [
    (["hi"], "a conversation is a list of messages, got str"),
    ([MESSAGES, "hi"], "a conversation is a list of messages, got str"),
    ([*MESSAGES, "hi"], "a message is a dict"), ([{"content": "hi"}], "role is a string, got None"),
    ([{"role": 5, "content": "hi"}], "role is a string"), ([{"role": "user", "content": 5}], "content is a string"),
])
def test_malformed_chat_messages_are_clear_errors(llm, messages, words):
    """A string where a message goes was an AttributeError ('str' object has no attribute 'get')
    from the message rendering; the server's 400s for these name the same problems."""
    with pytest.raises(ValueError, match=words):
        llm.chat(messages, use_tqdm=False)
    assert llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)[0].error is None


@pytest.mark.parametrize("template,words", [
    ("{% if messages|length > 1 %}{{ raise_exception('roles must alternate') }}{% endif %}",
     "conversation 1: TemplateError: roles must alternate"),
    ("{% if messages|length > 1 %}{{ messages.nope() }}{% endif %}", "conversation 1: UndefinedError"),
    ("{% for m in messages %}", "conversation 0: TemplateSyntaxError"),
])
def test_a_failing_chat_template_is_a_clear_error(llm, template, words):
    """Jinja's errors came through bare (a TemplateSyntaxError from deep in transformers); now a
    ValueError that says the template failed, on which conversation, and Jinja's own words."""
    with pytest.raises(ValueError, match=f"chat template failed on {words}"):
        llm.chat([MESSAGES[-1:], MESSAGES], use_tqdm=False, chat_template=template)
    assert llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)[0].error is None


def test_chat_template_kwargs_are_the_templates_variables(llm):
    """chat_template_kwargs reach the template; LLM.chat's own arguments win over them, as in
    vLLM's LLM.chat (a `tokenize` or `chat_template` there was a TypeError reported as "the chat
    template failed"); the messages and non-dicts are refused by name."""
    greedy = SamplingParams(temperature=0, max_tokens=1)
    template = "{{ greeting }}{% for m in messages %}[{{ m.role }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    chat = lambda **kw: llm.chat(MESSAGES, greedy, use_tqdm=False, chat_template=template, **kw)[0].prompt  # noqa: E731
    assert chat(chat_template_kwargs={"greeting": "Hey"}) == "Hey[system][user]>"
    assert chat(chat_template_kwargs={"greeting": "Hey", "tokenize": True, "add_generation_prompt": False,
                                      "chat_template": "x"}) == "Hey[system][user]>"
    assert chat(add_generation_prompt=False, chat_template_kwargs={"add_generation_prompt": True}) == "[system][user]"
    for bad, words in (({"messages": []}, "may not set the messages"), (["greeting"], "chat_template_kwargs is a dict"),
                       ({1: 2}, "chat_template_kwargs is a dict")):
        with pytest.raises(ValueError, match=words):
            chat(chat_template_kwargs=bad)


def test_load_chat_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(f)) == "{{ messages[0].content }}"
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_progress_bar_shows_input_and_output_speed(llm, capsys):
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "est. speed input: " in err and " toks/s, output: " in err


def test_kv_cache_memory_takes_a_whole_float(tiny_ckpt):
    """lm-eval's model_args parse kv_cache_memory=4e9 as a float: a whole number of bytes is one."""
    from asynct.engine.engine_args import EngineArgs
    assert EngineArgs(str(tiny_ckpt), kv_cache_memory=4e9).kv_cache_memory == 4_000_000_000


def test_use_tqdm_may_be_the_progress_bar_to_use(llm):
    """As vLLM's: a callable use_tqdm makes the bar (it was taken as True: tqdm's own bar)."""
    import io

    from tqdm.auto import tqdm
    made = []

    def bar(**kwargs):
        made.append(tqdm(**kwargs, file=io.StringIO()))
        return made[-1]
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=bar)
    assert len(made) == 1 and made[0].n == made[0].total == len(PROMPTS)


def test_lora_request_and_priority_are_taken_at_no_op_and_refused_otherwise(llm):
    """vLLM's generate arguments: lora_request=None and priority 0 (first come, first served) were
    a TypeError; an adapter or another priority, which asynct cannot apply, is a ValueError."""
    greedy = SamplingParams(temperature=0, max_tokens=2)
    want = texts(llm.generate(PROMPTS, greedy, use_tqdm=False))
    assert texts(llm.generate(PROMPTS, greedy, use_tqdm=False, lora_request=None, priority=[0] * 3)) == want
    assert texts(llm.chat(MESSAGES, greedy, use_tqdm=False, lora_request=None)) == \
        texts(llm.chat(MESSAGES, greedy, use_tqdm=False))
    for bad, words in [(dict(lora_request=object()), "lora_request"), (dict(priority=[0, 1, 0]), "priority")]:
        with pytest.raises(ValueError, match=words):
            llm.generate(PROMPTS, greedy, use_tqdm=False, **bad)
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat(MESSAGES, greedy, use_tqdm=False, lora_request=object())


def test_seed_minus_one_is_unseeded(llm):
    """As vLLM's: seed -1 asks for no seed. It was taken as a seed: every call drew the same tokens."""
    assert SamplingParams(seed=-1).seed is None
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=-1)
    assert texts(llm.generate(PROMPTS, params, use_tqdm=False)) != texts(llm.generate(PROMPTS, params, use_tqdm=False))


def test_vllm_s_sampling_fields_are_taken():
    """vLLM's SamplingParams(bad_words=[], truncate_prompt_tokens=None) was a TypeError (unexpected
    keyword argument); both now apply (tests/test_vllm_fields.py)."""
    SamplingParams(bad_words=[], truncate_prompt_tokens=None)
    SamplingParams(bad_words=["x"], truncate_prompt_tokens=8)


@pytest.mark.parametrize("field", ["detokenize", "spaces_between_special_tokens"])
def test_vllm_s_decoding_flags_must_be_bools(field):
    """detokenize="no" (a truthy string) decoded the text, where skip_special_tokens="no" is refused."""
    with pytest.raises(SamplingParamsError, match=f"^invalid SamplingParams: {field} must be a bool, got 'no'") as e:
        SamplingParams(**{field: "no"})
    assert e.value.param == field


def test_a_bad_max_tokens_is_the_one_complaint():
    """max_tokens=-5 also said "min_tokens=0 exceeds max_tokens=-5" (review)."""
    for kw, message in ((dict(max_tokens=-5), "max_tokens must be >= 1, got -5"),
                        (dict(max_tokens=0, min_tokens=1), "max_tokens must be >= 1, got 0"),
                        (dict(max_tokens=2, min_tokens=5), "min_tokens=5 exceeds max_tokens=2")):
        with pytest.raises(ValueError) as e:
            SamplingParams(**kw)
        assert str(e.value) == f"invalid SamplingParams: {message}"


# ---- penalties, logit_bias, allowed_token_ids ------------------------------------------------
BAD_ADJUSTMENTS = [
    ("presence_penalty", 2.5, r"must be in \[-2, 2\], got 2.5"), ("presence_penalty", "1", "finite number"),
    ("frequency_penalty", -2.01, r"must be in \[-2, 2\]"), ("frequency_penalty", float("nan"), "finite number"),
    ("repetition_penalty", 0, "must be > 0"), ("repetition_penalty", -1.0, "must be > 0"),
    ("repetition_penalty", float("inf"), "finite number"), ("repetition_penalty", True, "finite number"),
    ("logit_bias", {-1: 1.0}, "keys must be token ids"), ("logit_bias", {"5": 1.0}, "map token ids"),
    ("logit_bias", {5: float("nan")}, "finite numbers"), ("logit_bias", {True: 1.0}, "map token ids"),
    ("logit_bias", [(5, 1.0)], "map token ids"), ("allowed_token_ids", [], "must not be empty"),
    ("allowed_token_ids", [-1], "must be token ids"), ("allowed_token_ids", [5, "6"], "list of integers"),
    ("allowed_token_ids", [True], "list of integers"),
    # finite, but inf in the sampler's fp32 logits: the row's softmax was NaN and drew token 0
    ("repetition_penalty", 1e-40, r"must be in \[1e-06, 1e\+06\]"), ("repetition_penalty", 1e300, "fp32"),
    ("logit_bias", {5: 1e300}, r"values must be in \[-1e\+30, 1e\+30\]"), ("logit_bias", {5: -1e31}, "fp32"),
]


@pytest.mark.parametrize("field,value,words", BAD_ADJUSTMENTS, ids=[f"{f}={v!r}" for f, v, _ in BAD_ADJUSTMENTS])
def test_penalty_bias_and_allowed_token_bounds(field, value, words):
    """As vLLM's: penalties in [-2, 2], a repetition penalty above 0, token ids as keys and values."""
    with pytest.raises(ValueError, match=f"^invalid SamplingParams: {field} .*{words}") as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_bias_and_allowed_tokens_must_be_in_the_vocabulary(llm):
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=0.01,
                       logit_bias={0: -100, 258: 1e6}, allowed_token_ids=(0, 258))
    p.check_model(259)
    assert p.allowed_token_ids == [0, 258]
    for field, value in [("logit_bias", {259: 1.0}), ("allowed_token_ids", [3, 259]), ("logprobs", 260),
                         ("prompt_logprobs", 260)]:   # prompt_logprobs was reported as logprobs
        with pytest.raises(SamplingParamsError, match=f"^{field}\\b.*vocabulary size 259") as e:
            SamplingParams(**{field: value}).check_model(259)
        assert e.value.param == field
        out = llm.generate(["hi"], SamplingParams(**{field: value}), use_tqdm=False)[0]
        assert field in out.error


def test_adjustments_at_their_bounds_keep_the_logits_finite(llm):
    """A bias of 1e300 (inf in fp32) or a repetition penalty of 1e-40 made the row's logits inf and
    its softmax NaN: every draw was token 0, outside allowed_token_ids too, with no error. At the
    bounds, with the temperature floor, the row still draws what it allows."""
    bounds = [dict(logit_bias={5: 1e30}, repetition_penalty=1e-6),
              dict(logit_bias={5: -1e30}, repetition_penalty=1e6, allowed_token_ids=[5])]
    for kw in bounds:
        out = llm.generate(["hi"], SamplingParams(temperature=0.01, seed=0, max_tokens=4, **kw), use_tqdm=False)[0]
        assert out.error is None and out.outputs[0].token_ids == [5] * 4, kw


def token_ids(outs):
    return [c.token_ids for o in outs for c in o.outputs]


PENALISED = [dict(frequency_penalty=2.0), dict(repetition_penalty=1.5), dict(repetition_penalty=0.8),
             dict(presence_penalty=1.5, frequency_penalty=-0.5, logit_bias={151: -3.0}),
             dict(temperature=0.9, seed=3, n=2, frequency_penalty=1.0, repetition_penalty=1.2)]


@pytest.mark.parametrize("setting", [dict(), dict(max_num_batched_tokens=9)], ids=["decode", "mixed-steps"])
def test_penalties_give_the_same_tokens_with_async_scheduling(tiny_ckpt, setting):
    """Penalties count every output token so far, and with async scheduling the newest is still
    on the device when the next step samples: missed, async and synchronous outputs part."""
    prompts = [{"prompt_token_ids": p} for p in ([7, 7, 7, 9], [1, 2, 3, 4, 5], [100, 101], [3, 3])]
    llms = [LLM(tiny_ckpt, async_scheduling=mode, num_kv_blocks=100, **setting) for mode in (False, True)]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    unpenalised = token_ids(llms[0].generate(prompts, plain, use_tqdm=False))
    for kw in PENALISED:
        params = SamplingParams(**{"temperature": 0, "max_tokens": 16, "ignore_eos": True, **kw})
        mixed = [params, plain, params, params]        # a batch of penalised and unpenalised rows
        sync, async_ = (token_ids(llm.generate(prompts, mixed, use_tqdm=False)) for llm in llms)
        assert sync == async_, kw
        if params.greedy:
            assert sync[1] == unpenalised[1] and all(sync[i] != unpenalised[i] for i in (0, 2, 3)), kw


FLAKY_PROMPTS = [[120, 163, 188, 98, 255, 241, 202, 72, 110, 191, 172], [61, 253, 233, 253, 246, 122, 48],
                 [238, 100, 230, 84, 59, 148, 119], [204, 184, 169, 133], [230, 229, 18], [198, 50, 184, 236, 226, 48, 53, 5]]
FLAKY_PARAMS = [dict(repetition_penalty=1.8), dict(frequency_penalty=2.0), dict(repetition_penalty=1.8),
                dict(presence_penalty=2.0, repetition_penalty=1.5), dict(repetition_penalty=2.0), dict(frequency_penalty=2.0)]


@pytest.mark.parametrize("upload", ["prompt marks", "new output tokens"])
def test_a_step_that_fails_while_penalising_leaves_the_counts_as_they_were(tiny_ckpt, monkeypatch, upload):
    """The penalty counts live on between steps. A step that raised after a row was taken (before
    the prompt's marks were in) or after its new tokens were taken as counted (before they were
    added) left them so: its one-by-one retry never counted them, and requests that did not fail
    went on with other tokens than a run without the failure."""
    import asynct.engine.penalties as penalties
    import asynct.engine.penalty_counts as penalty_counts
    prompts = [{"prompt_token_ids": p} for p in FLAKY_PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kw) for kw in FLAKY_PARAMS]
    want = token_ids(LLM(tiny_ckpt, async_scheduling=False, num_kv_blocks=100).generate(prompts, params, use_tqdm=False))
    module, name = ((penalty_counts, "host_to_device") if upload == "prompt marks"
                    else (penalties, "host_to_device_many"))
    real, uploads, fail_at = getattr(module, name), [], 1 if upload == "prompt marks" else 5

    def flaky(*args, **kwargs):
        """Raises once: at the first upload of prompt marks, or the fifth that sends new tokens."""
        if upload == "prompt marks" or len(args[0][1][0]):
            uploads.append(1)
            if len(uploads) == fail_at:
                raise RuntimeError("out of memory (a stand-in)")
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, flaky)
    got = {}
    for mode in ("sync", "async"):
        uploads.clear()
        outs = LLM(tiny_ckpt, async_scheduling=mode == "async", num_kv_blocks=100).generate(
            prompts, params, use_tqdm=False)
        assert len(uploads) > fail_at and all(o.error is None for o in outs)
        got[mode] = token_ids(outs)
    assert got == {"sync": want, "async": want}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_finished_penalised_sequences_are_not_kept_alive(tiny_ckpt, async_scheduling):
    """A penalised sequence's row of counts named its sequence until a new penalised one took the
    row: finished sequences (their tokens, logprobs, generators, device tensors) stayed alive,
    as many as the rows grew to, for as long as no other penalised request came."""
    import gc
    import weakref
    engine = LLM(tiny_ckpt, async_scheduling=async_scheduling, num_kv_blocks=64).llm_engine
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, frequency_penalty=1.0,
                            repetition_penalty=1.2, logprobs=3, n=2)
    seqs = [weakref.ref(s) for i in range(5) for s in engine.add_request(str(i), [1, 2, 3 + i], params).seqs]
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.runner.penalty_counts.owner) > 8      # ten rows: grown, and each one held
    gc.collect()
    assert [s() for s in seqs] == [None] * 10


def test_repetition_penalty_equals_transformers(tiny_ckpt, llm):
    """HF's repetition_penalty is vLLM's: over the prompt and the output so far."""
    import torch
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5)
    for prompt in ([7, 7, 7, 9], [1, 2, 3, 4, 5], [151, 40, 41, 40]):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                            pad_token_id=257, eos_token_id=None)[0, len(prompt):].tolist()
        assert token_ids(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)) == [want]


def test_allowed_token_ids_force_the_token_and_logprobs_stay_raw(llm):
    """allowed_token_ids=[t] gives t alone, greedy or sampled; as vLLM's default (raw_logprobs),
    the logprobs returned are the model's, before any adjustment."""
    t = 42
    raw = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=1, logprobs=259), use_tqdm=False)
    want = raw[0].outputs[0].logprobs[0][t].logprob
    for temperature in (0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, allowed_token_ids=[t],
                                logprobs=0)
        out = llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [t] * 6
        assert out.logprobs[0][t].logprob == pytest.approx(want) and want < -1


@pytest.mark.parametrize("bad", [2.5, "3"])
def test_a_truncate_prompt_tokens_set_later_is_checked_before_it_cuts(llm, bad):
    """Fields set after the params were made are checked as a request is added (recheck), but
    truncate_prompt_tokens cut the prompt first: 2.5 failed generate with a TypeError (slice
    indices), where every other field's bad value fails its request with a ValueError."""
    params = SamplingParams(temperature=0, max_tokens=2)
    params.truncate_prompt_tokens = bad
    out, = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "error"
    assert out.error.startswith("invalid SamplingParams: truncate_prompt_tokens must be an integer or None")


def test_logprobs_minus_one_is_the_whole_vocabulary(llm):
    """As vLLM's (its max_logprobs=-1; LLM takes up to the vocabulary): logprobs=-1 and
    prompt_logprobs=-1 return every token's logprob. Both were refused ("must be >= 0")."""
    vocab = llm.llm_engine.vocab_size
    out, = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                        use_tqdm=False)
    assert [len(e) for e in out.outputs[0].logprobs] == [vocab] * 2
    assert out.prompt_logprobs[0] is None and {len(e) for e in out.prompt_logprobs[1:]} == {vocab}
    with pytest.raises(SamplingParamsError, match=r"logprobs must be >= 0 or -1 \(the whole vocabulary\), got -2"):
        SamplingParams(logprobs=-2)
