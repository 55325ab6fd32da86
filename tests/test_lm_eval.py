"""lm-eval integration on the shipped trained model: the engine (`asynct` backend) scores every
sample of the shipped tasks exactly as the reference model does through lm-eval's own `hf`
backend (float32), and the trained model really solves the problems."""
import json
import math
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from asynct.integrations.lm_eval import AsyncTLM  # noqa: E402
from asynct.integrations.lm_eval_cli import task_manager  # noqa: E402
from asynct.integrations.tasks import TASKS_DIR  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-gsm"
LIMIT = {"tiny_gsm": 100, "tiny_gsm_mc": 50, "tiny_gsm_ppl": 20}
TOL = 1e-4


def evaluate(model, tasks, **kw):
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=task_manager(), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0, **kw)


@pytest.fixture(scope="module")
def engine_lm():
    return AsyncTLM(str(MODEL), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_lm():
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=str(MODEL), dtype="float32", device="cpu", batch_size=32)


@pytest.fixture(scope="module")
def runs(engine_lm, hf_lm):
    """Both backends on the same documents of every shipped task, one run per task (limits differ)."""
    out = {"asynct": {}, "hf": {}}
    for task, n in LIMIT.items():
        for name, lm in (("asynct", engine_lm), ("hf", hf_lm)):
            r = evaluate(lm, [task], limit=n)
            samples = sorted(r["samples"][task], key=lambda s: (s["doc_id"], s["filter"]))
            out[name][task] = (r["results"][task], samples)
    return out


def test_generate_task_accuracy(runs):
    res, _ = runs["asynct"]["tiny_gsm"]
    assert res["exact_match,strict-match"] >= 0.8, res


def test_generate_task_same_per_sample(runs):
    (res_a, a), (res_h, h) = runs["asynct"]["tiny_gsm"], runs["hf"]["tiny_gsm"]
    assert len(a) == len(h) == 2 * LIMIT["tiny_gsm"]  # a sample per document and filter
    for sa, sh in zip(a, h):
        assert sa["doc_id"] == sh["doc_id"]
        assert sa["resps"] == sh["resps"], sa["doc"]["question"]
        assert sa["filtered_resps"] == sh["filtered_resps"]
    assert res_a["exact_match,strict-match"] == res_h["exact_match,strict-match"]
    assert res_a["exact_match,flexible-extract"] == res_h["exact_match,flexible-extract"]


def test_multiple_choice_same_per_sample(runs):
    (res_a, a), (res_h, h) = runs["asynct"]["tiny_gsm_mc"], runs["hf"]["tiny_gsm_mc"]
    for sa, sh in zip(a, h):
        for (lp_a, greedy_a), (lp_h, greedy_h) in zip(sa["filtered_resps"], sh["filtered_resps"]):
            assert math.isclose(lp_a, lp_h, rel_tol=0, abs_tol=TOL), (lp_a, lp_h)
            assert greedy_a == greedy_h
        assert sa["acc"] == sh["acc"] and sa["acc_norm"] == sh["acc_norm"]
    assert res_a["acc,none"] == res_h["acc,none"]
    assert res_a["acc,none"] > 0.5, res_a  # chance is 0.25: the model does the arithmetic


def test_loglikelihood_rolling_same_per_sample(runs):
    (res_a, a), (res_h, h) = runs["asynct"]["tiny_gsm_ppl"], runs["hf"]["tiny_gsm_ppl"]
    for sa, sh in zip(a, h):
        assert math.isclose(sa["filtered_resps"][0], sh["filtered_resps"][0], rel_tol=0, abs_tol=TOL)
    assert math.isclose(res_a["bits_per_byte,none"], res_h["bits_per_byte,none"], rel_tol=1e-6)


def test_generate_until_with_min_tokens_cuts_whole_text(engine_lm):
    """min_tokens past the first `until` string: the engine's text stays whole (vLLM does not look
    for stop strings in the first min_tokens tokens), so lm-eval's cut at the first stop string
    gives what a plain request gives, as with lm-eval's vLLM backend."""
    from lm_eval.api.instance import Instance
    q = "Question: Tom has 3 apples and buys 4 more. How many apples does Tom have now?\nAnswer:"
    reqs = [Instance("generate_until", {}, (q, {"until": ["\n"], "max_gen_toks": 40, **kw}), 0)
            for kw in ({}, {"min_tokens": 12})]
    plain, late = engine_lm.generate_until(reqs, disable_tqdm=True)
    assert late == plain == " 3 + 4 = 7"


