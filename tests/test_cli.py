"""The `asynct` command line: flag checks before any heavy import, token-id prompts, stdin."""
import io
import json

import pytest

from asynct.entrypoints.cli import main


def test_bad_preset_fails_at_parse_time(capsys):
    with pytest.raises(SystemExit) as e:
        main(["make-checkpoint", "/nonexistent/out", "--preset", "huge"])
    assert e.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err


def test_cudagraph_mode_flag_matches_the_engine(capsys):
    """The CLI names the modes without importing the engine: both lists must agree."""
    from asynct.engine.engine_args import CUDAGRAPH_MODES
    from asynct.entrypoints.cli import CUDAGRAPH_MODES as CLI_MODES
    assert CLI_MODES == CUDAGRAPH_MODES
    with pytest.raises(SystemExit) as e:
        main(["generate", "/nonexistent", "--cudagraph-mode", "piecewise"])
    assert e.value.code == 2 and "invalid choice: 'piecewise'" in capsys.readouterr().err


def test_generate_takes_token_ids(tiny_ckpt, capsys):
    assert main(["generate", str(tiny_ckpt), "--prompt-token-ids", "1,2,3", "--prompt-token-ids", "4 5",
                 "--max-tokens", "3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt_token_ids"] for r in rows] == [[1, 2, 3], [4, 5]]
    assert all(len(r["token_ids"]) == 3 for r in rows)


def test_generate_exits_1_when_a_prompt_failed(tiny_ckpt, capsys):
    """Every prompt could fail and the command still exited 0: a script could not tell."""
    assert main(["generate", str(tiny_ckpt), "--prompt-token-ids", "1,99999", "--prompt-token-ids", "1,2",
                 "--max-tokens", "2", "--json"]) == 1
    captured = capsys.readouterr()
    assert "prompt token id 99999" in captured.err and len(captured.out.splitlines()) == 1


def test_generate_says_a_failed_prompts_error_once(tiny_ckpt, capsys, caplog):
    """A failed prompt's error came twice: the engine's log line, under a request id, and the
    command's own line, naming no prompt. One line now says which prompt failed and why; the
    exit code stays 1."""
    assert main(["generate", str(tiny_ckpt), "--prompt", "Hi", "--prompt-token-ids", "1,99999",
                 "--prompt-token-ids", "1,2", "--max-tokens", "2"]) == 1
    assert not [r for r in caplog.records if "99999" in r.getMessage()]
    assert capsys.readouterr().err == ("error: prompt 2 (token ids 1,99999): prompt token id 99999 is outside "
                                       "the vocabulary (size 259)\n")


