"""`vx.openai_client` beyond the server's own tests (which run in-process too, see
conftest.py): responses stream as they are generated, the lifecycle (the client never stops an engine it did not
start; a closed engine ends its requests with a 503), and the sync client's threads. On asyncio and trio."""

from __future__ import annotations

import anyio
import openai
import pytest

import vx

pytestmark = pytest.mark.anyio
CHAT = dict(model="", messages=[{"role": "user", "content": "Tell a story"}], temperature=0.0,
            extra_body={"ignore_eos": True})


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
async def llm(anyio_backend, tiny_model_dir):
    async with vx.AsyncLLM(tiny_model_dir, max_model_len=512) as engine:
        yield engine


async def test_a_stream_arrives_while_it_is_generated(llm):
    client = vx.openai_client(llm)
    stream = await client.chat.completions.create(max_tokens=200, stream=True, **CHAT)
    first = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = chunk
            break
    assert first is not None
    assert llm.num_unfinished_requests == 1  # a buffering transport would only return at the end
    await stream.close()  # the client goes away: the request is aborted
    with anyio.fail_after(10):
        while llm.num_unfinished_requests:
            await anyio.sleep(0.01)
    await client.close()


async def test_closing_a_client_leaves_the_engine_running(llm):
    client = vx.openai_client(llm)
    assert isinstance(client, openai.AsyncOpenAI)
    await client.close()
    again = vx.openai_client(llm)
    out = await again.chat.completions.create(max_tokens=3, **CHAT)
    assert out.usage.completion_tokens == 3
    assert [t async for t in llm.stream("Hi", vx.SamplingParams(max_tokens=2, ignore_eos=True))]
    await again.close()


async def test_the_sync_client_serves_worker_threads_not_the_loop(llm):
    client = vx.openai_client(llm, sync=True)
    assert isinstance(client, openai.OpenAI)

    def in_thread() -> list[str]:
        chunks = client.chat.completions.create(max_tokens=4, stream=True, **CHAT)
        return [c.choices[0].delta.content or "" for c in chunks if c.choices]

    assert "".join(await anyio.to_thread.run_sync(in_thread))
    with pytest.raises(RuntimeError, match="event loop that runs the engine"):  # it would block that loop
        client.models.list()


async def test_an_engine_needs_starting_and_its_close_ends_the_clients_requests(anyio_backend, tiny_model_dir):
    engine = vx.AsyncLLM(tiny_model_dir, max_model_len=512)
    with pytest.raises(RuntimeError, match="Start the engine"):
        vx.openai_client(engine)
    async with engine:
        client = vx.openai_client(engine)
        assert (await client.chat.completions.create(max_tokens=2, **CHAT)).choices
    with anyio.fail_after(5):  # a 503 at once, never retried
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(max_tokens=2, **CHAT)
    assert err.value.status_code == 503 and err.value.body["code"] == "engine_dead"


async def test_a_sync_client_made_in_a_worker_thread(llm):
    def make_and_use() -> int:
        client = vx.openai_client(llm, sync=True)  # finds the engine's loop from the anyio worker thread
        return client.chat.completions.create(max_tokens=2, **CHAT).usage.completion_tokens

    assert await anyio.to_thread.run_sync(make_and_use) == 2
