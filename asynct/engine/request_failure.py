"""One request's failure stays its own: a sequence that raises while its step finishes, or a
batch that raises while launching (then run again one sequence at a time), fails only its own
request, with finish_reason "error" and a RequestOutput.error naming the exception."""
import logging

from asynct.engine.outputs import CompletionOutput, RequestOutput
from asynct.engine.scheduler import ScheduledBatch
from asynct.engine.sequence import Request, Sequence, SequenceStatus

log = logging.getLogger("asynct")
# marks the log record of one request's failure (its request id), which its RequestOutput.error
# also says: a caller that reports failed requests itself filters these out
FAILED_REQUEST = "failed_request"


class RequestFailureMixin:
    """LLMEngine's failure handling. It reads the engine's runner, scheduler, requests and
    in_flight, and runs the sequences alone with the engine's _advance and StepFinishMixin's _finish."""

    def _step_one_by_one(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The batch raised while launching: finish the step in flight (its tokens become host
        tokens), then run each sequence alone, so that only the requests that raise alone fail."""
        outputs = {}
        self.scheduler.retract(batch)
        if self.in_flight is not None:
            outputs.update((o.request_id, o) for o in self._finish(self.in_flight))
            self.in_flight = None
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.status != SequenceStatus.RUNNING:   # finished, or its hits retracted
                continue
            try:
                launched = self.runner.launch(ScheduledBatch.of([(seq, n)], self.scheduler.block_manager.tables))
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
