"""`LLMEngine`: the synchronous front end (tokenize -> engine core -> detokenize), one step at a time."""

from __future__ import annotations

from typing import Iterable

from vx.client.core_client import EngineCoreClient, InprocClient
from vx.client.output_processor import OutputProcessor
from vx.client.processor import Processor
from vx.client.tokenizer import load_tokenizer
from vx.config import EngineArgs, VxConfig
from vx.outputs import EngineStats, RequestOutput
from vx.sampling_params import SamplingParams


class LLMEngine:
    """Add requests, call `step()` until none are unfinished; each step returns the due outputs."""

    def __init__(self, config: VxConfig, multiprocess: bool = False) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer)
        self.processor = Processor(config.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core: EngineCoreClient
        if multiprocess:
            from vx.client.core_client import SyncMPClient

            self.engine_core = SyncMPClient(config)
        else:
            self.engine_core = InprocClient(config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = False) -> "LLMEngine":
        return cls(args.create_config(), multiprocess=multiprocess)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate, tokenize and queue one request (bad input raises ValueError, nothing queued)."""
        req = self.processor.process_inputs(request_id, prompt, params, arrival_time, priority)
        self.output_processor.add_request(req, prompt if isinstance(prompt, str) else None)
        try:
            self.engine_core.add_request(req)
        except Exception:
            self.output_processor.abort_requests([request_id])
            raise

    def abort_request(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        self.output_processor.abort_requests(ids)
        self.engine_core.abort_requests(ids)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the request outputs due now (per each request's output_kind)."""
        outs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine_core.stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
