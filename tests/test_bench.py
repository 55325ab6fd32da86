"""`asynct bench` and the ablation of the original vLLM adaptation's stages run end to end on the CPU (tiny preset)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asynct.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_bench_cli_on_cpu(tmp_path, tiny_ckpt, capsys):
    plot, js = tmp_path / "b.png", tmp_path / "b.json"
    assert main(["bench", "--model", str(tiny_ckpt), "--scale", "0.02", "--compare", "hf",
                 "--plot", str(plot), "--json-out", str(js)]) == 0
    out = capsys.readouterr().out
    assert "copy bandwidth" in out and "step_over_roofline" in out
    rows = json.loads(js.read_text())["rows"]
    assert [r["workload"] for r in rows] == ["throughput", "gsm8k", "latency"]
    for r in rows:
        assert r["output_tokens"] > 0 and r["hf_output_tok_s"] > 0 and r["roofline_ms"] > 0
    gsm = rows[1]
    assert gsm["cached_prompt_tokens"] > 0        # the shared 5-shot prefix hit the prefix cache
    assert plot.stat().st_size > 1000


def test_bench_prefill_workload_scores_prompts(tmp_path, tiny_ckpt):
    """The opt-in prefill workload: unrelated prompts, one token each, no decode step to roof."""
    from asynct.entrypoints.bench import workload
    reqs = workload("prefill", 259, 1.0)
    assert len(reqs) == 512 and {sp.max_tokens for _, sp in reqs} == {1}
    assert 200 <= min(len(p) for p, _ in reqs) and max(len(p) for p, _ in reqs) <= 2000
    js = tmp_path / "p.json"
    assert main(["bench", "--model", str(tiny_ckpt), "--workloads", "prefill", "--scale", "0.02",
                 "--json-out", str(js)]) == 0
    row, = json.loads(js.read_text())["rows"]
    assert row["requests"] == 10 and row["output_tokens"] == 10 and row["prefill_tok_s"] > 0
    assert "step_ms" not in row and row["prefill_over_roofline"] > 0 and row["prefill_tflops"] > 0


def test_prefill_flops_count_linears_head_and_causal_attention(tiny_ckpt):
    """From the config alone: QKV, o_proj, gate/up and down once a token, the head once a
    prompt, QK^T and a @ V over the causal triangle."""
    from asynct import LLM
    from asynct.entrypoints.bench import prefill_flops
    eng = LLM(str(tiny_ckpt)).llm_engine
    c = eng.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = (q + 2 * kv) * c.hidden_size + q * c.hidden_size + 3 * c.intermediate_size * c.hidden_size
    want = lambda n: (2 * c.num_hidden_layers * per_layer * n + 2 * c.vocab_size * c.hidden_size  # noqa: E731
                      + 4 * c.num_hidden_layers * q * n * (n + 1) / 2)
    assert prefill_flops(eng.runner.model, c, [1, 7, 30]) == want(1) + want(7) + want(30)


def test_seed_ablation_runs(tiny_ckpt):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "seed_ablation.py"), "--model", str(tiny_ckpt),
                        "--requests", "4", "--new-tokens", "2", "--stages", "0,1,2,3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for stage in ("per-request Python loop", "padded batch", "length-bucketed", "vectorised gather"):
        assert stage in r.stdout


def test_host_phases_runs(tiny_ckpt):
    """benchmarks/host_phases.py on the CPU: a row of decode steps of every sequence, whose
    stop strings the detokenizer searched (its phase is timed, so not zero)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_phases.py"), "--model", str(tiny_ckpt),
                        "--rows", "16", "--tokens", "8", "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = r.stdout.strip().splitlines()[-1].split()
    assert row[0] == "1" and row[2] == "16", r.stdout
    assert float(row[row.index("|") + 5].strip("()")) > 0, r.stdout


