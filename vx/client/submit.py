"""The one path by which a front end (`LLMEngine`, `LLM`, `AsyncLLM`) submits requests to its engine core.

Validate and tokenize every request first (`Processor`), then register each with the `OutputProcessor` (an `n > 1`
request fans out into n engine requests there) and send its engine requests to the client. All or nothing: if any
step raises, everything registered so far is aborted in the engine and dropped from the output processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from vx.core.protocol import EngineCoreRequest
from vx.pooling_params import PoolingParams
from vx.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vx.client.core_client import EngineCoreClient
    from vx.client.output_processor import OutputProcessor, OutputQueue
    from vx.client.processor import Processor

Prompt = str | list[int]


@dataclass(frozen=True)
class PromptRequest:
    """One request as the application gives it."""

    request_id: str
    prompt: Prompt
    params: SamplingParams | PoolingParams | None = None  # PoolingParams: an embedding request
    arrival_time: float | None = None
    priority: int = 0


def submit_requests(processor: Processor, output_processor: OutputProcessor, client: EngineCoreClient,
                    requests: Sequence[PromptRequest],
                    new_queue: Callable[[EngineCoreRequest], OutputQueue] | None = None) -> list[EngineCoreRequest]:
    """Submit `requests` all or nothing; returns their processed `EngineCoreRequest`s, in order.

    `new_queue`, if given, makes each request's output queue, registered with its state (a streaming front end).
    A bad request raises `ValueError` before anything is registered. A failure while registering or sending (a
    duplicate id, a dead engine) aborts what was already sent, forgets what was registered, and re-raises.
    """
    processed = [processor.process_inputs(r.request_id, r.prompt, r.params, r.arrival_time, r.priority)
                 for r in requests]
    registered: list[str] = []
    try:
        for request, given in zip(processed, requests):
            prompt = given.prompt if isinstance(given.prompt, str) else None
            queue = new_queue(request) if new_queue is not None else None
            engine_requests = output_processor.add_request(request, prompt, queue)
            registered.append(request.request_id)
            for engine_request in engine_requests:
                client.add_request(engine_request)
    except BaseException:
        # Every engine request of what was registered: those sent, and those never sent (aborting an id the
        # engine does not know is a no-op).
        try:
            client.abort_requests(output_processor.engine_request_ids(registered))
        finally:
            output_processor.abort_requests(registered)
        raise
    return processed


def is_single_prompt(prompts: Any) -> bool:
    """True for one prompt (a str, or a list of token ids), False for a sequence of prompts."""
    return isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and len(prompts) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompts))


def normalize_prompts(prompts: Any) -> list[Prompt]:
    """One prompt or a sequence of them, as a non-empty list of prompts; `ValueError` for anything else."""
    if is_single_prompt(prompts):
        return [prompts if isinstance(prompts, str) else list(prompts)]
    if isinstance(prompts, (list, tuple)):
        if len(prompts) == 0:
            raise ValueError("No prompts given.")
        return list(prompts)
    raise ValueError(f"prompts must be a str, a list of token ids, or a list of those; got "
                     f"{type(prompts).__name__}.")
