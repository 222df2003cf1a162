"""What a client learns when a request fails, with an engine double that fails on demand (in process, no model):
engine refusals are 400s, unexpected errors are 500s that name no class, message or path and are counted,
/metrics shows unknown engine gauges as NaN, and /openapi.json says what the server sends."""

from __future__ import annotations

import logging
import math

import httpx
import pytest

from vx.errors import EngineDeadError, EngineGenerateError, InvalidRequestError
from vx.serve.app import build_app

ENDPOINT = "/v1/completions"
SECRET = "TypeError in /home/alice/secret/vx/model_runner.py"


class FailingLLM:
    """Enough of a `vx.AsyncLLM` for the app: every request fails with `error`."""

    config = None
    tokenizer = None
    errored = False

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def generate(self, prompt, params, request_id=None):
        raise self.error
        yield  # an async generator, as AsyncLLM.generate is

    async def stats(self):
        raise EngineDeadError("The vx engine died: test.")


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _post(llm: FailingLLM, stream: bool) -> tuple[httpx.Response, str]:
    app = build_app(llm, served_model_names=["m"], start_engine=False)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        r = await c.post(ENDPOINT, json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": stream})
        metrics = (await c.get("/metrics")).text
    return r, metrics


def _errors_counted(metrics: str) -> float:
    line = f'vx_requests_total{{endpoint="{ENDPOINT}",finish_reason="error"}} '
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line))


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("error", [TypeError(SECRET), EngineGenerateError(SECRET), KeyError(SECRET)])
async def test_unexpected_errors_are_500s_that_reveal_nothing_and_are_counted(error, stream, caplog):
    with caplog.at_level(logging.ERROR, logger="vx.serve"):
        r, metrics = await _post(FailingLLM(error), stream)
    assert r.status_code == 500
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "internal_error"
    for leak in (type(error).__name__, "secret", "/home", ".py"):
        assert leak not in body["message"]
    reference = body["message"].split("reference ")[1].split(";")[0]
    assert reference in caplog.text and SECRET in caplog.text  # the log has what the client does not
    assert _errors_counted(metrics) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("error, status", [
    (InvalidRequestError("The engine refused request 'x': structured_outputs.regex is invalid: ("), 400),
    (ValueError("The prompt is 3000 tokens long, but max_model_len is 1024"), 400),
    (RecursionError("maximum recursion depth exceeded"), 400),
    (EngineDeadError("The vx engine died: SIGKILL."), 503),
])
async def test_client_caused_and_engine_death_errors(error, status):
    for stream in (False, True):
        r, metrics = await _post(FailingLLM(error), stream)
        assert r.status_code == status, r.text
        assert _errors_counted(metrics) == 1
    if status == 400 and isinstance(error, ValueError):
        assert str(error) in r.json()["error"]["message"]  # the client's own mistake is explained


@pytest.mark.anyio
async def test_metrics_show_a_silent_engine_as_nan_not_stale():
    _, metrics = await _post(FailingLLM(ValueError("x")), False)
    running = [x for x in metrics.splitlines() if x.startswith("vx_num_requests_running ")]
    assert running and math.isnan(float(running[0].split()[-1]))


@pytest.mark.anyio
async def test_openapi_document_says_what_the_server_sends():
    app = build_app(FailingLLM(ValueError("x")), served_model_names=["m"], start_engine=False, api_key="k")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        r = await c.get("/openapi.json")  # open: no key needed
        unauthorized = await c.get("/v1/no-such-route")
    assert unauthorized.status_code == 401  # every /v1 path is behind the key, even one that does not exist
    doc = r.json()
    assert r.status_code == 200 and "422" not in r.text and "HTTPValidationError" not in r.text
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert sorted(responses) == ["200", "400", "401", "404", "408", "413", "429", "503"]
        assert all(responses[s]["content"]["application/json"]["schema"] == error for s in responses if s != "200")
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert doc["paths"][path]["post"]["security"] == [{"bearer": []}]
    assert sorted(doc["paths"]["/health"]["get"]["responses"]) == ["200", "503"]
    assert sorted(doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]) == ["200", "401", "404", "503"]


@pytest.mark.anyio
async def test_a_draining_server_answers_503():
    app = build_app(FailingLLM(ValueError("x")), served_model_names=["m"], start_engine=False)
    app.state.vx.inflight.draining = True  # as the server sets it on SIGTERM, for requests on open connections
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        r = await c.post(ENDPOINT, json={"model": "m", "prompt": [1]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