def test_loglikelihood_bench_runs(tiny_ckpt):
    """benchmarks/loglikelihood_bench.py on the CPU: both request kinds, finite score sums."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loglikelihood_bench.py"), "--model", str(tiny_ckpt),
                        "--questions", "3", "--docs", "2", "--words", "40", "--rounds", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if " round " in line]
    assert [row.split()[0] for row in rows] == ["mc", "rolling"] and "12 requests" in rows[0], r.stdout
    assert all(float(row.split()[-1]) < 0 for row in rows), r.stdout


def test_bench_refuses_a_workload_whose_requests_failed(tiny_ckpt, capsys):
    """Prompts past max_model_len failed in the engine with a log line, and the row still
    reported every request and a token rate over the rest; now the run stops and says so."""
    assert main(["bench", "--model", str(tiny_ckpt), "--workloads", "throughput", "--scale", "0.02",
                 "--max-model-len", "16", "--no-warmup"]) == 2
    err = capsys.readouterr().err
    assert "requests failed" in err and "max_model_len=16" in err and "--max-model-len" in err


def test_bench_refuses_options_it_would_ignore(tiny_ckpt, capsys):
    """--preset beside --model, and --hf-requests without --compare hf, were taken and did nothing."""
    assert main(["bench", "--model", str(tiny_ckpt), "--preset", "small", "--workloads", "latency"]) == 2
    assert "--preset" in capsys.readouterr().err
    assert main(["bench", "--model", str(tiny_ckpt), "--hf-requests", "8", "--workloads", "latency"]) == 2
    assert "--compare hf" in capsys.readouterr().err


def test_a_step_is_charged_its_own_launch_not_the_next_ones(monkeypatch):
    """Async scheduling: the call that finishes step k also launches step k + 1. A decode step
    finished while a 23 ms mixed step launched was charged those 23 ms; each step's wall now
    holds its own launch (made in the call before) and not the next one's, and the walls still
    add up to the calls' time plus the first launch."""
    from types import SimpleNamespace
    from asynct.engine import llm_engine
    clock = iter([10.0, 13.0, 40.0, 45.0])      # the calls' ends
    monkeypatch.setattr(llm_engine.time, "perf_counter", lambda: next(clock))
    step = lambda kind, host: SimpleNamespace(kind=kind, host_s=host, events=None, kv_tokens=0,  # noqa: E731
                                              batch=SimpleNamespace(seqs=[0], total_tokens=1))
    eng = SimpleNamespace(step_log=[], _last_step_end=None, runner=SimpleNamespace(),
                          args=SimpleNamespace(async_scheduling=True))
    decode1, decode2, mixed = step("graph", 2.0), step("graph", 2.0), step("piecewise mixed", 23.0)
    record = llm_engine.LLMEngine._record
    record(eng, None, 8.0, decode1)       # launches decode1, finishes nothing
    record(eng, decode1, 10.0, decode2)   # 3 s: decode2's launch (2) and decode1's wait
    record(eng, decode2, 13.0, mixed)     # 27 s: the mixed step's launch (23) and 4 s more
    record(eng, mixed, 40.0, None)        # 5 s: the mixed step's device tail
    walls = [r.wall_s for r in eng.step_log]
    assert [r.kind for r in eng.step_log] == ["graph", "graph", "piecewise mixed"]
    assert walls == [3.0 - 2.0 + 2.0, 27.0 - 23.0 + 2.0, 5.0 + 23.0]
    assert sum(walls) == (45.0 - 10.0) + 2.0


