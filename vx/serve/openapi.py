"""The OpenAPI document served at `/openapi.json`: FastAPI's, corrected to say what the server really sends.

FastAPI documents a 422 for each route with a body; vx answers 400 in OpenAI's error shape instead. Here each
operation lists the statuses it can answer, every error with the `ErrorResponse` schema, generation routes
their stream (`text/event-stream`) beside the JSON body, and `/v1/*` its bearer key when one is required.
The schema fuzzing test (tests/serve/test_fuzz.py) holds the server to this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pydantic import BaseModel

from vx.serve.chat import ENDPOINT as CHAT_ENDPOINT
from vx.serve.completions import ENDPOINT as COMPLETIONS_ENDPOINT
from vx.serve.guard import GENERATION_PATHS
from vx.serve.protocol import ChatCompletionChunk, CompletionResponse, ErrorResponse
from vx.serve.responses import ENDPOINT as RESPONSES_ENDPOINT
from vx.serve.responses_protocol import ResponseStreamEvent

_STREAM_CHUNKS: dict[str, type[BaseModel]] = {COMPLETIONS_ENDPOINT: CompletionResponse,
                                              CHAT_ENDPOINT: ChatCompletionChunk,
                                              RESPONSES_ENDPOINT: ResponseStreamEvent}

_WHY = {
    400: "A bad field, malformed JSON, JSON nested too deeply or holding a lone surrogate, an invalid JSON schema "
         "or grammar, or a prompt too long for the model.",
    401: "A missing or wrong API key (`code: invalid_api_key`).",
    404: "An unknown model (`code: model_not_found`).",
    408: "The request body did not arrive within the body timeout (`code: request_timeout`).",
    413: "The request body is larger than the server's limit (`code: request_too_large`).",
    429: "The server is handling its limit of concurrent requests; see `Retry-After` (`code: too_many_requests`).",
    503: "The engine is not running (`code: engine_dead`), the server is shutting down (`code: shutting_down`), or "
         "the engine had no capacity for the request in time (`code: overloaded`, with `Retry-After`).",
}


def _statuses(path: str, method: str) -> list[int]:
    """The error statuses one operation can answer."""
    statuses = [503]
    if path.startswith("/v1/"):
        statuses.append(401)
    if path.startswith("/v1/models/"):
        statuses.append(404)
    if method == "post":
        statuses += [400, 408, 413]
    if path in GENERATION_PATHS:  # they name a model and count against the concurrency limit
        statuses += [404, 429]
    return sorted(set(statuses))


def openapi_document(app: FastAPI, *, title: str, version: str, api_key_required: bool) -> dict[str, Any]:
    """The document for `app`'s routes, with the error responses and streams the server sends."""
    doc = get_openapi(title=title, version=version, routes=app.routes,
                      description="OpenAI-compatible completions, chat and embeddings of one model, served by vx.")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, which vx never sends
        schemas.pop(name, None)
    error_ref = _component(schemas, ErrorResponse)
    if api_key_required:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in _statuses(path, method):
                responses[str(status)] = {"description": _WHY[status],
                                          "content": {"application/json": {"schema": error_ref}}}
            if path in _STREAM_CHUNKS:
                responses["200"].setdefault("content", {})["text/event-stream"] = {
                    "schema": _event_schema(_component(schemas, _STREAM_CHUNKS[path]), error_ref)}
            if api_key_required and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
    return doc


def _component(schemas: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    """A reference to `model`'s schema, added to the components (with the models it uses) if missing."""
    if model.__name__ not in schemas:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        for name, definition in schema.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _event_schema(chunk_ref: dict[str, str], error_ref: dict[str, str]) -> dict[str, Any]:
    """One server-sent event of a stream (before OpenAPI 3.2 `schema` describes each event): `data` is a chunk,
    an error (a stream that fails after its first chunk), or `[DONE]`, last."""
    return {
        "type": "object", "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [chunk_ref, error_ref]}},
        ]}},
    }