def test_generate_until_refuses_a_generation_that_leaves_no_context():
    """max_gen_toks >= max_length left no room for a context (the slice kept the whole prompt, or
    cut its head) and the engine then failed the whole run with a prompt-length error; now a
    ValueError names both numbers before any request runs, as lm-eval's hf backend refuses it."""
    from lm_eval.api.instance import Instance
    lm = AsyncTLM(str(MODEL), dtype="float32", device="cpu", max_model_len=64)     # max_length 64
    q = "Question: Tom has 3 apples and buys 4 more. How many apples does Tom have now?\nAnswer:"

    def req(max_gen):
        return Instance("generate_until", {}, (q, {"until": ["\n\n"], "max_gen_toks": max_gen}), 0)
    for max_gen in (64, 70):
        with pytest.raises(ValueError, match=f"max_gen_toks={max_gen} .* below max_length=64"):
            lm.generate_until([req(63), req(max_gen)], disable_tqdm=True)
    assert lm.prompt_tokens["total"] == 0                  # not even the good request ran
    assert lm.generate_until([req(63)], disable_tqdm=True)[0]     # the context's last token: still fine
    assert lm.prompt_tokens["total"] == 1


def test_windows_of_the_whole_context_score_as_hf(hf_lm):
    """max_length is the model's whole context (max_model_len), as lm-eval's hf backend takes
    it, and a scored window max_length + 1 tokens: the model reads max_length, the last is the
    request's forced sample. Windows stopped 1 short of the context, so rolling and long
    loglikelihood scores differed from hf's, and no max_length made them agree."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    with pytest.raises(ValueError, match=r"max_length=65 does not fit max_model_len=64"):
        AsyncTLM(str(MODEL), dtype="float32", device="cpu", max_model_len=64, max_length=65)
    lm = AsyncTLM(str(MODEL), dtype="float32", device="cpu", max_model_len=64)
    ref = HFLM(pretrained=str(MODEL), dtype="float32", device="cpu", max_length=64, batch_size=8)
    assert lm.max_length == 64
    text = "Question: Tom has 3 apples and buys 4 more. How many apples does Tom have now?\nAnswer: 7\n" * 3
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    (a,), (b,) = (m.loglikelihood_rolling(rolling, disable_tqdm=True) for m in (lm, ref))
    assert math.isclose(a, b, rel_tol=0, abs_tol=TOL)
    pairs = [Instance("loglikelihood", {}, (text, cont), 0) for cont in (" 7", " 3 + 4 = 7")]
    for (x, gx), (y, gy) in zip(lm.loglikelihood(pairs, disable_tqdm=True), ref.loglikelihood(pairs)):
        assert math.isclose(x, y, rel_tol=0, abs_tol=TOL) and gx == gy
    gen = [Instance("generate_until", {}, (text, {"until": ["\n\n"], "max_gen_toks": 8}), 0)]
    assert lm.generate_until(gen, disable_tqdm=True) == ref.generate_until(gen)


def test_add_bos_token_encodes_as_hf():
    """model_args add_bos_token, as lm-eval's hf backend takes it (the tokenizer loaded with it,
    then special tokens as it says): it was an unknown option."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    pairs = [Instance("loglikelihood", {}, ("Question: 2 + 2 =", " 4"), 0)]
    for flag, first in ((True, [258, 104]), ("false", [104, 105])):
        lm = AsyncTLM(str(MODEL), dtype="float32", device="cpu", add_bos_token=flag)
        ref = HFLM(pretrained=str(MODEL), dtype="float32", device="cpu", add_bos_token=flag == True)  # noqa: E712
        assert lm.tok_encode("hi")[:2] == ref.tok_encode("hi")[:2] == first
        assert lm.tok_encode("<|bos|>hi") == ref.tok_encode("<|bos|>hi") == [258, 104, 105]
        ((x, gx),), ((y, gy),) = lm.loglikelihood(pairs, disable_tqdm=True), ref.loglikelihood(pairs)
        assert math.isclose(x, y, rel_tol=0, abs_tol=TOL) and gx == gy
    with pytest.raises(ValueError, match="add_bos_token must be True or False"):
        AsyncTLM(str(MODEL), dtype="float32", device="cpu", add_bos_token="maybe")


