"""The engine loop: requests in, one scheduled mixed batch per step, outputs out. What a finished
step's tokens do is step_finish.py's; how one request fails alone, request_failure.py's."""
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from asynct.engine.block_manager import BlockManager
from asynct.engine.detokenizer import Detokenizer
from asynct.engine.engine_args import EngineArgs, resolve_device, resolve_dtype
from asynct.engine.generation_config import extra_eos_ids
from asynct.engine.inputs import check_bad_words, check_prompt, check_stop_strings, tokenize, truncate_prompt
from asynct.engine.model_runner import LaunchedStep, ModelRunner
from asynct.engine.outputs import RequestOutput
from asynct.engine.request_failure import RequestFailureMixin
from asynct.engine.sampler import eos_ids
from asynct.engine.sampling_params import SamplingParams
from asynct.engine.scheduler import Scheduler
from asynct.engine.sequence import Request, Sequence
from asynct.engine.startup_heap import freeze_startup_heap
from asynct.engine.step_finish import StepFinishMixin
from asynct.model.checkpoint import prepare_config_for_load

log = logging.getLogger("asynct")


def startup_text(seconds: dict) -> str:
    """An engine's start-up seconds by part, as start-up lines print them."""
    return ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in seconds.items())


def resolve_max_model_len(requested: int | None, config) -> int:
    """The checkpoint's max_position_embeddings unless a shorter one is asked for: its RoPE
    tables hold no later position (a longer sequence would index past them)."""
    limit = config.max_position_embeddings
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit} "
                         f"(its RoPE tables hold {limit} positions); use max_model_len <= {limit}")
    return requested or limit


@dataclass
class StepRecord:
    kind: str            # "graph", "piecewise mixed", "piecewise prefill", "decode", "mixed", "prefill"
    num_seqs: int
    num_tokens: int
    kv_tokens: int       # keys the step's attention reads (about)
    wall_s: float        # from the previous step's end to this one's, its own launch in, the next one's out
    launch_s: float      # host time to build and launch it
    gpu_s: float | None  # device time of its forward and sampling (timed runs only)