def _distinct_kv_tokens(monkeypatch, runner):
    """Per decode-only step launched: the keys its rows hold in distinct KV blocks (a block that
    several rows share counted once), from the batch's own block table."""
    seen, launch = [], runner.launch

    def counting(batch):
        out = launch(batch)
        if batch.is_decode_only:
            bs, fill = runner.block_size, {}
            for row, (s, n) in zip(batch.block_table, zip(batch.seqs, batch.num_tokens)):
                keys = s.num_computed_tokens + n
                for j in range(-(-keys // bs)):
                    fill[int(row[j])] = max(fill.get(int(row[j]), 0), min(bs, keys - j * bs))
            seen.append(sum(fill.values()))
        return out
    monkeypatch.setattr(runner, "launch", counting)
    return seen


def test_decode_roofline_reads_a_shared_prefix_once(tiny_ckpt, monkeypatch):
    """gsm8k's rows hold the 5-shot prefix in the same KV blocks (prefix cache; the engine's
    cascade decode reads them once per tile of rows): the roofline counted the prefix once a
    row, 3.2x the KV the rows hold at bench-0.6b's gsm8k (scale 1), so a gsm8k step that took
    3.1x its roofline read as 1.00x. Its KV is now the distinct blocks' keys."""
    from asynct import LLM
    from asynct.entrypoints.bench import decode_roofline, run_engine, weight_bytes, workload
    llm = LLM(str(tiny_ckpt), enforce_eager=True)
    eng = llm.llm_engine
    reqs = workload("gsm8k", eng.config.vocab_size, 0.05)
    run_engine(llm, reqs[:8])                     # the bench's warm-up: the prefix is cached
    distinct = _distinct_kv_tokens(monkeypatch, eng.runner)
    res = run_engine(llm, reqs)
    decodes = [r for r in res["step_log"] if r.kind == "decode"]
    assert len(decodes) == len(distinct) > 0
    kv_per_token = eng.runner.block_bytes // eng.args.block_size
    written = [r.num_seqs for r in decodes]     # each row's new key and value
    want = sum(weight_bytes(eng.runner.model) + (k + w) * kv_per_token
               for k, w in zip(distinct, written)) / len(distinct)
    roof = decode_roofline(res, llm, 1.0, requests=reqs)
    assert roof["roofline_ms"] == pytest.approx(want * 1e3, rel=1e-9)
    assert sum(r.kv_tokens for r in decodes) > 2 * sum(distinct)     # what the old count read


def test_decode_roofline_counts_the_keys_a_step_writes():
    """A decode step writes each row's new key and value to the cache and reads them back with
    the rest (kv_tokens holds the read): the write was not counted."""
    from types import SimpleNamespace
    import torch
    from asynct.entrypoints.bench import decode_roofline
    model = torch.nn.Linear(4, 4, bias=False)      # 64 bytes of weights
    model.lm_head = None
    eng = SimpleNamespace(runner=SimpleNamespace(block_bytes=16 * 100, model=model),
                          args=SimpleNamespace(block_size=16, enable_prefix_caching=True))
    log = [SimpleNamespace(kind="graph", num_seqs=4, kv_tokens=40, wall_s=9.0),
           SimpleNamespace(kind="mixed", num_seqs=4, kv_tokens=400, wall_s=1.0)]
    roof = decode_roofline({"step_log": log}, SimpleNamespace(llm_engine=eng), 1e3)
    assert roof["roofline_ms"] == pytest.approx((64 + (40 + 4) * 100) / 1e3 * 1e3)
    assert roof["step_over_roofline"] == pytest.approx(9.0 / 4.464)


def test_prefill_roofline_counts_only_the_tokens_computed(tiny_ckpt):
    """The bench warms up on the workload's first 8 requests, so the measured prefill run finds
    their prompts in the prefix cache and computes only their last partial block; the FLOPs
    counted every prompt token (bench-0.6b, scale 1: 11,136 cached tokens, 2.1 % more FLOPs
    than computed). Cached tokens now cost no linear or attention FLOPs."""
    from asynct import LLM
    from asynct.entrypoints.bench import prefill_flops, prefill_roofline, run_engine, workload
    llm = LLM(str(tiny_ckpt), enforce_eager=True)
    eng, c = llm.llm_engine, llm.llm_engine.config
    reqs = workload("prefill", c.vocab_size, 0.02)
    run_engine(llm, reqs[:8])
    res = run_engine(llm, reqs)
    lens, cached = [len(p) for p, _ in reqs], res["cached_per_request"]
    assert sum(cached[:8]) > 0 and sum(n - k for n, k in zip(lens, cached)) == res["prefill_tokens"]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = (q + 2 * kv) * c.hidden_size + q * c.hidden_size + 3 * c.intermediate_size * c.hidden_size
    want = sum(2 * c.num_hidden_layers * per_layer * (n - k) + 2 * c.vocab_size * c.hidden_size
               + 4 * c.num_hidden_layers * q * sum(range(k + 1, n + 1)) for n, k in zip(lens, cached))
    assert prefill_flops(eng.runner.model, c, lens, cached) == want
    roof = prefill_roofline(res, llm, reqs, 1e12)
    assert roof["prefill_roofline_s"] == pytest.approx(want / 1e12)


def test_small_batch_roofline_reads_the_keys_of_the_timed_steps(tiny_ckpt, monkeypatch):
    """small_batch.py's step table roofed its 100 timed decode steps with the prompts' keys
    alone (384 a row), where those steps come after 10 warm-up steps and read 395-494 keys a
    row (and write one): bench-0.6b's roofline at 48 rows was 8 % short. The keys now come from
    the sequences before and after the timed steps, as the engine's own kv_tokens counts them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import small_batch
    from asynct import LLM
    llm = LLM(str(tiny_ckpt), enforce_eager=True, max_num_seqs=4)
    eng = llm.llm_engine
    small_batch.fill_decodes(llm, 4, [30, 40, 50, 60])
    for _ in range(10):
        eng.step()
    monkeypatch.setattr(small_batch, "mean_step", lambda eng, n: [eng.step() for _ in range(n)] and 1.0)
    eng.step_log = []
    seconds, keys = small_batch.timed_decode(eng, 4, 20)
    log, eng.step_log = eng.step_log, None
    assert seconds == 1.0 and {r.kind for r in log} == {"decode"}
    assert keys == pytest.approx(sum(r.kv_tokens for r in log) / len(log), abs=4)   # within a step's growth
    assert keys > 4 * (45 + 10)
    assert small_batch.step_roofline(100, 10, keys, 4, 1e-12) == pytest.approx(100 + (keys + 4) * 10)


def test_eval_bench_extrapolates_hf_generation_by_batches(tmp_path, monkeypatch):
    """eval_bench.py --hf-limit scaled hf's timed evaluation by problems (n / limit), but hf's
    generate_until runs whole batches of --hf-batch-size, each as long as its longest row (256
    tokens with random weights): 100 of 1,319 problems at batch 64 are 2 batches of the 21 the
    task takes, 10.5x, not 13.19x (hf's time 26 % too long, the speed-up as much too high);
    64 of 1,319 is 21x, not 20.6x. Loglikelihood tasks still scale by problems."""
    from types import SimpleNamespace
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import eval_bench
    (tmp_path / "hf.json").write_text(json.dumps({"results": {}, "eval_s": 8.0}))
    monkeypatch.setattr(eval_bench, "timed", lambda cmd, env: (10.0, 0, ""))
    args = SimpleNamespace(hf_batch_size=64, device="cpu", hf_dtype="auto", task="tiny_gsm_bench")
    assert eval_bench.run_hf("m", 100, 1319, tmp_path, {}, args)[0] == pytest.approx(10.0 + 8.0 * (21 / 2 - 1))
    assert eval_bench.run_hf("m", 64, 1319, tmp_path, {}, args)[0] == pytest.approx(10.0 + 8.0 * 20)
    args.task = "tiny_gsm_mc"
    assert eval_bench.run_hf("m", 50, 200, tmp_path, {}, args)[0] == pytest.approx(10.0 + 8.0 * 3)


def test_mlp_flags_matches_the_engine_pair_interpreted():
    """benchmarks/mlp_flags.py's counter-handshake MLP (a GPU lead) computes the engine's
    gate/up -> down pair in every mode: its timings mean nothing if its numbers differ."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mlp_flags.py"), "--check"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    diffs = {line.split(":")[0]: float(line.split()[-1]) for line in r.stdout.splitlines() if "max |diff|" in line}
    assert set(diffs) == {"grid", "count late", "count early"} and max(diffs.values()) < 1e-5, r.stdout