def edited_model(tmp_path, edit) -> str:
    """A copy of the shipped model whose weights `edit` (a dict of tensors) changed."""
    import shutil

    from safetensors.torch import load_file, save_file
    out = tmp_path / "model"
    shutil.copytree(MODEL, out)
    weights = load_file(out / "model.safetensors")
    edit(weights)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_until_a_special_token_stops_at_it(tmp_path):
    """A stop string that is a special token's text ("<|pad|>" here, a chat model's
    "<|im_end|>") stops generation at that token, as lm-eval's hf backend stops: the engine's
    text leaves special tokens out, so the string never showed in it."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    def pad_for_hash(w):     # "<|pad|>" (257) comes where "#" (35) did
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            w[name][257] = w[name][35]
        w["lm_head.weight"][35] = -w["lm_head.weight"][35]
    path = edited_model(tmp_path, pad_for_hash)
    q = "Question: Tom has 3 apples and buys 4 more. How many apples does Tom have now?\nAnswer:"
    reqs = [Instance("generate_until", {}, (q, {"until": until, "max_gen_toks": 40}), 0)
            for until in (["<|pad|>"], ["Question:", "<|pad|>"])]
    got = AsyncTLM(path, dtype="float32", device="cpu").generate_until(reqs, disable_tqdm=True)
    want = HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=2).generate_until(reqs)
    assert got == want == [" 3 + 4 = 7\n"] * 2


def test_rolling_windows_and_empty_context_match_reference():
    """Several rolling windows per text (a short max_length), and loglikelihood with an empty
    context (scored after BOS): both through lm-eval's request path on each backend."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    short_a = AsyncTLM(str(MODEL), dtype="float32", device="cpu", max_length=48)
    short_h = HFLM(pretrained=str(MODEL), dtype="float32", device="cpu", max_length=48, batch_size=8)
    texts = ["Question: Tom has 3 apples and buys 4 more. How many apples does Tom have now?\n"
             "Answer: 3 + 4 = 7\n#### 7",
             "Question: Sara buys 5 bags with 2 pens in each bag. How many pens does Sara buy?\n"
             "Answer: 5 * 2 = 10\n#### 10\n\n" * 3]
    # (texts that share no window: lm-eval 0.4.13's hf backend mis-sums requests whose windows coincide)
    roll = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts]
    for x, y in zip(short_a.loglikelihood_rolling(roll), short_h.loglikelihood_rolling(roll)):
        assert math.isclose(x, y, rel_tol=0, abs_tol=TOL)
    pairs = [Instance("loglikelihood", {}, args, 0) for args in
             [("", "Question: Sara has 5 pens."), ("Question: 2 + 2 =", " 4"), ("Answer: ", "9 * 9 = 81")]]
    for (x, gx), (y, gy) in zip(short_a.loglikelihood(pairs), short_h.loglikelihood(pairs)):
        assert math.isclose(x, y, rel_tol=0, abs_tol=TOL) and gx == gy
    cont = short_a.tok_encode(" 1 + 1 = 2." * 8, add_special_tokens=False)   # 88 tokens, past max_length 48
    (long, _), (window, _) = short_a._loglikelihood_tokens([(None, [5, 6], cont), (None, cont[:-48], cont[-48:])])
    assert long == window and math.isfinite(long)     # its last 48 tokens, as that window scores them


