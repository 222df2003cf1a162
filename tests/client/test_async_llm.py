"""AsyncLLM over a background engine process, on asyncio and trio: streaming, cancellation, aborts, death.

One engine per backend serves the whole module; the last test kills it (SIGKILL), so keep it last. (An engine
fault inside execute_model is tested in tests/e2e/test_streaming.py, on the engine that test already starts.)
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import time

import anyio
import msgspec
import psutil
import pytest
from tests.support.app_process import MODEL_SIDE_CHECK
from tests.support.engine_processes import ENGINE_KWARGS, child_pids, cpu_seconds

import vx
from vx.client.request_stream import RequestStream, merge_delta
from vx.errors import EngineGenerateError
from vx.outputs import CompletionOutput, RequestOutput
from vx.sampling_params import RequestOutputKind as Kind

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
async def llm(anyio_backend, tiny_model_dir):
    async with vx.AsyncLLM(tiny_model_dir, **ENGINE_KWARGS) as engine:
        yield engine


def greedy(max_tokens: int = 16, **kw) -> vx.SamplingParams:
    return vx.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def assert_idle(llm: vx.AsyncLLM) -> None:
    """No request left anywhere: engine queues, KV blocks, front-end state."""
    stats = await llm.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0), stats
    assert llm.output_processor.request_states == {}
    assert llm.output_processor.queues() == []


# ----------------------------------------------------------------------------------------- no engine needed
def test_constructor_only_validates(tiny_model_dir):
    with pytest.raises(ValueError, match="Unknown engine argument"):
        vx.AsyncLLM(tiny_model_dir, not_an_arg=1)
    with pytest.raises(ValueError, match="block_size"):
        vx.AsyncLLM(tiny_model_dir, block_size=3)
    before = child_pids()
    llm = vx.AsyncLLM(tiny_model_dir, **ENGINE_KWARGS)
    assert child_pids() == before  # no engine until `async with`
    del llm


async def test_use_without_async_with_is_refused(tiny_model_dir):
    llm = vx.AsyncLLM(tiny_model_dir, **ENGINE_KWARGS)
    with pytest.raises(RuntimeError, match="async with"):
        await llm.stats()
    with pytest.raises(RuntimeError, match="async with"):
        async for _ in llm.stream("hi"):
            pass


def _out(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, "stop" if finished else None)], finished)


async def test_request_stream_merges_while_consumer_is_behind():
    delta = RequestStream("r", Kind.DELTA)
    for i, t in enumerate(["a", "bc", "d"]):
        delta.put(_out(t, [i], finished=i == 2))
    merged = await delta.get()
    assert (merged.outputs[0].text, merged.outputs[0].token_ids, merged.finished) == ("abcd", [0, 1, 2], True)
    assert merged.outputs[0].finish_reason == "stop"
    assert merge_delta(_out("x", [1]), _out("y", [2])).outputs[0].text == "xy"

    cumulative = RequestStream("r", Kind.CUMULATIVE)
    cumulative.put(_out("a", [0]))
    cumulative.put(_out("ab", [0, 1]))
    assert (await cumulative.get()).outputs[0].text == "ab"
    cumulative.fail(vx.EngineDeadError("gone"))
    with pytest.raises(vx.EngineDeadError):
        await cumulative.get()


# ---------------------------------------------------------------------------------------------- streaming
async def test_output_kinds_give_consistent_text(llm):
    prompt = "The quick brown fox"
    final = await llm.complete(prompt, greedy(20))
    full, ids = final.outputs[0].text, final.outputs[0].token_ids
    assert final.finished and len(ids) > 0

    cumulative = [o async for o in llm.generate(prompt, greedy(20, output_kind=Kind.CUMULATIVE))]
    for a, b in zip(cumulative, cumulative[1:]):
        assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert cumulative[-1].outputs[0].text == full and cumulative[-1].outputs[0].token_ids == ids

    delta = [o async for o in llm.generate(prompt, greedy(20, output_kind=Kind.DELTA))]
    assert "".join(o.outputs[0].text for o in delta) == full
    assert [t for o in delta for t in o.outputs[0].token_ids] == ids

    only = [o async for o in llm.generate(prompt, greedy(20, output_kind=Kind.FINAL_ONLY))]
    assert len(only) == 1 and only[0].outputs[0].text == full and only[0].finished

    assert "".join([t async for t in llm.stream(prompt, greedy(20))]) == full
    assert [t async for t in llm.stream(ids[:3], greedy(4))]  # token-id prompts work too
    await assert_idle(llm)


async def test_stop_strings_spanning_tokens_are_cut_exactly(llm):
    tok = llm.tokenizer
    for prompt in ("Once upon a time", "hello world", "abc def ghi", "numbers 1 2 3"):
        full = (await llm.complete(prompt, greedy(32, ignore_eos=True))).outputs[0].text
        for start in range(2, max(2, len(full) - 8)):
            stop = full[start:start + 5]
            if "\ufffd" not in stop and stop.isprintable() and len(tok.encode(stop, add_special_tokens=False)) >= 2:
                break
        else:
            continue
        cut = full[:full.index(stop)]
        for kind in Kind:
            outs = [o async for o in llm.generate(prompt, greedy(32, ignore_eos=True, stop=[stop],
                                                                 output_kind=kind))]
            text = "".join(o.outputs[0].text for o in outs) if kind == Kind.DELTA else outs[-1].outputs[0].text
            assert text == cut, (kind, stop, full)
            assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
        with_stop = await llm.complete(prompt, greedy(32, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True))
        assert with_stop.outputs[0].text == cut + stop
        assert "".join([t async for t in llm.stream(prompt, greedy(32, ignore_eos=True, stop=[stop]))]) == cut
        await assert_idle(llm)  # the engine was told to abort what the stop strings ended
        return
    pytest.fail("no prompt gave a clean multi-token stop string")


async def test_slow_consumer_does_not_block_others(llm):
    prompt = "slow consumer"
    expected = (await llm.complete(prompt, greedy(24, ignore_eos=True))).outputs[0].text
    slow = llm.generate(prompt, greedy(24, ignore_eos=True, output_kind=Kind.DELTA))
    first = await slow.__anext__()  # the request runs; now stop reading it for a while
    with anyio.fail_after(60):  # would hang if the output task waited for the slow consumer
        fast = await llm.complete("fast one", greedy(24, ignore_eos=True))
        assert fast.finished
        while (await llm.stats()).num_running:  # let the slow request finish unread
            await anyio.sleep(0.05)
    rest = [o async for o in slow]
    assert len(rest) == 1 and rest[0].finished  # everything produced meanwhile merged into one output
    assert first.outputs[0].text + "".join(o.outputs[0].text for o in rest) == expected
    await assert_idle(llm)


async def test_bad_requests_fail_alone_and_leave_no_state(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        await llm.complete([10**6], greedy(4))
    with pytest.raises(ValueError, match="max_model_len"):
        await llm.complete(list(range(1, 300)), greedy(4))
    long = llm.generate("dup", greedy(200, ignore_eos=True), request_id="dup")
    await long.__anext__()
    with pytest.raises(ValueError, match="unique"):
        await llm.complete("dup again", greedy(4), request_id="dup")
    await long.aclose()
    assert (await llm.complete("still fine", greedy(4))).finished
    await assert_idle(llm)


def _changed_in_place(**changes) -> vx.SamplingParams:
    params = greedy(4)
    for name, value in changes.items():
        setattr(params, name, value)  # skips the constructor's checks: submission must catch it
    return params


# (prompt, params, request_id, what the ValueError says)
BAD_SUBMISSIONS = [
    ("", None, None, "empty"),
    ([], None, None, "empty"),
    (list(range(1, 300)), None, None, "max_model_len"),
    ("word " * 400, None, None, "max_model_len"),
    ([5, -1], None, None, "vocabulary"),
    ([5, 10**6], None, None, "vocabulary"),
    ([5, 1.5], None, None, "must be an int"),
    ([5, True], None, None, "must be an int"),
    (5, None, None, "must be a str or a list"),
    (b"bytes", None, None, "must be a str or a list"),
    ("ok", {"max_tokens": 4}, None, "SamplingParams"),
    ("ok", "greedy", None, "SamplingParams"),
    ("ok", _changed_in_place(n=0), None, "n must"),
    ("ok", greedy(4, stop_token_ids=[10**6]), None, "vocabulary"),
    ("ok", greedy(4, logit_bias={10**6: 1.0}), None, "vocabulary"),
    ("ok", _changed_in_place(max_tokens=0), None, "max_tokens"),
    ("ok", _changed_in_place(temperature=float("nan")), None, "temperature"),
    ("ok", _changed_in_place(stop=["\ud800"]), None, "UTF-8"),
    ("ok", _changed_in_place(bad_words="abc"), None, "bad_words"),
    ("ok", _changed_in_place(ignore_eos=1), None, "ignore_eos"),
    ("ok", _changed_in_place(top_k=2**63), None, "top_k must be <="),
    ("ok", greedy(4, top_k=513), None, r"top_k=513 exceeds the model's vocabulary size \(512\)"),
    ("ok", greedy(4, n=129), None, r"n=129"),  # complete/generate: "exceeds the engine's max_n_sequences (128)"
    ("ok", _changed_in_place(logprobs=21), None, "logprobs must be <= 20"),
    ("ok", _changed_in_place(stop=["s"] * 33), None, "at most 32"),
    ("ok", None, "", "request_id"),
    ("ok", None, 3, "request_id"),
    ("ok", None, "bystander", "unique"),  # the id of the request that is running
]


async def test_bad_input_fails_alone_at_submission_while_another_request_streams(llm):
    prompt, params = "an innocent bystander", greedy(60, ignore_eos=True)
    expected = (await llm.complete(prompt, params)).outputs[0].text
    bystander = llm.stream(prompt, params, request_id="bystander")
    received = [await bystander.__anext__()]
    for bad_prompt, bad_params, rid, message in BAD_SUBMISSIONS:
        with pytest.raises(ValueError, match=message):
            await llm.complete(bad_prompt, bad_params, rid)
        with pytest.raises(ValueError, match=message):
            async for _ in llm.generate(bad_prompt, bad_params, rid):
                pass
        with pytest.raises(ValueError, match=message):
            async for _ in llm.stream(bad_prompt, bad_params, rid):
                pass
        assert llm.num_unfinished_requests == 1
        assert [s.request_id for s in llm.output_processor.queues()] == ["bystander"]
    received += [t async for t in bystander]
    assert "".join(received) == expected  # undisturbed
    assert (await llm.complete(prompt, params, request_id="bystander")).outputs[0].text == expected  # reusable
    await assert_idle(llm)


async def test_a_failed_send_midway_leaves_nothing_behind(llm):
    """Sending the 2nd of n = 3 samples fails: the 1st is aborted in the engine, and neither the output processor
    nor the streams keep anything (all or nothing, as `vx.client.submit` does for every front end)."""
    client = llm._client
    send, sent, aborted = client.add_request, [], []

    def failing_send(request):
        if sent:
            raise RuntimeError("injected send failure")
        send(request)
        sent.append(request.request_id)

    client.add_request = failing_send
    client.abort_requests = lambda ids: (aborted.extend(ids), type(client).abort_requests(client, ids))
    try:
        with pytest.raises(RuntimeError, match="injected send failure"):
            async for _ in llm.generate("fan out", greedy(300, ignore_eos=True, n=3), request_id="fan"):
                pass
    finally:
        del client.add_request, client.abort_requests
    assert sent == ["0_fan"] and set(aborted) == {"0_fan", "1_fan", "2_fan"}
    assert llm.output_processor.parent_requests == {}
    await assert_idle(llm)  # the engine stopped the sample it got
    assert (await llm.complete("fan out", greedy(4, n=3), request_id="fan")).finished


async def test_malformed_message_is_reported_and_engine_keeps_serving(llm):
    engine = llm._client.engine
    with engine._send_lock:
        engine.input_socket.send_multipart([b"\x07", b"garbage"])  # unknown type: logged, nothing fails

    def send_garbage_add(request):  # an ADD the engine cannot decode, but whose request id it can read
        with engine._send_lock:
            engine.input_socket.send_multipart([b"\x00", msgspec.msgpack.encode([request.request_id, 1, 2])])

    llm._client.add_request = send_garbage_add
    try:
        with pytest.raises(EngineGenerateError, match="refused"):
            await llm.complete("x", greedy(4), request_id="bad-payload")
    finally:
        del llm._client.add_request
    assert (await llm.complete("after garbage", greedy(4))).finished
    await assert_idle(llm)


async def test_values_that_killed_the_engine_fail_alone_even_past_the_front_end(llm):
    """top_k = 2**63 reached the engine as a uint64 and raised when it became a tensor, which ended the engine and
    every request. Sent straight to the engine, past the front end's checks, it and an out-of-vocabulary logit_bias
    now fail their own request with InvalidRequestError (a ValueError: the caller's input), and the engine serves
    on."""
    engine = llm._client.engine
    raw_params = {"r-top-k": {"top_k": 2**63, "temperature": 1.0}, "r-bias": {"logit_bias": {600: 1.0}}}

    def send_raw(request):  # the request as a foreign client would send it, with the bad value put back in
        with engine._send_lock:
            engine.input_socket.send_multipart([b"\x00", msgspec.msgpack.encode(
                [request.request_id, request.prompt_token_ids, raw_params[request.request_id]])])

    llm._client.add_request = send_raw
    try:
        with pytest.raises(vx.InvalidRequestError, match="refused request 'r-top-k': .*top_k must be <= "
                                                         "9223372036854775807"):
            await llm.complete("x", greedy(4), request_id="r-top-k")
        with pytest.raises(vx.InvalidRequestError, match=r"refused request 'r-bias': .*logit_bias key 600 "
                                                         r"\(position 0\) is outside the model's vocabulary"):
            await llm.complete("x", greedy(4), request_id="r-bias")
    finally:
        del llm._client.add_request
    assert engine.proc.is_alive()
    assert (await llm.complete("after", greedy(4))).finished
    await assert_idle(llm)


# --------------------------------------------------------------------------------------- concurrency/abort
async def test_cancel_half_of_100_streams(llm):
    rng = random.Random(7)
    kinds = ["break", "scope", "fail_after", "move_on", "task"] * 10 + ["run"] * 50
    rng.shuffle(kinds)
    results: dict[int, str] = {}

    async def consume(i: int, kind: str) -> None:
        params = greedy(48 if kind == "run" else 400, ignore_eos=True)
        k = rng.randint(1, 30)
        if kind == "break":
            n = 0
            async for _ in llm.stream(f"prompt {i}", params):
                n += 1
                if n == k:
                    break
        elif kind == "scope":
            with anyio.CancelScope() as scope:
                n = 0
                async for _ in llm.generate(f"prompt {i}", params):
                    n += 1
                    if n == k:
                        scope.cancel()
        elif kind in ("fail_after", "move_on"):
            delay = rng.uniform(0.01, 0.5)
            try:
                if kind == "fail_after":
                    with anyio.fail_after(delay):
                        await llm.complete(f"prompt {i}", params)
                else:
                    with anyio.move_on_after(delay):
                        async for _ in llm.stream(f"prompt {i}", params):
                            pass
            except TimeoutError:
                pass
        elif kind == "run":
            out = await llm.complete(f"prompt {i}", params)
            assert len(out.outputs[0].token_ids) == 48
        else:  # run-long: cancelled from outside, by its task group
            async for _ in llm.stream(f"prompt {i}", params):
                pass
        results[i] = kind

    async def cancelled_task(i: int) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, i, "run-long")
            await anyio.sleep(rng.uniform(0.01, 0.5))
            tg.cancel_scope.cancel()
        results[i] = "task"

    async with anyio.create_task_group() as tg:
        for i, kind in enumerate(kinds):
            if kind == "task":
                tg.start_soon(cancelled_task, i)
            else:
                tg.start_soon(consume, i, kind)
    assert len(results) == 100
    gc.collect()
    await anyio.sleep(0.05)  # aborts scheduled by generator finalizers run now
    await assert_idle(llm)


async def test_explicit_abort(llm):
    rid = "to-abort"
    outs = []
    async with anyio.create_task_group() as tg:
        async def consume():
            async for out in llm.generate("abort me", greedy(400, ignore_eos=True), request_id=rid):
                outs.append(out)
        tg.start_soon(consume)
        while not outs:
            await anyio.sleep(0.01)
        await llm.abort(rid)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 400
    await assert_idle(llm)


@pytest.mark.parametrize("loop_hooks", [True, False], ids=["loop-finalizer", "no-hooks"])
async def test_dropped_generator_is_aborted(llm, loop_hooks):
    hooks = sys.get_asyncgen_hooks()
    if not loop_hooks:  # as if no event loop tracked it: deleting the generator closes it on the spot
        sys.set_asyncgen_hooks(firstiter=None, finalizer=None)
    try:
        gen = llm.generate("dropped", greedy(400, ignore_eos=True))
        await gen.__anext__()
    finally:
        sys.set_asyncgen_hooks(*hooks)
    del gen  # never closed explicitly: the loop's async-generator finalizer, or plain GC, must abort it
    gc.collect()
    for _ in range(100):
        await anyio.sleep(0.02)
        stats = await llm.stats()
        if stats.num_running == 0 and not llm.output_processor.request_states:
            break
    await assert_idle(llm)


async def test_idle_front_end_does_not_spin(llm):
    me = os.getpid()
    engine_pid = llm._client.engine.proc.pid
    before = cpu_seconds(me), cpu_seconds(engine_pid)
    await anyio.sleep(1.5)
    after = cpu_seconds(me), cpu_seconds(engine_pid)
    assert after[0] - before[0] < 0.075, "the front end burns CPU while idle"
    assert after[1] - before[1] < 0.075, "the engine burns CPU while idle"


# ------------------------------------------------------------------------------------------- engine death
async def test_sigkill_mid_stream(llm):
    """Keep last: kills the module's engine."""
    pid = llm._client.engine.proc.pid
    ipc_dir = llm._client.engine.ipc_dir
    started = 0
    failed_at: list[float] = []

    async def consume(i: int) -> None:
        nonlocal started
        with pytest.raises(vx.EngineDeadError):
            first = True
            async for _ in llm.stream(f"victim {i}", greedy(5000, ignore_eos=True)):
                if first:
                    started += 1
                    first = False
        failed_at.append(time.monotonic())

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(consume, i)
            while started < 8:
                await anyio.sleep(0.01)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
    assert len(failed_at) == 8 and max(failed_at) - killed_at < 2.0

    t0 = time.monotonic()
    for call in (lambda: llm.complete("new", greedy(4)), llm.stats, lambda: llm.abort("x")):
        with pytest.raises(vx.EngineDeadError, match="SIGKILL"):
            await call()
    with pytest.raises(vx.EngineDeadError):
        async for _ in llm.generate("new", greedy(4)):
            pass
    assert time.monotonic() - t0 < 0.5
    with anyio.CancelScope() as scope:  # shutting down under cancellation must still stop and reap the engine
        scope.cancel()
        await llm.shutdown()
    assert not psutil.pid_exists(pid)  # reaped, not a zombie
    assert child_pids() == set()
    assert not os.path.exists(ipc_dir)
    assert llm.output_processor.request_states == {} and llm.output_processor.queues() == []


def test_application_process_never_imports_torch(tiny_model_dir):
    """DESIGN: the application's process runs no model code; torch (seconds, hundreds of MB) stays out."""
    code = (
        "import sys, anyio, vx\n"
        "async def main():\n"
        f"    async with vx.AsyncLLM({tiny_model_dir!r}, device='auto') as llm:\n"
        "        out = await llm.complete([5, 6, 7], vx.SamplingParams(max_tokens=3, temperature=0))\n"
        "        assert len(out.outputs[0].token_ids) == 3\n"
        + "".join("    " + line + "\n" for line in MODEL_SIDE_CHECK.splitlines()) +
        "    assert not bad, bad[:10]\n"
        "if __name__ == '__main__':\n"
        "    anyio.run(main)\n"
    )
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
