"""`EngineArgs`: every option an engine is built from (`LLM(...)` keyword arguments and the
CLI's engine flags map onto it), and the compute dtype they resolve to."""
from dataclasses import dataclass

import torch

from asynct.engine.generation_config import check_source
from asynct.engine.sampling_params import _is_int


CUDAGRAPH_MODES = ("full_and_piecewise", "full_decode_only", "none")
FLAGS = ("enforce_eager", "lazy_decode_graphs", "enable_prefix_caching", "async_scheduling", "trust_remote_code")


@dataclass
class EngineArgs:
    model: str
    dtype: str | torch.dtype = "auto"
    device: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    enforce_eager: bool = False           # no CUDA graphs at all (cudagraph_mode "none")
    # vLLM's modes: full graphs for decode-only steps, piecewise graphs (attention eager) for
    # steps with prefill tokens; "full_decode_only" leaves those eager
    cudagraph_mode: str = "full_and_piecewise"
    # decode graphs captured at the first decode-only step, not at start-up: a run that never
    # decodes (lm-eval's loglikelihood tasks) never pays for them (0.9-2.0 s of bench-0.6b's start)
    lazy_decode_graphs: bool = False
    kv_cache_memory: int = 1 << 30        # bytes of KV cache off the GPU
    num_kv_blocks: int | None = None      # overrides both sizings (tests)
    admission_batch: int | None = None    # free slots that admit waiting requests; default max_num_seqs // 16
    tokenizer: str | None = None
    async_scheduling: bool = True         # launch step N+1 before finishing step N
    kv_cache_dtype: str = "auto"          # "fp8" (e4m3, static scales from the weights: docs/fp8_kv.md)
    data_parallel_size: int = 1           # engine processes, one per GPU (engine/data_parallel.py); 1: this one
    # vLLM's: seed: the random state sampling starts from (unseeded requests draw from it; a
    # request's own seed wins); tensor_parallel_size: 1 only; trust_remote_code: accepted and
    # ignored (an asynct checkpoint runs no code of its own)
    seed: int | None = None
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    # vLLM's: "auto" takes the model's generation_config.json sampling values as request defaults
    # and its EOS ids as stop tokens; "vllm" keeps asynct's defaults; or a folder holding the file.
    # override_generation_config's values win over the file's (engine/generation_config.py)
    generation_config: str = "auto"
    override_generation_config: dict | None = None

    def __post_init__(self):
        for name in FLAGS:
            setattr(self, name, as_flag(name, getattr(self, name)))
        self.cudagraph_mode = str(self.cudagraph_mode).lower()
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode={self.cudagraph_mode!r}; choose from {CUDAGRAPH_MODES}")
        if self.enforce_eager:
            self.cudagraph_mode = "none"
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: an asynct engine runs on one "
                             "GPU; for tensor parallelism serve the checkpoint with vLLM and asynct's plugin "
                             "(docs/vllm.md)")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        check_source(self.generation_config)
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a dict, got {self.override_generation_config!r:.60}")
        self._check_sizes()

    def _check_sizes(self):
        """Sizes below 1 build an engine that cannot run: max_num_seqs=0 or
        max_num_batched_tokens=0 admit nothing (generate would wait forever), block_size=0
        divides by zero."""
        if isinstance(self.kv_cache_memory, float) and self.kv_cache_memory.is_integer():
            self.kv_cache_memory = int(self.kv_cache_memory)   # 4e9 bytes, as lm-eval's model_args parse it
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "data_parallel_size", "kv_cache_memory"):
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_model_len", "num_kv_blocks", "admission_batch"):
            if getattr(self, name) is not None and not _is_positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer or None, got {getattr(self, name)!r}")
        if self.admission_batch is not None and self.admission_batch > self.max_num_seqs:
            # new sequences join only when admission_batch slots are free: more than the batch
            # holds are never free, so nothing would ever start (generate waited forever)
            raise ValueError(f"admission_batch={self.admission_batch} exceeds max_num_seqs={self.max_num_seqs}; "
                             "no step could admit that many new sequences")
        u = self.gpu_memory_utilization
        if not (isinstance(u, (int, float)) and not isinstance(u, bool) and 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")


# what vLLM's (pydantic's) flags read as false / true, in any case; a plain truth test read
# the string "false" as true
FLAG_WORDS = {**dict.fromkeys(("0", "off", "f", "false", "n", "no"), False),
              **dict.fromkeys(("1", "on", "t", "true", "y", "yes"), True)}


def as_flag(name: str, value) -> bool:
    """`value` as a bool, as vLLM reads a flag (True/False, 0/1, "false"/"true", "no"/"yes",
    "off"/"on"), or a ValueError naming the flag ("ture" is no flag)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in FLAG_WORDS:
        return FLAG_WORDS[value.lower()]
    raise ValueError(f"{name} must be True or False (or 1/0, yes/no, on/off), got {value!r:.40}")


def _is_positive_int(x) -> bool:
    return _is_int(x) and x >= 1


def resolve_device(device: str | None) -> torch.device:
    """The engine's device: `device`, or a GPU where there is one. A name torch cannot parse, or
    a GPU this machine lacks, is a ValueError naming it (torch's own errors came from deep in
    start-up: a RuntimeError listing every device type, or "Torch not compiled with CUDA")."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device; use cpu, cuda or cuda:N") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but this machine has no usable CUDA GPU; use device='cpu'")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}, but {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return d


def resolve_dtype(dtype, config, device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:   # nn.Module.to's TypeError came from deep in start-up
            raise ValueError(f"dtype={dtype} is not a floating dtype; use bfloat16, float16 or float32")
        return dtype
    if dtype in (None, "auto"):
        # bf16 matmuls are slow on CPUs; there the engine computes in fp32 unless asked
        return config.weights_dtype if device.type == "cuda" else torch.float32
    if dtype in ("half", "float16", "bfloat16", "float32", "float", "bf16", "fp16", "fp32"):
        alias = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
        return getattr(torch, alias.get(dtype, dtype))
    raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
