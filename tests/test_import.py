"""`import asynct` stays light (no torch, no transformers) and still registers AsyncT with
transformers' Auto classes, whichever of the two a program imports first. Each case runs in a
fresh interpreter: this test session has long imported both. (Import *time* is a benchmark:
benchmarks/import_time.py.)"""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-gsm"


def run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def test_import_asynct_loads_neither_torch_nor_transformers():
    assert run("import sys, asynct; print(sorted({'torch', 'transformers', 'triton'} & set(sys.modules)))") == "[]"


@pytest.mark.parametrize("first", ["import asynct", "import transformers.models.auto.modeling_auto",
                                   "import asynct.config", "from asynct import LLM"])
def test_auto_classes_find_asynct(first):
    """asynct.config (which the engine imports) registers with AutoConfig only once transformers
    loads it: imported first, it must still be found afterwards."""
    second = "import asynct" if not first.startswith(("import asynct", "from asynct")) else "pass"
    out = run(f"""{first}
{second}
from transformers import AutoConfig, AutoModelForCausalLM
print(type(AutoConfig.from_pretrained('{MODEL}')).__name__, type(AutoModelForCausalLM.from_pretrained('{MODEL}')).__name__)""")
    assert out.splitlines()[-1] == "AsyncTConfig AsyncTForCausalLM"


def test_the_engine_does_not_load_transformers_auto_classes():
    """Indexing every model family (AutoConfig's first import) cost 0.45 s of an engine start."""
    assert run("import sys; from asynct.engine.llm_engine import LLMEngine; "
               "print('transformers.models.auto.configuration_auto' in sys.modules)") == "False"


def test_public_names_load_on_first_use():
    out = run("import asynct; print(asynct.AsyncTConfig.model_type, asynct.LLM.__name__, sorted(asynct.PRESETS))")
    assert out == "asynct LLM ['bench-0.6b', 'small', 'tiny']"
