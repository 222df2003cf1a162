"""`vx.LLM`: synchronous batch generation for scripts and notebooks."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from vx.client.llm_engine import LLMEngine
from vx.client.submit import Prompt, PromptRequest, normalize_prompts
from vx.config import EngineArgs
from vx.outputs import EmbeddingRequestOutput, EngineStats, RequestOutput
from vx.pooling_params import PoolingParams
from vx.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate for many prompts at once with continuous batching: `LLM(model).generate(prompts, params)`.

    The engine runs in this process by default; `multiprocess=True` runs it in a background process.
    """

    def __init__(self, model: str | None = None, *, multiprocess: bool = False, **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(args, multiprocess=multiprocess)
        self._counter = itertools.count()

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        `priority` (one per prompt) matters with `scheduling_policy="priority"`: lower values run first.
        All prompts are validated before any is queued, so one bad prompt raises ValueError and
        nothing runs. A request the engine fails raises `vx.InvalidRequestError` (a ValueError: its input is at
        fault, e.g. a grammar that does not compile) or `vx.errors.EngineGenerateError`, and the rest is aborted.
        """
        prompt_list = normalize_prompts(prompts)
        params_list = _per_prompt(sampling_params, SamplingParams, len(prompt_list), "sampling_params")
        params_list = [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        return self._run(prompt_list, params_list, priority, "Generating", use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (`out.outputs.embedding`), in prompt order, as vLLM's `LLM.embed`.

        Each prompt runs through the same scheduler and KV cache as generation (chunked prefill, prefix caching,
        preemption) and ends after its prompt. Default pooling: the last token's final hidden state, L2-normalised
        (`vx.PoolingParams` for mean pooling or Matryoshka `dimensions`). Bad input raises ValueError, nothing runs.
        """
        prompt_list = normalize_prompts(prompts)
        params_list = _per_prompt(pooling_params, PoolingParams, len(prompt_list), "pooling_params")
        return self._run(prompt_list, params_list, priority, "Embedding", use_tqdm)

    def _run(self, prompt_list: list[Prompt], params_list: list[SamplingParams] | list[PoolingParams],
             priority: Sequence[int] | None, desc: str, use_tqdm: bool) -> list[Any]:
        """Queue one request per prompt (all or nothing) and step the engine until each has its final output;
        the outputs in prompt order. An error aborts whatever is still running."""
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"Got {len(prompt_list)} prompts but {len(priorities)} priorities.")
        engine = self.llm_engine
        requests = [PromptRequest(str(next(self._counter)), prompt, params, priority=prio)
                    for prompt, params, prio in zip(prompt_list, params_list, priorities)]
        engine.add_requests(requests)  # all or nothing
        order = {r.request_id: i for i, r in enumerate(requests)}
        results: list[Any] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=desc, disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            pending = [r.request_id for r, res in zip(requests, results) if res is None]
            engine.abort_request(pending)
            raise
        finally:
            bar.close()
        return results

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of messages) or to several, with the model's chat template.

        Without sampling params a reply has at most `DEFAULT_CHAT_MAX_TOKENS` tokens; it always stops at
        the template's end-of-turn token.
        """
        from vx.client.chat import chat_sampling_params, render_chat_prompt

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        # The template already places any BOS; tokenizing without special tokens avoids a second one.
        prompts = [self.tokenizer.encode(render_chat_prompt(self.tokenizer, conv, tools=tools,
                                                            chat_template=chat_template),
                                         add_special_tokens=False)
                   for conv in conversations]
        params = chat_sampling_params(sampling_params, self.tokenizer, chat_template)
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def stats(self) -> EngineStats:
        """A snapshot of the engine (queues, KV blocks, prefix-cache hits, preemptions)."""
        return self.llm_engine.stats()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt(params: Any, kind: type, num_prompts: int, name: str) -> list[Any]:
    """`params` (None: `kind()`; one `kind`: for every prompt; else one per prompt) as a list, one per prompt;
    `ValueError` naming the argument `name` for a wrong count or type."""
    if params is None or isinstance(params, kind):
        return [params if params is not None else kind()] * num_prompts
    out = list(params)
    if len(out) != num_prompts:
        raise ValueError(f"Got {num_prompts} prompts but {len(out)} {name.replace('_', ' ')}.")
    for p in out:
        if not isinstance(p, kind):
            raise ValueError(f"{name} must be {kind.__name__}, got {type(p).__name__}.")
    return out
