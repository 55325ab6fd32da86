"""asynct: fast inference for AsyncT language models."""
from transformers import AutoConfig, AutoModelForCausalLM

from asynct.config import AsyncTConfig, PRESETS, preset_config
from asynct.model.reference import AsyncTForCausalLM, AsyncTModel

AutoConfig.register("asynct", AsyncTConfig, exist_ok=True)
AutoModelForCausalLM.register(AsyncTConfig, AsyncTForCausalLM, exist_ok=True)

__all__ = ["AsyncTConfig", "AsyncTForCausalLM", "AsyncTModel", "PRESETS", "preset_config"]
__version__ = "0.1.0"
