"""vLLM plugin: run AsyncT checkpoints in an unmodified vLLM (`vllm serve`, `vllm.LLM`).

vLLM calls `register()` through the `vllm.general_plugins` entry point in every process it
starts (API server, engine core, workers), before any model or `Attention` layer is built.
Nothing here imports vLLM at module import time, so `import asynct` never needs vLLM.
"""

ARCHITECTURE = "AsyncTForCausalLM"
MODEL_CLASS = "asynct.integrations.vllm.model:AsyncTForCausalLM"
BACKEND_NAME = "ASYNCT"
BACKEND_CLASS = "asynct.integrations.vllm.backend.AsyncTAttentionBackend"


def register() -> None:
    """Registers the AsyncT config, architecture and attention backend. Idempotent: vLLM may
    call it more than once per process."""
    import asynct  # noqa: F401  registers model_type "asynct" with transformers' AutoConfig
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # Lazy "module:Class" form: vLLM inspects the class in a subprocess, and importing the
    # model here would pull in torch/vLLM layers before the platform is set up.
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    # `Attention` looks its backend up by `get_name()`, so the name must exist first.
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_CLASS)