def test_choices_take_their_shared_context_from_the_prefix_cache(engine_lm, hf_lm):
    """A question's choices, submitted side by side as lm-eval does, in one run of the engine:
    the first request of each context computes it and the others take its full blocks from the
    prefix cache (in the same step: each computed the context whole before the engine shared
    blocks from the step that computes them), scoring exactly as the reference does."""
    from lm_eval.api.instance import Instance
    questions = [f"Question: Tom has {a} apples and buys {b} more apples at the shop on the corner. "
                 f"How many apples does Tom have now?\nAnswer:" for a, b in ((3, 4), (12, 9), (5, 30))]
    pairs = [Instance("loglikelihood", {}, (q, f" {c}"), 0) for q in questions for c in (7, 21, 35, 1)]
    before = dict(engine_lm.prompt_tokens)
    got = engine_lm.loglikelihood(pairs)
    bs = engine_lm.llm.llm_engine.block_manager.block_size
    shared = sum((len(engine_lm.tok_encode(q)) - 1) // bs * bs for q in questions)
    assert engine_lm.prompt_tokens["cached"] - before["cached"] >= 3 * shared > 0
    for (x, gx), (y, gy) in zip(got, hf_lm.loglikelihood(pairs)):
        assert math.isclose(x, y, rel_tol=0, abs_tol=TOL) and gx == gy


def test_choices_hit_the_cache_when_their_contexts_outgrow_it(hf_lm):
    """Twelve questions' contexts fill the KV cache three times over: each question's choices,
    side by side, still share its context (an early version ran every context's first choice
    first, which evicted the early contexts before their other choices came), with scores as
    the reference's."""
    from lm_eval.api.instance import Instance
    questions = [f"Question: Tom has {a} apples and buys {a + 7} more apples at the shop on the corner. "
                 f"How many apples does Tom have now?\nAnswer:" for a in range(10, 22)]
    pairs = [Instance("loglikelihood", {}, (q, f" {c}"), 0) for q in questions for c in (7, 21, 35, 1)]
    lm = AsyncTLM(str(MODEL), dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=256)
    got = lm.loglikelihood(pairs)
    bs = lm.llm.llm_engine.block_manager.block_size
    shared = sum((len(lm.tok_encode(q)) - 1) // bs * bs for q in questions)
    assert lm.prompt_tokens["cached"] >= 3 * shared > 0, (lm.prompt_tokens, shared)
    for (x, gx), (y, gy) in zip(got, hf_lm.loglikelihood(pairs)):
        assert math.isclose(x, y, rel_tol=0, abs_tol=TOL) and gx == gy


def eval_cli(*argv) -> int:
    from asynct.entrypoints.cli import main
    return main(["eval", *map(str, argv)])


def read_back(output_path: Path):
    """The run's files as lm-eval's own helpers find them: (results, {task: samples})."""
    from lm_eval.utils import (get_file_task_name, get_latest_filename, get_results_filenames,
                               get_sample_results_filenames)
    files = [str(p) for p in output_path.rglob("*.json*")]
    results = json.loads(Path(get_latest_filename(get_results_filenames(files))).read_text())
    samples = {get_file_task_name(Path(f).stem): [json.loads(line) for line in open(f)]
               for f in get_sample_results_filenames(files)}
    return results, samples


def test_eval_cli_is_lm_evals(capsys, tmp_path):
    """lm-eval's flags, and its EvaluationTracker layout: <path>/<model>/results_<time>.json and
    samples_<task>_<time>.jsonl, with the model args recorded."""
    out = tmp_path / "out"
    assert eval_cli("--model", "asynct", "--model_args", f"pretrained={MODEL},dtype=float32,max_num_seqs=8",
                    "--tasks", "tiny_gsm", "tiny_gsm_mc", "--limit", 4, "--batch_size", 4, "--seed", 3,
                    "--gen_kwargs", "max_gen_toks=48", "--output_path", out, "--log_samples") == 0
    printed = capsys.readouterr().out
    assert "|tiny_gsm" in printed and "asynct eval:" in printed and "generation and scoring" in printed
    [model_dir] = out.iterdir()
    from lm_eval.utils import sanitize_model_name
    assert model_dir.name == sanitize_model_name(str(MODEL))
    results, samples = read_back(out)
    assert results["config"]["model"] == "asynct"
    assert results["config"]["model_args"]["pretrained"] == str(MODEL)
    assert results["config"]["random_seed"] == 3 and results["config"]["fewshot_seed"] == 3
    assert results["config"]["gen_kwargs"] == {"max_gen_toks": 48}
    assert results["results"]["tiny_gsm"]["exact_match,strict-match"] == 1.0
    assert sorted(samples) == ["tiny_gsm", "tiny_gsm_mc"]
    assert len(samples["tiny_gsm"]) == 2 * 4  # a sample per document and filter


def test_eval_cli_data_parallel(capsys, tmp_path, engine_lm):
    """data_parallel_size in --model_args reaches LLM: two engine processes answer each sample as
    the in-process engine does."""
    from asynct.engine.data_parallel import DataParallelEngine
    out = tmp_path / "out"
    try:
        assert eval_cli("--model", MODEL, "--model_args", "dtype=float32,max_num_seqs=8,data_parallel_size=2",
                        "--tasks", "tiny_gsm", "tiny_gsm_mc", "--limit", 4, "--gen_kwargs", "max_gen_toks=48",
                        "--output_path", out, "--log_samples") == 0
        assert isinstance(AsyncTLM.latest.llm.llm_engine, DataParallelEngine)
    finally:
        AsyncTLM.latest.llm.llm_engine.shutdown()
    assert "asynct eval:" in capsys.readouterr().out
    results, samples = read_back(out)
    assert results["results"]["tiny_gsm"]["exact_match,strict-match"] == 1.0
    one = evaluate(engine_lm, ["tiny_gsm", "tiny_gsm_mc"], limit=4, gen_kwargs="max_gen_toks=48")["samples"]
    for task in ("tiny_gsm", "tiny_gsm_mc"):
        key = lambda s: (s["doc_id"], s["filter"])  # noqa: E731
        for a, b in zip(sorted(samples[task], key=key), sorted(one[task], key=key), strict=True):
            flat_a, flat_b = flat(a["filtered_resps"]), flat(b["filtered_resps"])
            assert len(flat_a) == len(flat_b), task
            for x, y in zip(flat_a, flat_b):   # texts and flags equal, scores within TOL
                assert x == y or (isinstance(x, float) and math.isclose(x, y, rel_tol=0, abs_tol=TOL)), task


def flat(x) -> list:
    """Scalars of nested responses; lm-eval's sample files write (score, flag) pairs as strings."""
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in flat(item)]
    if isinstance(x, bool):
        return [str(x)]
    try:
        return [float(x)]
    except ValueError:
        return [x]


def test_eval_cli_shorthand_include_path_and_chat_template(capsys, tmp_path):
    """`--model DIR` is `--model asynct --model_args pretrained=DIR`; --include_path adds tasks to
    the shipped ones (one here includes a shipped YAML); --apply_chat_template and
    --num_fewshot reach lm-eval."""
    (tmp_path / "my_gsm.yaml").write_text(
        f"include: {TASKS_DIR / 'tiny_gsm' / 'tiny_gsm.yaml'}\ntask: my_gsm\n")
    out = tmp_path / "out"
    assert eval_cli("--model", MODEL, "--include_path", tmp_path, "--tasks", "my_gsm,tiny_gsm_ppl",
                    "--limit", 2, "--num_fewshot", 1, "--apply_chat_template", "--output_path", out) == 0
    results, _ = read_back(out)
    assert results["config"]["model"] == "asynct" and results["config"]["model_args"]["pretrained"] == str(MODEL)
    assert results["n-shot"]["my_gsm"] == 1 and "bits_per_byte,none" in results["results"]["tiny_gsm_ppl"]
    assert results["chat_template"]  # the shipped model's template was applied


def test_eval_cli_missing_task_says_how_tasks_are_found(capsys):
    assert eval_cli("--tasks", "gsm8k") == 2
    err = capsys.readouterr().err
    assert "Tasks not found: gsm8k" in err and "--include_defaults" in err and "Traceback" not in err


def test_eval_cli_model_path_that_is_not_there(capsys, tmp_path):
    """`--model DIR` with a mistyped DIR got lm-eval's "no model for this name found!" and a list
    of ~40 lm-eval model names."""
    with pytest.raises(SystemExit) as e:
        eval_cli("--model", tmp_path / "nope", "--tasks", "tiny_gsm", "--limit", 1)
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"asynct eval: error: --model {tmp_path / 'nope'}: no such checkpoint "
                                       "directory, and no lm-eval model of that name (asynct loads local "
                                       "checkpoints only)\n")
    (tmp_path / "model.safetensors").write_bytes(b"")      # a checkpoint's file, not its folder
    with pytest.raises(SystemExit):
        eval_cli("--model", tmp_path / "model.safetensors", "--tasks", "tiny_gsm", "--limit", 1)
    assert capsys.readouterr().err == (f"asynct eval: error: --model {tmp_path / 'model.safetensors'}: a file, not "
                                       "a checkpoint directory\n")


