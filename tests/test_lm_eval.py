"""lm-eval integration on the shipped trained model: the engine (`asynct` backend) scores every
sample of the shipped tasks exactly as the reference model does through lm-eval's own `hf`
backend (float32), and the trained model really solves the problems."""
import math
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from asynct.integrations.lm_eval import AsyncTLM  # noqa: E402
from asynct.integrations.lm_eval_cli import task_manager  # noqa: E402

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


def test_eval_cli_smoke(capsys, tmp_path):
    from asynct.entrypoints.cli import main
    assert main(["eval", "--model", str(MODEL), "--tasks", "tiny_gsm,tiny_gsm_mc", "--limit", "8",
                 "--output_path", str(tmp_path), "--batch_size", "4"]) == 0
    out = capsys.readouterr().out
    assert "tiny_gsm" in out and "exact_match" in out and "acc" in out
    assert (tmp_path / "results.json").exists()


def test_registered_by_name():
    """`model="asynct"` with string model_args, as lm-eval's registry builds models."""
    r = lm_eval.simple_evaluate(model="asynct", model_args=f"pretrained={MODEL},max_num_seqs=8,dtype=float32",
                                tasks=["tiny_gsm"], limit=4, task_manager=task_manager())
    assert r["results"]["tiny_gsm"]["exact_match,strict-match"] == 1.0
    assert "hf" in lm_eval.api.registry.MODEL_REGISTRY  # registering ours kept the built-in models
