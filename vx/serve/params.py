"""OpenAI request fields -> `vx.SamplingParams`, with every bad value reported as a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

from vx.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams, StructuredOutputsParams
from vx.serve.errors import bad_request
from vx.serve.options import ServerOptions
from vx.serve.protocol import ResponseFormat, SamplingFields
from vx.serve.validation import check_json_schema, check_json_text

# SamplingParams' fields that take a request field of the same name as is, when the client set it.
_PASSTHROUGH = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                "include_stop_str_in_output", "bad_words", "priority")


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None = None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """The engine's params for `req`. Outputs stream as deltas: the server assembles choices itself."""
    kwargs: dict[str, Any] = {name: getattr(req, name) for name in _PASSTHROUGH if getattr(req, name) is not None}
    kwargs["max_tokens"] = max_tokens
    if req.stop is not None:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.logit_bias:
        kwargs["logit_bias"] = _logit_bias(req.logit_bias)
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}.", "logprobs")
        kwargs["logprobs"] = logprobs
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    if structured is not None:
        kwargs["structured_outputs"] = structured
    try:
        return SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
    except ValueError as e:
        raise bad_request(str(e), _param_named_in(str(e), kwargs)) from None


def check_request_shape(req: SamplingFields) -> None:
    """A 400 for fields that only make sense together: `stream_options` needs `stream: true` (as OpenAI says)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int | None, *,
                         param: str, prompt_name: str) -> None:
    """A 400, in vLLM's words, when the prompt plus `max_tokens` (the request's `param`) do not fit the model's
    context: the engine would otherwise run until the context is full, far short of what was asked."""
    if max_tokens is None or max_model_len is None or num_prompt_tokens + max_tokens <= max_model_len:
        return
    raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                      f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_name}, "
                      f"{max_tokens} in the completion). Please reduce the length of the {prompt_name} or "
                      "completion.", param)


def structured_outputs(req: SamplingFields, response_format: ResponseFormat | None,
                       forced: StructuredOutputsParams | None = None, forced_by: str = "tool_choice", *,
                       max_json_depth: int = ServerOptions.max_json_depth) -> StructuredOutputsParams | None:
    """The one output constraint the request asks for (see `output_constraint`), without the field it came from."""
    found = output_constraint(req, response_format, forced, forced_by, max_json_depth=max_json_depth)
    return found[1] if found is not None else None


def output_constraint(req: SamplingFields, response_format: ResponseFormat | None,
                      forced: StructuredOutputsParams | None = None, forced_by: str = "tool_choice", *,
                      max_json_depth: int = ServerOptions.max_json_depth
                      ) -> tuple[str, StructuredOutputsParams] | None:
    """The one output constraint the request asks for, and the field that asked: `response_format`,
    `structured_outputs` (vLLM's extra), vLLM's older `guided_*` fields, or `forced` (a tool choice's schema, from
    `forced_by`). Two at once is a 400, and so is a JSON schema that is invalid, has a `$ref` that resolves
    nowhere, or (given as text) nests deeper than `max_json_depth`. Regexes and grammars are compiled by the
    engine before the request is scheduled; `constraint_error` names the field when it refuses one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if forced is not None:
        found.append((forced_by, forced))
    if response_format is not None and response_format.type != "text":
        found.append(("response_format", _from_response_format(response_format, max_json_depth)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _make(req.structured_outputs, "structured_outputs", max_json_depth)))
    guided = {k: v for k, v in (("json", req.guided_json), ("regex", req.guided_regex),
                                 ("choice", req.guided_choice), ("grammar", req.guided_grammar)) if v is not None}
    if guided:
        name = "guided_" + next(iter(guided))
        found.append((name, _make(guided, name if len(guided) == 1 else "guided_*", max_json_depth)))
    if len(found) > 1:
        raise bad_request(f"Only one output constraint may be given; got {' and '.join(n for n, _ in found)}.",
                          found[1][0])
    return found[0] if found else None


def _from_response_format(fmt: ResponseFormat, max_json_depth: int) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise bad_request("response_format of type 'json_schema' needs json_schema.schema.", "response_format")
    return _make({"json": fmt.json_schema.json_schema}, "response_format", max_json_depth)


def _make(spec: dict[str, Any], param: str, max_json_depth: int) -> StructuredOutputsParams:
    if "json" in spec and isinstance(spec["json"], str):
        check_json_text(spec["json"], max_json_depth, "The JSON schema", param)
        try:
            spec = {**spec, "json": json.loads(spec["json"])}
        except json.JSONDecodeError as e:
            raise bad_request(f"The JSON schema is not valid JSON: {e}", param) from None
    try:
        params = StructuredOutputsParams(**spec)
    except (TypeError, ValueError) as e:
        raise bad_request(f"{param}: {e}", param) from None
    if params.json is not None:
        check_json_schema(params.json, param)
    return params


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, i.e. strings."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
    return out


def _param_named_in(message: str, kwargs: dict[str, Any]) -> str | None:
    """SamplingParams' errors start with the field's name; report it as the OpenAI `param`."""
    head = message.split(" ", 1)[0]
    return head if head in kwargs or head in _PASSTHROUGH else None
