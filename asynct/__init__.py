"""asynct: fast inference for AsyncT language models."""
from transformers import AutoConfig, AutoModelForCausalLM

from asynct.config import AsyncTConfig, PRESETS, preset_config
from asynct.model.reference import AsyncTForCausalLM, AsyncTModel

AutoConfig.register("asynct", AsyncTConfig, exist_ok=True)
AutoModelForCausalLM.register(AsyncTConfig, AsyncTForCausalLM, exist_ok=True)

__all__ = ["AsyncTConfig", "AsyncTForCausalLM", "AsyncTModel", "PRESETS", "preset_config"]
__version__ = "0.1.0"


def __getattr__(name):
    # The engine is imported lazily so that `import asynct` (the Auto registration) stays light.
    if name == "LLM":
        from asynct.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from asynct.engine.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from asynct.engine import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'asynct' has no attribute {name!r}")