class LLMEngine(StepFinishMixin, RequestFailureMixin):
    def __init__(self, args: EngineArgs):
        self.args = args
        if args.seed is not None:
            torch.manual_seed(args.seed)      # every device's default generator, as vLLM seeds its workers
        self.config = prepare_config_for_load(args.model)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        self.detokenizer = Detokenizer.from_path(args.tokenizer or args.model)
        if args.tokenizer and self.detokenizer is None:   # a mistyped path ran without a tokenizer, silently
            raise ValueError(f"tokenizer={args.tokenizer!r} has no tokenizer files (tokenizer.json, "
                             "tokenizer.model or vocab.json)")
        self.max_model_len = resolve_max_model_len(args.max_model_len, self.config)
        # plain copies: a transformers config's attribute reads are slow on a per-token path
        self.vocab_size, self.eos_token_ids = self.config.vocab_size, eos_ids(self.config.eos_token_id)
        # generation_config.json's other EOS ids end a sequence as stop tokens do (vLLM's stop_reason: the id)
        self.generation_eos_ids = extra_eos_ids(args.generation_config, args.model, self.eos_token_ids,
                                                self.vocab_size)
        t0 = time.perf_counter()
        self.runner = ModelRunner(self.config, args.model, self.device, self.dtype, args.attention_backend,
                                  args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                                  self.max_model_len, args.cudagraph_mode, args.kv_cache_dtype,
                                  args.lazy_decode_graphs, [*self.eos_token_ids, *self.generation_eos_ids])
        t1 = time.perf_counter()
        num_blocks = self._num_kv_blocks()
        if num_blocks * args.block_size < self.max_model_len:
            log.warning("KV cache holds %d tokens: max_model_len lowered from %d", num_blocks * args.block_size,
                        self.max_model_len)
            self.max_model_len = num_blocks * args.block_size
        self.runner.max_model_len = self.max_model_len
        t2 = time.perf_counter()
        self.runner.allocate_kv_cache(num_blocks)
        # where start-up goes: weights, the kernels compiled ahead (on an empty Triton cache: most
        # of a first start), the memory-profiling prefill, the cache and its warm-up, graphs
        graphs, compile_s = self.runner.capture_seconds, self.runner.compile_seconds
        self.startup_seconds = {"weights": t1 - t0 - compile_s, "compile": compile_s, "profile": t2 - t1,
                                "kv_cache": time.perf_counter() - t2 - sum(graphs.values()), **graphs}
        log.info("engine ready: %s", startup_text(self.startup_seconds))
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        admit = args.admission_batch or max(1, args.max_num_seqs // 16)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens, admit,
                                   self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.in_flight: LaunchedStep | None = None   # launched, not finished (async scheduling)
        self._last_step_end = None
        self.step_log: list | None = None   # benchmarks set a list: one StepRecord per step
        freeze_startup_heap(self)

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    def summary(self) -> dict:
        """What the engine was built with, for start-up logs."""
        r = self.runner
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "max_model_len": self.max_model_len, "num_kv_blocks": self.block_manager.num_blocks,
                "block_size": self.args.block_size,
                "kv_cache_gib": self.block_manager.num_blocks * r.block_bytes / 2**30,
                "kv_cache_dtype": str(r.kv_dtype).removeprefix("torch."), "attention_backend": r.backend.name,
                "cuda_graphs": r.cudagraph_mode, "startup_seconds": sum(self.startup_seconds.values())}

    def _num_kv_blocks(self) -> int:
        a = self.args
        if a.num_kv_blocks:
            return a.num_kv_blocks
        if self.device.type == "cuda":
            # what is free now (other engines and processes included), less the share the
            # user keeps back and this engine's activation peak (a full-budget step's forward,
            # then its sampling: the sampler's whole-vocabulary rows need room too)
            activations = self.runner.profile_activation_memory()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - a.gpu_memory_utilization) - activations
        else:
            budget = a.kv_cache_memory
        blocks = int(budget // self.runner.block_bytes)
        if blocks < 2:
            raise ValueError(f"no room for a KV cache: {budget / 2**20:.0f} MiB left after the model; "
                             "raise gpu_memory_utilization or kv_cache_memory")
        return blocks

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    stream: bool = False) -> Request:
        """Validates and queues a request; raises ValueError naming the problem."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        ids = truncate_prompt(ids, params, self.max_model_len)
        self.check_prompt(ids, params)
        check_stop_strings(self.detokenizer, params)
        check_bad_words(self.detokenizer, params, self.vocab_size)
        req = Request(request_id, text, ids, params, stream=stream)
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, i, ids, params, self.args.block_size)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        return req

    def _tokenize(self, prompt):
        return tokenize(self.detokenizer, prompt)

    def check_prompt(self, ids, params):
        check_prompt(ids, params, self.vocab_size, self.max_model_len)

    def abort_request(self, request_id: str):
        req = self.requests.pop(request_id, None)
        for seq in req.seqs if req else []:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches one batch, then finishes the batch before it (async
        scheduling: the host prepares step N+1 while the device runs step N) or this one.
        Returns the outputs of requests that finished, and of streaming requests that progressed."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        try:
            launched = self.runner.launch(batch) if batch.seqs else None
        except Exception:
            log.exception("a step of %d sequences failed; running them one by one", len(batch.seqs))
            return self._step_one_by_one(batch)
        if launched is not None:
            self._advance(launched)
        if self.args.async_scheduling:
            finishing, self.in_flight = self.in_flight, launched
        else:
            finishing = launched
        outputs = self._finish(finishing) if finishing is not None else []
        self._record(finishing, t0, launched if self.args.async_scheduling else None)
        return outputs

    def _advance(self, launched: LaunchedStep):
        """The launched step's tokens count as computed now: the next step is scheduled (and
        its K/V read) after it on the device. Its samples are pending until finished."""
        for seq, n in zip(launched.batch.seqs, launched.batch.num_tokens):
            seq.num_computed_tokens += n
            if seq.num_prompt_logprobs_scheduled < seq.num_prompt_tokens - 1:    # not all scheduled yet
                seq.num_prompt_logprobs_scheduled = max(seq.num_prompt_logprobs_scheduled,
                                                        min(seq.num_computed_tokens, seq.num_prompt_tokens - 1))
            self.block_manager.commit_full_blocks(seq)   # prompt blocks: their tokens are known
        for row, i in enumerate(launched.samplers):
            seq = launched.batch.seqs[i]
            seq.num_pending_tokens += 1
            seq.sample_row = row

    def _count(self, batch):
        self.stats["steps"] += 1
        self.stats["prompt_tokens"] += batch.num_prompt_tokens

    def _record(self, launched: LaunchedStep | None, t0: float, ahead: LaunchedStep | None = None):
        """Benchmarks' per-step log: the wall time between step ends is a step's real cost, but
        with async scheduling the call that finishes a step also launches the next (`ahead`),
        whose host launch is that step's cost, not this one's: a decode graph step before a
        piecewise mixed step was charged the mixed step's 23 ms launch (H200, gsm8k). This
        step's own launch, made in the call before, is charged to it instead."""
        end = time.perf_counter()
        start = self._last_step_end if self.step_log and self._last_step_end else t0
        self._last_step_end = end
        self.runner.timed = self.step_log is not None
        if self.step_log is None or launched is None:
            return
        b = launched.batch
        gpu = launched.events[0].elapsed_time(launched.events[1]) / 1e3 if launched.events else None
        shift = launched.host_s - (ahead.host_s if ahead else 0.0) if self.args.async_scheduling else 0.0
        self.step_log.append(StepRecord(launched.kind, len(b.seqs), b.total_tokens, launched.kv_tokens,
                                        end - start + shift, launched.host_s, gpu))
