"""The host's half of a step: a finished step's sampled tokens appended to their sequences,
each checked for a stop (EOS, stop ids, stop strings, max_tokens, the context's end), and the
RequestOutputs of the requests they moved on, with their text and logprobs decoded."""
from asynct.engine.outputs import CompletionOutput, RequestOutput
from asynct.engine.sequence import Request, Sequence
from asynct.engine.step_output import LaunchedStep


# the token such a row drew (0) stands for none: the request ends with this error instead
NO_TOKEN_LEFT = ("no token can be sampled: this request's allowed_token_ids, bad_words, logit_bias and "
                 "min_tokens (which holds back EOS and stop_token_ids) together ban every token")


class StepFinishMixin:
    """LLMEngine's step finishing. It reads the engine's runner, scheduler, block_manager,
    detokenizer, requests, stats, eos_token_ids, generation_eos_ids and max_model_len, counts the
    step with its _count, and fails a request whose sequence raises alone (RequestFailureMixin)."""

    def _finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        batch = launched.batch
        out = self.runner.finish(launched)
        self._count(batch)
        touched, failed = {}, {}
        for seq, token, lp, plp, blocked in zip(batch.seqs, out.tokens, out.logprobs, out.prompt_logprobs,
                                                out.blocked):
            req = self.requests.get(seq.request_id)
            if blocked and not seq.is_finished:
                failed[seq.request_id] = NO_TOKEN_LEFT
                continue
            try:
                self._finish_seq(seq, req, token, lp, plp)
            except Exception as e:
                failed[seq.request_id] = self._failure(seq, e)
                continue
            # `seq` may be of an ended request whose id a new request took while this step ran
            if req is not None and (req.stream or seq.is_finished and req.finished) \
                    and seq.index < len(req.seqs) and req.seqs[seq.index] is seq:
                touched[seq.request_id] = req
        outputs = [self._output(req) for rid, req in touched.items() if rid not in failed]
        return outputs + [self._fail_request(self.requests[rid], msg) for rid, msg in failed.items()
                          if rid in self.requests]

    def _finish_seq(self, seq: Sequence, req: Request | None, token, lp, plp):
        """`req`: the request now under seq's id, its own unless seq ended (then unused)."""
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs.extend(plp)
        if token is not None:
            seq.num_pending_tokens -= 1
            if seq.is_finished:     # ended (stop, abort, error) while this step was in flight
                return
            self._append(seq, req, token, lp)
        if not seq.is_finished:
            self.block_manager.commit_full_blocks(seq)

    def _append(self, seq: Sequence, req: Request, token: int, logprob):
        seq.append_token(token)
        self.stats["generation_tokens"] += 1
        if logprob is not None:
            seq.logprobs.append(self.detokenizer.annotate(logprob) if self._decodes(seq) else logprob)
            seq.cumulative_logprob += logprob[token].logprob
        reason = self._stop_reason(seq, req, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if self._decodes(seq) and not isinstance(seq.stop_reason, str):
                # incremental text holds back an unfinished character; the whole text has it
                seq.text = self._final_text(seq)

    def _stop_reason(self, seq: Sequence, req: Request, token: int):
        p, num_out = seq.params, seq.num_output_tokens
        if num_out >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return "stop"
            if token in p.stop_token_ids or (token in self.generation_eos_ids and not p.ignore_eos):
                seq.stop_reason = token
                return "stop"
        if self.detokenizer and req.incremental:
            if self.detokenizer.step(seq):
                return "stop"
        if p.max_tokens is not None and num_out >= p.max_tokens:
            return "length"
        return "length" if len(seq.token_ids) >= self.max_model_len else None

    def _output(self, req: Request) -> RequestOutput:
        outs = [CompletionOutput(s.index, self._text(s, req), s.output_token_ids,
                                 s.cumulative_logprob if s.logprobs is not None else None,
                                 s.logprobs, s.finish_reason, s.stop_reason) for s in req.seqs]
        if req.finished:
            self.requests.pop(req.request_id, None)
        s0 = req.seqs[0]
        plp = s0.prompt_logprobs
        if plp is not None and self._decodes(s0):
            plp = [e if e is None else self.detokenizer.annotate(e) for e in plp]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, plp, outs, req.finished,
                             num_cached_tokens=s0.num_cached_tokens)

    def _decodes(self, seq: Sequence) -> bool:
        return self.detokenizer is not None and seq.params.detokenize

    def _text(self, seq: Sequence, req: Request) -> str:
        """Text is kept current each step only where stop strings or streaming need it."""
        if not self._decodes(seq):
            return ""
        if req.incremental:
            # as vLLM, a running stream never shows text that a stop string may still cut
            hold = 0 if seq.is_finished else seq.params.output_text_buffer_length
            return seq.text[:max(0, len(seq.text) - hold)] if hold else seq.text
        return self._final_text(seq) if seq.is_finished else ""

    def _final_text(self, seq: Sequence) -> str:
        """The whole output decoded, where no stop string cut it. As vLLM, the stop token that
        ended it (EOS or one of stop_token_ids) is left out unless include_stop_str_in_output:
        it stays in token_ids only."""
        end = len(seq)
        if seq.finish_reason == "stop" and not seq.params.include_stop_str_in_output:
            end -= 1
        return self.detokenizer.decode_output(seq, end)
