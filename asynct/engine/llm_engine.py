"""The engine loop: requests in, one scheduled mixed batch per step, outputs out."""
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from asynct.engine.block_manager import BlockManager
from asynct.engine.detokenizer import Detokenizer
from asynct.engine.engine_args import EngineArgs, resolve_device, resolve_dtype
from asynct.engine.generation_config import extra_eos_ids
from asynct.engine.inputs import check_bad_words, check_prompt, check_stop_strings, tokenize, truncate_prompt
from asynct.engine.model_runner import LaunchedStep, ModelRunner
from asynct.engine.outputs import CompletionOutput, RequestOutput
from asynct.engine.sampler import eos_ids
from asynct.engine.sampling_params import SamplingParams
from asynct.engine.scheduler import ScheduledBatch, Scheduler
from asynct.engine.sequence import Sequence
from asynct.model.checkpoint import prepare_config_for_load

log = logging.getLogger("asynct")
# marks the log record of one request's failure (its request id), which its RequestOutput.error
# also says: a caller that reports failed requests itself filters these out
FAILED_REQUEST = "failed_request"


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
    wall_s: float        # from the previous step's end to this one's
    launch_s: float      # host time to build and launch it
    gpu_s: float | None  # device time of its forward and sampling (timed runs only)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    stream: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def incremental(self) -> bool:
        return self.stream or bool(self.params.stop_list)


