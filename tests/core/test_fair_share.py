"""Fair steps: no client (one request or one n fan-out) holds the batch or the token budget while another waits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tests.core.test_scheduler import make_scheduler, req, run_all, step

from vx.core.fair_share import seat_claims, token_shares, water_fill
from vx.core.request import Request
from vx.sampling_params import SamplingParams


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 200), max_size=8), st.integers(0, 500))
def test_water_fill_is_max_min_fair(demands, capacity):
    alloc = water_fill(demands, capacity)
    assert set(alloc) == set(demands)
    assert sum(alloc.values()) == min(capacity, sum(demands.values()))
    for client, got in alloc.items():
        assert 0 <= got <= demands[client]
        if got < demands[client]:  # cut short: nobody got more than it (plus one unit of rounding)
            assert all(other <= got + 1 for other in alloc.values())


def test_one_client_has_no_limit_and_a_decoding_stream_gets_its_token():
    assert token_shares({"a": 500}, 64) is None
    shares = token_shares({"heavy": 500, "stream": 1}, 64)
    assert shares.left("stream") == 1 and shares.left("heavy") == 63


def test_seat_claims_take_from_the_largest_holder_down_to_an_equal_part():
    assert seat_claims(["a"] * 3, ["b"], 4) == []  # a free seat: nothing to claim
    assert seat_claims(["a"] * 4, ["b"], 4) == [(3, 0)]  # the newest of the holder
    # Two waiting clients each get a seat; a third waiting request of a client at its part claims nothing.
    claims = seat_claims(["a", "a", "a", "a", "c"], ["b", "d", "b"], 5)
    assert [position for _, position in claims] == [0, 1]
    assert all(index in (0, 1, 2, 3) for index, _ in claims)
    assert seat_claims(["a", "a", "b", "b"], ["c"], 4) == [(1, 0)]  # a tie: the first holder gives
    assert seat_claims(["a", "b", "c", "d"], ["e"], 4) == []  # everyone holds its part (one) already


def fan_out(parent: str, n: int, n_prompt: int, max_tokens: int) -> list[Request]:
    """The n children of one `n > 1` request, as the client sends them: one group."""
    return [Request(f"{i}_{parent}", [1 + k % 50 for k in range(n_prompt)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), group_id=parent) for i in range(n)]


def test_a_stream_arriving_behind_a_fan_out_that_fills_the_batch_starts_within_a_step():
    s = make_scheduler(num_blocks=256, budget=64, max_seqs=8)
    for child in fan_out("heavy", 16, 8, 40):
        s.add_request(child)
    for _ in range(3):
        step(s)
    assert len(s.running) == 8
    s.add_request(req("stream", 6, max_tokens=10, ignore_eos=True))
    so, _ = step(s)
    assert "stream" in so.req_ids  # a heavy child gave its seat back
    assert so.preempted_req_ids and all(r.endswith("_heavy") for r in so.preempted_req_ids)
    while "stream" in s.requests:
        so, _ = step(s)
        assert "stream" in so.req_ids  # a token every step, the fan-out beside it
    run_all(s)  # the fan-out finishes too, its preempted children included


def test_a_long_prompt_does_not_take_the_budget_from_a_decoding_stream():
    s = make_scheduler(num_blocks=256, budget=16, max_seqs=8)
    s.add_request(req("stream", 4, max_tokens=30, ignore_eos=True))
    step(s)
    s.add_request(req("long", 200, max_tokens=2, ignore_eos=True, base=7))
    stream_steps, long_tokens = 0, []
    while "stream" in s.requests:
        so, _ = step(s)
        assert "stream" in so.req_ids  # a token every step
        stream_steps += 1
        long_tokens.append(so.num_scheduled_tokens.get("long", 0))
    assert max(long_tokens) == 15  # the rest of the budget goes to the long prompt


def test_two_long_prompts_split_the_budget_and_a_single_client_is_plain_fcfs():
    s = make_scheduler(num_blocks=256, budget=16)
    s.add_request(req("a", 64, max_tokens=1))
    s.add_request(req("b", 64, max_tokens=1, base=9))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    s = make_scheduler(num_blocks=256, budget=16)
    for child in fan_out("p", 2, 64, 1):
        s.add_request(child)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"0_p": 16}  # one client: first come, first served
