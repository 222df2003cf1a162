"""One path submits requests (`vx.client.submit`), for `LLMEngine.add_request`, `LLM.generate` and `AsyncLLM`: all or
nothing. A failure midway (here: sending the 2nd engine request) aborts what was sent and leaves nothing registered.
(The AsyncLLM case is in test_async_llm.py, on that module's engine.)"""

from __future__ import annotations

import pytest
from tests.support.engine_processes import ENGINE_KWARGS

import vx
from vx.client.output_processor import OutputProcessor
from vx.client.processor import Processor
from vx.client.submit import PromptRequest, submit_requests

GREEDY = vx.SamplingParams(temperature=0.0, max_tokens=4)


class FailingSend:
    """Wraps a client's add_request: records what it sent, and raises on call number `fail_at` (1-based)."""

    def __init__(self, send, fail_at: int) -> None:
        self.send, self.fail_at, self.sent = send, fail_at, []

    def __call__(self, request) -> None:
        if len(self.sent) + 1 == self.fail_at:
            raise RuntimeError("injected send failure")
        self.send(request)
        self.sent.append(request.request_id)


class RecordingClient:
    """An engine core client that only records."""

    def __init__(self, fail_at: int) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.add_request = FailingSend(lambda r: self.added.append(r.request_id), fail_at)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


def assert_nothing_registered(op: OutputProcessor) -> None:
    assert op.request_states == {} and op.parent_requests == {} and not op.has_unfinished_requests()


# ------------------------------------------------------------------------------------------------- no engine
@pytest.mark.parametrize("requests, sent, aborted", [
    # the 2nd of n = 3 samples fails to go out: the 1st was sent, all three are aborted
    ([PromptRequest("p", "hi", GREEDY.clone(n=3))], ["0_p"], ["0_p", "1_p", "2_p"]),
    # the 2nd of three prompts fails to go out
    ([PromptRequest(rid, "hi", GREEDY) for rid in "abc"], ["a"], ["a", "b"]),
])
def test_a_failed_send_rolls_back_everything(make_model_config, tokenizer, requests, sent, aborted):
    op, client = OutputProcessor(tokenizer), RecordingClient(fail_at=2)
    with pytest.raises(RuntimeError, match="injected send failure"):
        submit_requests(Processor(make_model_config(), tokenizer), op, client, requests)
    assert client.added == sent and client.aborted == aborted
    assert_nothing_registered(op)


def test_a_bad_request_registers_and_sends_nothing(make_model_config, tokenizer):
    op, client = OutputProcessor(tokenizer), RecordingClient(fail_at=0)
    with pytest.raises(ValueError, match="empty"):
        submit_requests(Processor(make_model_config(), tokenizer), op, client,
                        [PromptRequest("a", "fine", GREEDY), PromptRequest("b", "", GREEDY)])
    assert client.added == client.aborted == []
    assert_nothing_registered(op)


def test_a_duplicate_id_midway_rolls_back_the_ones_before(make_model_config, tokenizer):
    op, client = OutputProcessor(tokenizer), RecordingClient(fail_at=0)
    with pytest.raises(ValueError, match="unique"):
        submit_requests(Processor(make_model_config(), tokenizer), op, client,
                        [PromptRequest("a", "x", GREEDY), PromptRequest("a", "y", GREEDY)])
    assert client.added == ["a"] and client.aborted == ["a"]
    assert_nothing_registered(op)


# --------------------------------------------------------------------------------------- in-process engine
@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = vx.LLM(tiny_model_dir, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


def assert_idle(llm: vx.LLM) -> None:
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0), stats
    assert_nothing_registered(llm.llm_engine.output_processor)


@pytest.mark.parametrize("submit", ["generate", "add_request"])
def test_sync_failure_midway_leaves_nothing_behind(llm, monkeypatch, submit):
    """`LLM.generate` (the 2nd of three prompts fails to go out) and `LLMEngine.add_request` (the 2nd of n = 3
    samples): the engine aborts what it got, and the front end keeps no state; the next call works."""
    engine = llm.llm_engine
    core = engine.engine_core
    send = FailingSend(core.add_request, fail_at=2)
    aborted: list[str] = []
    abort = core.abort_requests
    monkeypatch.setattr(core, "add_request", send)
    monkeypatch.setattr(core, "abort_requests", lambda ids: (aborted.extend(ids), abort(ids)))
    with pytest.raises(RuntimeError, match="injected send failure"):
        if submit == "generate":
            llm.generate(["one", "two", "three"], GREEDY.clone(max_tokens=50, ignore_eos=True), use_tqdm=False)
        else:
            engine.add_request("fan", "one", GREEDY.clone(n=3, max_tokens=50, ignore_eos=True))
    assert len(send.sent) == 1 and send.sent[0] in aborted
    assert_idle(llm)  # what was sent was aborted in the engine: nothing runs or waits
    monkeypatch.undo()
    assert [o.finished for o in llm.generate(["one", "two"], GREEDY, use_tqdm=False)] == [True, True]
    assert_idle(llm)
