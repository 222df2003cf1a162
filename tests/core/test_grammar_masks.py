"""Next-token masks off the step: a costly grammar slows only its own request, is refused at compile when a sample
shows it, and is failed when its masks keep missing the budget while it runs."""

from __future__ import annotations

import time

import numpy as np
import pytest
from tests.core.test_structured_output import EOS, REGEX, _manager, _scheduler
from tests.support.worker_view import WorkerView

import vx
from vx.core.grammar_masks import MAX_SLOW_MASKS, MaskFiller, allowed_tokens, time_fills
from vx.core.request import Request
from vx.core.structured_output import GrammarError
from vx.sampling_params import StructuredOutputsParams as SO
from vx.step import ModelRunnerOutput

BUDGET_S = 0.05


def test_allowed_tokens_reads_the_bits_of_a_row():
    row = np.zeros(2, dtype=np.int32)
    row.view(np.uint32)[0] = (1 << 0) | (1 << 5) | (1 << 31)
    row.view(np.uint32)[1] = 1 << 2
    assert allowed_tokens(row).tolist() == [0, 5, 31, 34]


def test_the_filler_waits_at_most_its_budget_and_tells_slow_fills():
    filler = MaskFiller(workers=1, budget_s=BUDGET_S)
    quick = filler.start(lambda: np.zeros(1, np.int32), slow=False)
    slow = filler.start(lambda: (time.sleep(0.5), np.zeros(1, np.int32))[1], slow=True)
    t0 = time.monotonic()
    filler.wait([quick, slow])
    assert time.monotonic() - t0 < 0.4 and quick.done() and not slow.done()
    assert not filler.is_slow(quick, time.monotonic())
    time.sleep(0.1)
    assert filler.is_slow(slow, time.monotonic())  # still running, past the budget
    filler.shutdown()


def test_time_fills_walks_a_path_through_the_grammar(tiny_model_dir):
    import xgrammar as xgr

    mgr = _manager(tiny_model_dir)
    compiled = mgr._get_compiler().compile_regex("[a-c]{3}")
    visited = []

    def fill(matcher):
        visited.append(matcher)
        return mgr._fill_row(matcher)

    matcher = xgr.GrammarMatcher(compiled)
    assert time_fills(matcher, fill, steps=10) < 1.0
    # Three letters (in one to three tokens), then the stop token: no fill once the grammar terminated.
    assert matcher.is_terminated() and 2 <= len(visited) <= 4
    mgr.shutdown()


def _slowed(mgr, seconds: float):
    """Make every mask fill of `mgr` take `seconds` longer (compile samples included)."""
    fill = mgr._fill_row

    def slow_fill(matcher, json_text=False):
        time.sleep(seconds)
        return fill(matcher, json_text)

    mgr._fill_row = slow_fill


def test_a_grammar_whose_sampled_masks_miss_the_budget_is_refused_at_compile(tiny_model_dir):
    mgr = _manager(tiny_model_dir, mask_budget_s=BUDGET_S)
    _slowed(mgr, 2 * BUDGET_S)
    with pytest.raises(GrammarError, match=r"structured_outputs.regex is too costly to follow: .* budget of 0.05 s"):
        mgr._compile(("regex", REGEX))
    mgr.shutdown()


def test_a_slow_grammar_at_run_time_slows_only_its_request_and_is_failed(tiny_model_dir):
    mgr = _manager(tiny_model_dir, mask_budget_s=BUDGET_S)
    s = _scheduler(mgr)
    s.add_request(Request("slow", [5, 6, 7], vx.SamplingParams(
        max_tokens=50, ignore_eos=True, structured_outputs=SO(regex="[a-z]{200}")), [EOS]))
    s.add_request(Request("free", [5, 6, 7], vx.SamplingParams(max_tokens=1000, ignore_eos=True), [EOS]))
    view = WorkerView()
    deadline = time.monotonic() + 30
    while not mgr.is_ready("slow"):  # compiled (timed at full speed), first mask filled
        mgr.update()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _slowed(mgr, 0.4)  # from now on, every mask of "slow" takes 8x the budget
    steps, errors, slow_tokens = [], [], 0
    while "slow" in s.requests:
        assert time.monotonic() < deadline
        t0 = time.monotonic()
        so = view.apply(s.schedule())
        steps.append(time.monotonic() - t0)
        sampled = [r.req_id for r in so.scheduled if r.samples]
        assert "free" in sampled  # a token every step, whatever the slow grammar does
        grammar_rows = dict(zip(so.output.grammar_req_ids, so.output.grammar_bitmask
                                if so.output.grammar_bitmask is not None else []))
        tokens = [int(allowed_tokens(grammar_rows[rid])[-1]) if rid in grammar_rows else 9 for rid in sampled]
        slow_tokens += sampled.count("slow")
        time.sleep(0.01)  # the forward pass
        errors += s.update_from_output(so.output, ModelRunnerOutput(sampled, tokens)).input_errors
    assert max(steps) < 0.2  # no step waited for a slow mask past the budget
    assert 1 <= slow_tokens <= MAX_SLOW_MASKS  # it kept going, a token whenever its mask was ready
    assert [e.request_id for e in errors] == ["slow"] and not errors[0].internal
    assert f"{MAX_SLOW_MASKS} of its next-token masks took longer than the engine's budget" in errors[0].message
    assert mgr.num_requests == 0
    mgr.shutdown()
