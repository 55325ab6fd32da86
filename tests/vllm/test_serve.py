"""`vllm serve <asynct checkpoint>` on loopback, queried with the openai client."""
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_helpers import HAVE_VLLM, MAX_TOKENS, make_prompts, reference_greedy

if not HAVE_VLLM:
    pytest.skip("vLLM not installed (see scripts/ci_vllm.sh)", allow_module_level=True)
openai = pytest.importorskip("openai")

HOST = "127.0.0.1"  # loopback only
START_TIMEOUT_S = 300


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_healthy(proc, url, log):
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve not healthy after {START_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "server.log"
    cli = Path(__file__).with_name("vllm_cli.py")  # `vllm serve`, see vllm_cli.py for why
    cmd = [sys.executable, str(cli), "serve", tiny_ckpt, "--host", HOST, "--port", str(port),
           "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256",
           "--enforce-eager"]
    with open(log, "w") as out:
        # Multiprocessing on, as users run it: the plugin must register in the engine process too.
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, f"http://{HOST}:{port}/health", log)
        yield f"http://{HOST}:{port}/v1", log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_completions_match_reference(server, tiny_ckpt):
    base_url, log = server
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompts = make_prompts(seed=7)[:3]
    got = []
    for prompt in prompts:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        got.append(list(r.choices[0].token_ids))
        assert r.usage.completion_tokens == MAX_TOKENS
    assert got == reference_greedy(tiny_ckpt, prompts)
    text = log.read_text()
    assert "AsyncT attention backend ran its first forward" in text  # ours ran, in the server
    assert "CPU_ATTN" not in text