def test_eval_cli_shipped_tasks_warn_nothing(caplog):
    """The shipped YAMLs load without lm-eval's warnings (missing higher_is_better and the like)."""
    import logging
    with caplog.at_level(logging.WARNING):
        task_manager().load(["tiny_gsm", "tiny_gsm_mc", "tiny_gsm_ppl"])
    assert [r.getMessage() for r in caplog.records if "Custom kwargs" not in r.getMessage()] == []


def test_registered_by_name():
    """`model="asynct"` with string model_args, as lm-eval's registry builds models."""
    r = lm_eval.simple_evaluate(model="asynct", model_args=f"pretrained={MODEL},max_num_seqs=8,dtype=float32",
                                tasks=["tiny_gsm"], limit=4, task_manager=task_manager())
    assert r["results"]["tiny_gsm"]["exact_match,strict-match"] == 1.0
    assert "hf" in lm_eval.api.registry.MODEL_REGISTRY  # registering ours kept the built-in models


def test_decode_graphs_wait_for_a_generate_unless_asked(engine_lm):
    """Loglikelihood tasks never decode: the engine lm-eval gets captures its decode graphs at
    the first decode step (tests/test_gpu_runtime.py), unless model_args say otherwise."""
    assert engine_lm.llm.llm_engine.args.lazy_decode_graphs is True
    lm = AsyncTLM(str(MODEL), dtype="float32", device="cpu", lazy_decode_graphs="false", num_kv_blocks=8)
    assert lm.llm.llm_engine.args.lazy_decode_graphs is False


