"""`LLMEngine`: the synchronous front end (tokenize -> engine core -> detokenize), one step at a time."""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from vx.client.core_client import EngineCoreClient, InprocClient
from vx.client.output_processor import OutputProcessor
from vx.client.processor import Processor
from vx.client.submit import PromptRequest, submit_requests
from vx.client.tokenizer import load_tokenizer
from vx.config import EngineArgs, VxConfig
from vx.core.protocol import InputError
from vx.errors import EngineGenerateError, InvalidRequestError
from vx.outputs import EmbeddingRequestOutput, EngineStats, RequestOutput
from vx.pooling_params import PoolingParams
from vx.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Add requests, call `step()` until none are unfinished; each step returns the due outputs."""

    def __init__(self, config: VxConfig, multiprocess: bool = False) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer)
        self.processor = Processor(config.model_config, self.tokenizer, config.scheduler_config.max_n_sequences)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Outputs of a step that raised (a request failed), handed out by the next `step()`.
        self._deferred_outputs: list[RequestOutput | EmbeddingRequestOutput] = []
        self.engine_core: EngineCoreClient
        if multiprocess:
            from vx.client.core_client import SyncMPClient

            self.engine_core = SyncMPClient(config)
        else:
            self.engine_core = InprocClient(config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = False) -> "LLMEngine":
        return cls(args.create_config(), multiprocess=multiprocess)

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate, tokenize and queue one request (bad input raises ValueError, nothing queued)."""
        self.add_requests([PromptRequest(request_id, prompt, params, arrival_time, priority)])

    def add_requests(self, requests: Sequence[PromptRequest]) -> None:
        """Queue several requests, all or nothing: one that is bad, or fails to go out, leaves none queued."""
        submit_requests(self.processor, self.output_processor, self.engine_core, requests)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        engine_ids = self.output_processor.engine_request_ids(ids)
        self.output_processor.abort_requests(ids)
        self.engine_core.abort_requests(engine_ids)

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One engine step; returns the request outputs due now (per each request's output_kind; an embedding
        request's one output when it ends).

        Raises for the requests the engine failed (the others go on, and this step's outputs come with the next
        call): `vx.InvalidRequestError` (a `ValueError`) when every one was refused for its input (e.g. a
        structured-output grammar that does not compile), else `EngineGenerateError` (an internal error of a
        request alone).
        """
        if self._deferred_outputs:
            deferred, self._deferred_outputs = self._deferred_outputs, []
            return deferred
        outs = self.engine_core.get_output()
        failed = self._drop_failed(outs.input_errors)
        processed = self.output_processor.process_outputs(outs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if failed is not None:
            self._deferred_outputs = processed.request_outputs
            raise failed
        return processed.request_outputs

    def _drop_failed(self, errors: list[InputError]) -> EngineGenerateError | None:
        """Forget the requests the engine failed; the error to raise for them (None if none was ours)."""
        failures: list[EngineGenerateError] = []
        dropped: set[str] = set()  # engine ids of the requests dropped here (an n > 1 request's samples)
        op = self.output_processor
        for err in errors:
            if err.request_id in dropped:
                continue  # another sample of a request already failed
            if err.request_id is None or err.request_id not in op.request_states:
                logger.error("The vx engine refused a message: %s", err.message)
                continue
            rid, others = op.drop_failed(err.request_id)  # an n > 1 request fails whole: its other samples too
            dropped.update([err.request_id, *others])
            if others:
                self.engine_core.abort_requests(others)
            failures.append(err.to_exception(rid))
        if len(failures) <= 1:
            return failures[0] if failures else None
        # One exception for all: a ValueError only when every request's input was at fault.
        kind = InvalidRequestError if all(isinstance(f, InvalidRequestError) for f in failures) else \
            EngineGenerateError
        return kind("\n".join(str(f) for f in failures))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or bool(self._deferred_outputs)

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine_core.stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
