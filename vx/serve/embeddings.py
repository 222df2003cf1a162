"""`POST /v1/embeddings`: OpenAI's embeddings of one input or a batch, as the engine's pooling requests.

Each input (a string, or a list of token ids) is one engine request through the same scheduler and KV cache as
generation; it ends after its prompt with the pooled final hidden state (last token by default, L2-normalised).
`dimensions` is accepted only for a model whose config declares Matryoshka embeddings (`matryoshka_dimensions` or
`is_matryoshka` in its config.json); for any other model it is a 400, as vLLM answers.
"""

from __future__ import annotations

import base64
import struct
import time
from functools import partial

from starlette.responses import Response
from starlette.types import Receive

from vx.errors import EngineDeadError, EngineGenerateError
from vx.pooling_params import PoolingParams, check_dimensions
from vx.serve.errors import bad_request
from vx.serve.generation import engine_api_error, now
from vx.serve.metrics import RequestTimer
from vx.serve.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from vx.serve.request_limits import check_prompt_count, prompt_count
from vx.serve.state import ServerState, new_id
from vx.serve.streaming import ClientDisconnected, run_until_disconnect
from vx.serve.prompt_tokens import in_thread, tokenize_prompts

ENDPOINT = "/v1/embeddings"


async def create_embeddings(state: ServerState, req: EmbeddingRequest, receive: Receive) -> Response:
    """Validate `req`, embed every input, and answer in OpenAI's embeddings shape (a 4xx `APIError` for bad input)."""
    start = now()
    with state.metrics.errors_counted(ENDPOINT):
        return await _create(state, req, receive, start)


async def _create(state: ServerState, req: EmbeddingRequest, receive: Receive, start: float) -> Response:
    model = state.model_name(req.model)
    params = _pooling_params(state, req)
    check_prompt_count(prompt_count(req.input), state.options, "input")  # each input is an engine request
    _, prompts = await in_thread(partial(tokenize_prompts, req.input, state.tokenizer, state.max_model_len,
                                         param="input", generates=False), state.tokenize_limiter)
    rid, created = new_id("embd"), int(time.time())
    timer = RequestTimer(state.metrics, ENDPOINT, start)
    try:
        outputs = await run_until_disconnect(receive, lambda: state.llm.embed(prompts, params, request_id=rid))
    except ClientDisconnected:
        timer.finished(["abort"] * len(prompts))
        return Response(status_code=499)  # nobody reads it; the requests were aborted
    except (ValueError, EngineDeadError, EngineGenerateError) as e:
        raise engine_api_error(e, rid, accepted=False, prompt_param="input") from None
    num_tokens = sum(len(p) for p in prompts)
    timer.prompt(num_tokens)
    timer.finished(["stop"] * len(prompts))
    data = [EmbeddingData(index=i, embedding=_encode(out.outputs.embedding, req.encoding_format))
            for i, out in enumerate(outputs)]
    resp = EmbeddingResponse(id=rid, created=created, model=model, data=data,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
    return Response(resp.model_dump_json(), media_type="application/json")


def _pooling_params(state: ServerState, req: EmbeddingRequest) -> PoolingParams:
    """The request's pooling, checked against the model (`dimensions` needs a Matryoshka model): a 400 if bad."""
    config = state.llm.config
    try:
        params = PoolingParams(pooling_type=req.pooling_type, normalize=req.normalize, dimensions=req.dimensions)
        check_dimensions(params, config.model_config.hf_config if config is not None else None)
    except ValueError as e:
        raise bad_request(str(e), "dimensions" if "dimensions" in str(e) else None) from None
    return params


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """The embedding as OpenAI sends it: a list of floats, or base64 of its float32 values (little-endian)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
    return embedding