def test_generate_until_skips_empty_stop_strings(engine_lm):
    """An empty `until` string (a task's [""], or the EOS of a tokenizer that decodes it to "") is
    no stop, as lm-eval's post-processing skips it; the engine refused it and failed the run."""
    from lm_eval.api.instance import Instance
    q = "Question: Tom has 3 apples and buys 4 more. How many apples does Tom have now?\nAnswer:"
    reqs = [Instance("generate_until", {}, (q, {"until": until, "max_gen_toks": 12}), 0)
            for until in (["", "\n"], ["\n"])]
    empty, plain = engine_lm.generate_until(reqs, disable_tqdm=True)
    assert empty == plain == " 3 + 4 = 7"


def test_generate_until_refuses_gen_kwargs_it_cannot_apply(engine_lm):
    """num_beams > 1 was dropped without a word and the run scored plain greedy text where
    lm-eval's hf backend applies it; now a ValueError names it before any request runs.
    num_beams=1 (greedy, as some tasks say) still runs; repetition_penalty is applied (it was
    refused while the engine had no penalties)."""
    from lm_eval.api.instance import Instance
    q = "Question: Tom has 3 apples and buys 4 more. How many apples does Tom have now?\nAnswer:"

    def req(**kw):
        return Instance("generate_until", {}, (q, {"until": ["\n"], "max_gen_toks": 12, **kw}), 0)
    before = engine_lm.prompt_tokens["total"]
    with pytest.raises(ValueError, match="gen_kwargs num_beams not supported"):
        engine_lm.generate_until([req(), req(num_beams=4)], disable_tqdm=True)
    assert engine_lm.prompt_tokens["total"] == before
    kept = req(num_beams=1, repetition_penalty=1.0, do_sample=False)     # values that change nothing
    assert engine_lm.generate_until([kept], disable_tqdm=True) == [" 3 + 4 = 7"]
    penalised = engine_lm.generate_until([req(repetition_penalty=5.0)] * 2, disable_tqdm=True)
    assert penalised[0] == penalised[1] != " 3 + 4 = 7"


def test_eval_cli_bad_model_args_are_one_line(capsys):
    """An unknown model_args option was a TypeError traceback, and a value of the wrong type a
    bare "invalid literal for int()" naming no option; both are one error line naming it."""
    assert eval_cli("--model_args", f"pretrained={MODEL},max_num_seq=8", "--tasks", "tiny_gsm", "--limit", 1) == 2
    # (the last line: lm-eval's log handlers from earlier tests may print "--- Logging error ---")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("asynct eval: error: unknown asynct model_args option 'max_num_seq'")
    assert "max_num_seqs" in last
    assert eval_cli("--model_args", f"pretrained={MODEL},max_num_seqs=many", "--tasks", "tiny_gsm", "--limit", 1) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("asynct eval: error: asynct model_args option max_num_seqs='many'")


def test_chat_template_without_a_system_role_drops_it_as_hf(tmp_path):
    """A chat template that raises on a system message (--system_instruction) failed the run; lm-eval's
    hf and vllm backends render the conversation without the system message, and so does this one."""
    from lm_eval.models.huggingface import HFLM

    from asynct.model.checkpoint import make_checkpoint
    ckpt = make_checkpoint("tiny", tmp_path / "ckpt", seed=1, tokenizer=True)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('no system role') }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in ckpt.glob("chat_template.*"):
        f.unlink()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    lm = AsyncTLM(str(ckpt), device="cpu", num_kv_blocks=8)
    hf = HFLM(pretrained=str(ckpt), device="cpu", batch_size=1)
    assert lm.apply_chat_template(chat) == hf.apply_chat_template(chat) == "<|user|>2 + 2?\n<|assistant|>"