class LLMEngine:
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
        # where start-up goes: weights, the memory-profiling prefill (first kernel compiles), graphs
        graphs = self.runner.capture_seconds
        self.startup_seconds = {"weights": t1 - t0, "profile": t2 - t1,
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
            # user keeps back and this engine's activation peak
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
        self._record(finishing, t0)
        return outputs

    def _advance(self, launched: LaunchedStep):
        """The launched step's tokens count as computed now: the next step is scheduled (and
        its K/V read) after it on the device. Its samples are pending until finished."""
        for seq, n in zip(launched.batch.seqs, launched.batch.num_tokens):
            seq.num_computed_tokens += n
            seq.num_prompt_logprobs_scheduled = max(seq.num_prompt_logprobs_scheduled,
                                                    min(seq.num_computed_tokens, seq.num_prompt_tokens - 1))
            self.block_manager.commit_full_blocks(seq)   # prompt blocks: their tokens are known
        for row, i in enumerate(launched.samplers):
            seq = launched.batch.seqs[i]
            seq.num_pending_tokens += 1
            seq.sample_row = row

    def _finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        batch = launched.batch
        out = self.runner.finish(launched)
        self._count(batch)
        touched, failed = {}, {}
        for seq, token, lp, plp in zip(batch.seqs, out.tokens, out.logprobs, out.prompt_logprobs):
            try:
                self._finish_seq(seq, token, lp, plp)
            except Exception as e:
                failed[seq.request_id] = self._failure(seq, e)
                continue
            req = self.requests.get(seq.request_id)
            # `seq` may be of an ended request whose id a new request took while this step ran
            if req is not None and seq.index < len(req.seqs) and req.seqs[seq.index] is seq \
                    and (req.stream or req.finished):
                touched[seq.request_id] = req
        outputs = [self._output(req) for rid, req in touched.items() if rid not in failed]
        return outputs + [self._fail_request(self.requests[rid], msg) for rid, msg in failed.items()
                          if rid in self.requests]

    def _finish_seq(self, seq: Sequence, token, lp, plp):
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs.extend(plp)
        if token is not None:
            seq.num_pending_tokens -= 1
            if seq.is_finished:     # ended (stop, abort, error) while this step was in flight
                return
            self._append(seq, token, lp)
        if not seq.is_finished:
            self.block_manager.commit_full_blocks(seq)

    # ---- one request's failure stays its own ------------------------------------------------------
    def _step_one_by_one(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The batch raised while launching: finish the step in flight (its tokens become host
        tokens), then run each sequence alone, so that only the requests that raise alone fail."""
        outputs = {}
        if self.in_flight is not None:
            outputs.update((o.request_id, o) for o in self._finish(self.in_flight))
            self.in_flight = None
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.is_finished:
                continue
            try:
                launched = self.runner.launch(ScheduledBatch.of([(seq, n)]))
            except Exception as e:
                req = self.requests.get(seq.request_id)
                if req is not None:
                    outputs[req.request_id] = self._fail_request(req, self._failure(seq, e))
                continue
            self._advance(launched)
            outputs.update((o.request_id, o) for o in self._finish(launched))
        return list(outputs.values())

    @staticmethod
    def _failure(seq: Sequence, e: Exception) -> str:
        log.error("request %s failed: %s: %s", seq.request_id, type(e).__name__, e,
                  extra={FAILED_REQUEST: seq.request_id})
        return f"engine error in this request: {type(e).__name__}: {e}"

    def _fail_request(self, req: Request, message: str) -> RequestOutput:
        """Finishes every sequence of `req` with finish_reason "error" and frees its blocks."""
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        self.requests.pop(req.request_id, None)
        # no text: the detokenizer may be what failed
        outs = [CompletionOutput(s.index, "", s.output_token_ids, None, None, "error", message) for s in req.seqs]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, None, outs, True, error=message)

    def _count(self, batch):
        self.stats["steps"] += 1
        self.stats["prompt_tokens"] += batch.num_prompt_tokens

    def _record(self, launched: LaunchedStep | None, t0: float):
        """Benchmarks' per-step log: the wall time between step ends is a step's real cost."""
        end = time.perf_counter()
        start = self._last_step_end if self.step_log and self._last_step_end else t0
        self._last_step_end = end
        self.runner.timed = self.step_log is not None
        if self.step_log is None or launched is None:
            return
        b = launched.batch
        gpu = launched.events[0].elapsed_time(launched.events[1]) / 1e3 if launched.events else None
        self.step_log.append(StepRecord(launched.kind, len(b.seqs), b.total_tokens, launched.kv_tokens,
                                        end - start, launched.host_s, gpu))

    def _append(self, seq: Sequence, token: int, logprob):
        seq.append_token(token)
        self.stats["generation_tokens"] += 1
        if logprob is not None:
            seq.logprobs.append(self.detokenizer.annotate(logprob) if self.detokenizer else logprob)
            seq.cumulative_logprob += logprob[token].logprob
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if self.detokenizer and not isinstance(seq.stop_reason, str):
                # incremental text holds back an unfinished character; the whole text has it
                seq.text = self._final_text(seq)

    def _stop_reason(self, seq: Sequence, token: int):
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return "stop"
            if token in p.stop_token_ids or (token in self.generation_eos_ids and not p.ignore_eos):
                seq.stop_reason = token
                return "stop"
        if self.detokenizer and self.requests[seq.request_id].incremental:
            if self.detokenizer.step(seq):
                return "stop"
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length"
        return "length" if len(seq) >= self.max_model_len else None

    def _output(self, req: Request) -> RequestOutput:
        outs = [CompletionOutput(s.index, self._text(s, req), s.output_token_ids,
                                 s.cumulative_logprob if s.logprobs is not None else None,
                                 s.logprobs, s.finish_reason, s.stop_reason) for s in req.seqs]
        if req.finished:
            self.requests.pop(req.request_id, None)
        s0 = req.seqs[0]
        plp = s0.prompt_logprobs
        if plp is not None and self.detokenizer:
            plp = [e if e is None else self.detokenizer.annotate(e) for e in plp]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, plp, outs, req.finished,
                             num_cached_tokens=s0.num_cached_tokens)

    def _text(self, seq: Sequence, req: Request) -> str:
        """Text is kept current each step only where stop strings or streaming need it."""
        if self.detokenizer is None:
            return ""
        if req.incremental:
            return seq.text
        return self._final_text(seq) if seq.is_finished else ""

    def _final_text(self, seq: Sequence) -> str:
        """The whole output decoded, where no stop string cut it. As vLLM, the stop token that
        ended it (EOS or one of stop_token_ids) is left out unless include_stop_str_in_output:
        it stays in token_ids only."""
        end = len(seq)
        if seq.finish_reason == "stop" and not seq.params.include_stop_str_in_output:
            end -= 1
        return self.detokenizer.decode_output(seq, end)