def test_generate_reads_stdin_as_one_prompt(tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Question: first line\nsecond line\n"))
    assert main(["generate", str(tiny_ckpt), "--max-tokens", "2", "--json"]) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["prompt"] == "Question: first line\nsecond line\n"


@pytest.mark.parametrize("device", ["bogus", "cuda", "cuda:7"])
def test_a_device_that_is_not_there_is_a_clear_error(tiny_ckpt, capsys, monkeypatch, device):
    """An unparsable device, or a GPU the machine lacks, ended in a traceback from torch
    (RuntimeError listing every device type, AssertionError "not compiled with CUDA")."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", str(tiny_ckpt), "--prompt-token-ids", "1,2", "--device", device]) == 2
    assert f"asynct generate: error: device={device!r}" in capsys.readouterr().err


def test_make_checkpoint_onto_a_file_is_a_clear_error(tmp_path, capsys):
    """An output path that is a file raised FileExistsError (an OSError the CLI did not catch)."""
    target = tmp_path / "a-file"
    target.write_text("")
    assert main(["make-checkpoint", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asynct make-checkpoint: error: ") and str(target) in err


def test_an_engine_that_dies_loading_is_one_line(tiny_ckpt, capsys, monkeypatch):
    """`asynct serve` whose engine process died while loading (killed for memory) ended in the
    parent's traceback; other RuntimeErrors still raise."""
    from asynct.engine.core_client import EngineDeadError
    from asynct.entrypoints import serve

    def dies(args):
        raise EngineDeadError("the engine process exited with code -9 while loading")
    monkeypatch.setattr(serve, "cmd_serve", dies)
    assert main(["serve", str(tiny_ckpt)]) == 1
    assert capsys.readouterr().err == "asynct serve: error: the engine process exited with code -9 while loading\n"
    monkeypatch.setattr(serve, "cmd_serve", lambda args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["serve", str(tiny_ckpt)])


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_port_outside_the_tcp_range_fails_at_parse_time(capsys, port):
    """--port 99999 was taken: the resolver wrapped it, and the server listened on 34463."""
    with pytest.raises(SystemExit) as e:
        main(["serve", "/nonexistent", "--port", port])
    assert e.value.code == 2 and "argument --port" in capsys.readouterr().err


def test_generate_takes_the_generation_configs_defaults_for_unset_flags(tiny_ckpt, tmp_path, capsys):
    """--generation-config and --override-generation-config were accepted by `asynct generate`
    and changed nothing: its flags' own defaults (greedy, 64 tokens) made every request's
    SamplingParams. As the server's unset fields, unset flags take the generation config's
    values; a flag given wins."""
    import shutil
    ckpt = tmp_path / "m"
    shutil.copytree(tiny_ckpt, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))

    def lengths(*flags):
        assert main(["generate", str(ckpt), "--prompt-token-ids", "1,2,3", "--json", *flags]) == 0
        return [len(json.loads(line)["token_ids"]) for line in capsys.readouterr().out.splitlines()]
    assert lengths() == [3]
    assert lengths("--override-generation-config", '{"max_new_tokens": 5}') == [5]
    assert lengths("--max-tokens", "2") == [2]
    assert lengths("--generation-config", "vllm", "--max-tokens", "7") == [7]



@pytest.mark.parametrize("alias,dtype", [("half", "float16"), ("float", "float32")])
def test_vllms_dtype_aliases(tiny_ckpt, capsys, monkeypatch, alias, dtype):
    """`--dtype half` (or float), as vLLM's command lines write it, was an invalid choice, while
    LLM(dtype="half") ran. The engine runs in the dtype it names."""
    import asynct
    import torch
    made, real = [], asynct.LLM
    monkeypatch.setattr(asynct, "LLM", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    assert main(["generate", str(tiny_ckpt), "--prompt-token-ids", "1,2", "--max-tokens", "2", "--dtype", alias]) == 0
    assert made[0].llm_engine.dtype == getattr(torch, dtype)


def test_tokenizer_flag(tiny_ckpt, tmp_path, capsys):
    """LLM(tokenizer=...) had no flag: `--tokenizer`, as vLLM's command lines give it, was an
    unrecognised argument, so a checkpoint with its tokenizer elsewhere took no text prompt."""
    import shutil
    ckpt = tmp_path / "weights-only"
    shutil.copytree(tiny_ckpt, ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / f).unlink()
    assert main(["generate", str(ckpt), "--prompt", "Hi", "--max-tokens", "2", "--json"]) == 1
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--tokenizer", str(tiny_ckpt), "--prompt", "Hi", "--max-tokens", "2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_token_ids"] == list(b"Hi")


@pytest.mark.parametrize("env,key", [({"VLLM_API_KEY": "v"}, "v"), ({"ASYNCT_API_KEY": "a", "VLLM_API_KEY": "v"}, "a"),
                                     ({}, None)])
def test_serve_takes_vllms_api_key_variable(monkeypatch, env, key):
    """A deployment moved from `vllm serve` with VLLM_API_KEY set served every route with no key."""
    from asynct.entrypoints.cli import build_parser
    for name in ("ASYNCT_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert build_parser().parse_args(["serve", "/ckpt"]).api_key == key
    assert build_parser().parse_args(["serve", "/ckpt", "--api-key", "flag"]).api_key == "flag"