def test_sampled_generations_repeat_under_the_same_seed():
    """The engine was unseeded unless model_args named a seed: a sampled run drew from whatever
    torch state the process was in (in an engine process, none that lm-eval's --seed set), and
    two runs with the same settings gave different texts. As lm-eval's vllm backend, model_args
    `seed` (default 1234) seeds the engine: the same seed gives the same texts, another seed others."""
    from lm_eval.api.instance import Instance
    questions = [f"Question: Tom has {a} apples and buys {a + 4} more. How many apples does Tom have now?\nAnswer:"
                 for a in range(3, 6)]
    reqs = [Instance("generate_until", {}, (q, {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": True,
                                                "temperature": 3.0}), 0) for q in questions]

    def run(**kw):
        lm = AsyncTLM(str(MODEL), dtype="float32", device="cpu", num_kv_blocks=32, **kw)
        assert lm.llm.llm_engine.args.seed == kw.get("seed", 1234)
        return lm.generate_until(reqs, disable_tqdm=True)
    first = run()
    assert run() == first
    assert run(seed=7) != first


def test_a_mistyped_boolean_model_arg_is_an_error(capsys):
    """enforce_eager=ture read as false (anything but 1, true or yes did), and the run went on
    without a word; a boolean option now takes what vLLM reads as one (lm-eval's vllm backend
    passes model_args on: true/false in any case, 1/0, yes/no, on/off) and refuses anything else,
    naming the option and the value, through lm-eval's entry and `asynct eval`, before any engine
    starts."""
    from asynct.integrations.lm_eval_args import _engine_args
    assert _engine_args({"enforce_eager": "True", "enable_prefix_caching": "FALSE", "async_scheduling": False}) == \
        {"enforce_eager": True, "enable_prefix_caching": False, "async_scheduling": False}
    assert _engine_args({"enforce_eager": 1, "enable_prefix_caching": "no", "async_scheduling": "On"}) == \
        {"enforce_eager": True, "enable_prefix_caching": False, "async_scheduling": True}
    for bad in ("ture", "", 2):
        with pytest.raises(ValueError, match=rf"option enforce_eager={bad!r}: not a bool \(true/false, 1/0"):
            _engine_args({"enforce_eager": bad})
    with pytest.raises(ValueError, match=r"option enforce_eager='ture'"):
        lm_eval.simple_evaluate(model="asynct", model_args=f"pretrained={MODEL},enforce_eager=ture",
                                tasks=["tiny_gsm"], limit=1, task_manager=task_manager())
    assert eval_cli("--model_args", f"pretrained={MODEL},enforce_eager=ture", "--tasks", "tiny_gsm", "--limit", 1) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("asynct eval: error: asynct model_args option enforce_eager='ture': not a bool "
                    "(true/false, 1/0, yes/no, on/off)")


def test_max_batch_size_bounds_the_engine_batch():
    """lm-eval's --max_batch_size was dropped; the vllm backend makes it vLLM's max_num_seqs
    (unless model_args set max_num_seqs), and so does this one."""
    from lm_eval.api.registry import get_model
    args = f"pretrained={MODEL},dtype=float32,device=cpu"
    for extra, want in (("", 8), (",max_num_seqs=4", 4)):
        lm = get_model("asynct").create_from_arg_string(args + extra, {"batch_size": 1, "max_batch_size": 8})
        assert lm.llm.llm_engine.args.max_num_seqs == want


def test_eval_takes_the_device_from_model_args(capsys):
    """`asynct eval --model_args device=cpu` ended in a TypeError traceback (lm-eval also passes
    its --device to the model); two different devices are a one-line error."""
    args = f"pretrained={MODEL},dtype=float32,device=cpu"
    assert eval_cli("--model_args", args, "--tasks", "tiny_gsm", "--limit", 1) == 0
    assert eval_cli("--model_args", args, "--device", "cpu", "--tasks", "tiny_gsm", "--limit", 1) == 0
    with pytest.raises(SystemExit) as e:
        eval_cli("--model_args", args, "--device", "cuda:1", "--tasks", "tiny_gsm", "--limit", 1)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "asynct eval: error: the device is given twice: --device cuda:1 and --model_args device=cpu; give one")
