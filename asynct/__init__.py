"""asynct: fast inference for AsyncT language models.

`import asynct` loads neither torch nor transformers (seconds): each public name is imported on
first use, and AsyncT registers with transformers' `AutoConfig` / `AutoModelForCausalLM` as soon
as those are loaded, so `import asynct` then `AutoModelForCausalLM.from_pretrained(asynct_dir)`
works as it would with an eager import."""
import importlib
import importlib.abc
import sys

__version__ = "0.1.0"
__all__ = ["AsyncTConfig", "AsyncTForCausalLM", "AsyncTModel", "PRESETS", "preset_config", "LLM",
           "SamplingParams", "RequestOutput", "CompletionOutput"]

_LAZY = {"AsyncTConfig": "asynct.config", "PRESETS": "asynct.presets", "preset_config": "asynct.config",
         "AsyncTForCausalLM": "asynct.model.reference", "AsyncTModel": "asynct.model.reference",
         "LLM": "asynct.entrypoints.llm", "SamplingParams": "asynct.engine.sampling_params",
         "RequestOutput": "asynct.engine.outputs", "CompletionOutput": "asynct.engine.outputs"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'asynct' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


# transformers' Auto module -> the asynct module whose import registers AsyncT with it
_AUTO_REGISTRATION = {"transformers.models.auto.configuration_auto": "asynct.config",
                      "transformers.models.auto.modeling_auto": "asynct.model.reference"}


class _RegisterWhenTransformersLoads(importlib.abc.MetaPathFinder):
    """Runs the registering import right after transformers finishes loading an Auto module."""

    def find_spec(self, name, path, target=None):
        if name not in _AUTO_REGISTRATION:
            return None
        spec = next(filter(None, (f.find_spec(name, path, target) for f in sys.meta_path
                                  if f is not self and hasattr(f, "find_spec"))), None)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register(name)
        spec.loader.exec_module = exec_then_register
        return spec


def _register(auto_module: str):
    """Calls the asynct module's `register_with_transformers`: imported before transformers'
    Auto module, asynct.config registers nothing itself. A module still being imported (whose
    own imports loaded the Auto module) has no such function yet: it registers at its end."""
    try:
        module = importlib.import_module(_AUTO_REGISTRATION[auto_module])
    except ImportError:  # transformers half-loaded: the asynct module registers when it is imported
        return
    register = getattr(module, "register_with_transformers", None)
    if register is not None:
        register()


if not any(isinstance(f, _RegisterWhenTransformersLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenTransformersLoads())
for _name in _AUTO_REGISTRATION:
    if _name in sys.modules:  # transformers came first
        _register(_name)
