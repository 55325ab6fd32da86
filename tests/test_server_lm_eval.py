"""lm-eval's `local-completions` model against a live server scores every sample exactly as the
in-process engine (the `asynct` lm-eval backend) does: loglikelihood through echo logprobs,
rolling loglikelihood, and greedy generation with stop strings."""
import math
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from asynct.entrypoints.serve.api_server import make_app  # noqa: E402
from asynct.entrypoints.serve.launch import ServerThread  # noqa: E402
from asynct.integrations.lm_eval import AsyncTLM  # noqa: E402
from asynct.integrations.lm_eval_cli import task_manager  # noqa: E402

TRAINED = Path(__file__).resolve().parents[1] / "models" / "tiny-gsm"
LIMIT = {"tiny_gsm_mc": 12, "tiny_gsm_ppl": 4, "tiny_gsm": 6}
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt):
    # the shipped trained model where it is there (real scores), else the random tiny one
    return TRAINED if (TRAINED / "config.json").exists() else tiny_ckpt


def evaluate(model, task):
    r = lm_eval.simple_evaluate(model=model, tasks=[task], limit=LIMIT[task], task_manager=task_manager(),
                                log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                fewshot_random_seed=0)
    return sorted(r["samples"][task], key=lambda s: (s["doc_id"], s["filter"]))


@pytest.fixture(scope="module")
def runs(model_dir, monkeypatch_module):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    monkeypatch_module.setenv("OPENAI_API_KEY", "")
    local = AsyncTLM(str(model_dir), dtype="float32", device="cpu")
    with ServerThread(make_app(model_dir, served_model_name="served", dtype="float32")) as url:
        remote = LocalCompletionsAPI(base_url=url + "/v1/completions", model="served", tokenizer_backend="remote",
                                     batch_size=4, num_concurrent=2, max_retries=1)
        return {task: (evaluate(local, task), evaluate(remote, task)) for task in LIMIT}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_loglikelihood_same_per_sample(runs):
    local, remote = runs["tiny_gsm_mc"]
    assert len(local) == len(remote) == LIMIT["tiny_gsm_mc"]
    for a, b in zip(local, remote):
        assert a["doc_id"] == b["doc_id"]
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(a["filtered_resps"], b["filtered_resps"]):
            assert math.isclose(lp_a, lp_b, rel_tol=0, abs_tol=TOL), (lp_a, lp_b)
            assert greedy_a == greedy_b
        assert a["acc"] == b["acc"]
    assert all(lp < 0 for s in remote for lp, _ in s["filtered_resps"])    # really scored, not zeros


def test_rolling_loglikelihood_same_per_sample(runs):
    local, remote = runs["tiny_gsm_ppl"]
    for a, b in zip(local, remote):
        assert math.isclose(a["filtered_resps"][0], b["filtered_resps"][0], rel_tol=0, abs_tol=TOL)


def test_generation_same_per_sample(runs):
    local, remote = runs["tiny_gsm"]
    assert len(local) == len(remote) == 2 * LIMIT["tiny_gsm"]     # a sample per document and filter
    for a, b in zip(local, remote):
        assert a["resps"] == b["resps"], a["doc"]["question"]
    assert any(s["resps"][0][0].strip() for s in remote)
