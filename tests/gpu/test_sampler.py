"""Tests for the batched sampler: greedy exactness, seeding, the filters, and the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vx.gpu.sampler import (Sampler, apply_min_p, apply_top_k_top_p, exponential_race, greedy_token_ids,
                             inverse_cdf_sample)
from vx.gpu.sampling_metadata import SamplingMetadata, make_generator
from vx.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 64


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: dict | None = None) -> torch.Tensor:
    """Build metadata for `params` and sample one token per row."""
    md = SamplingMetadata.build(params, gens or {}, CPU)
    return Sampler()(logits, md).sampled_token_ids


def tv_distance(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Total variation between the empirical distribution of `samples` and `expected`."""
    freq = torch.bincount(samples, minlength=expected.numel()).double() / samples.numel()
    return 0.5 * (freq - expected.double()).abs().sum().item()


@pytest.fixture(autouse=True)
def _seed_default_generator():
    torch.manual_seed(1234)


# ------------------------------------------------------------------ metadata
def test_build_leaves_unused_features_none():
    md = SamplingMetadata.build([SamplingParams(), SamplingParams(temperature=0.5)], {}, CPU)
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.all_random and not md.all_greedy
    assert md.temperature.dtype == torch.float32 and md.temperature.tolist() == [1.0, 0.5]


def test_build_greedy_rows_are_neutral_and_drop_generators():
    params = [
        SamplingParams(temperature=0.0, top_p=0.5, min_p=0.3, seed=1),  # greedy: switches nothing on
        SamplingParams(top_k=1),  # greedy via top_k
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, seed=2, logprobs=3),
    ]
    gens = {0: make_generator(1, CPU), 2: make_generator(2, CPU)}
    md = SamplingMetadata.build(params, gens, CPU)
    assert not md.all_greedy and not md.all_random
    assert md.temperature.tolist() == pytest.approx([0.0, 0.0, 0.8])
    assert md.top_k.tolist() == [0, 0, 5]
    assert md.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert set(md.generators) == {2} and md.max_num_logprobs == 3

    only_greedy_filters = SamplingMetadata.build([SamplingParams(temperature=0, top_k=3, top_p=0.5)], {}, CPU)
    assert only_greedy_filters.all_greedy and only_greedy_filters.top_k is None
    assert only_greedy_filters.top_p is None


def test_make_generator_accepts_negative_seeds_and_is_reproducible():
    a = torch.empty(8).exponential_(generator=make_generator(-5, CPU))
    b = torch.empty(8).exponential_(generator=make_generator(-5, CPU))
    c = torch.empty(8).exponential_(generator=make_generator(5, CPU))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_empty_batch():
    assert sample(torch.empty(0, V), []).shape == (0,)


# ------------------------------------------------------------------ greedy
def test_greedy_rows_equal_argmax_and_logits_untouched():
    logits = torch.randn(7, V)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 7)
    assert torch.equal(out, logits.argmax(-1)) and out.dtype == torch.int64
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_of_low_precision_logits_take_the_first_of_equal_maxima(dtype):
    """Greedy rows read bf16/fp16 logits as they are (no float32 copy): the same token as the float32 argmax, the
    first one where maxima tie (a low-precision vocabulary row often has ties)."""
    logits = torch.randn(9, V).to(dtype)
    logits[0, 3] = logits[0, 11] = logits[0].max() + 1  # a tie: the first wins
    out = sample(logits, [SamplingParams(temperature=0.0)] * 9)
    assert torch.equal(out, logits.float().argmax(-1)) and out[0] == 3
    assert torch.equal(greedy_token_ids(logits), logits.float().argmax(-1))


def test_top_k_1_equals_argmax_also_through_the_random_path():
    logits = torch.randn(16, V)
    assert torch.equal(sample(logits, [SamplingParams(top_k=1)] * 16), logits.argmax(-1))
    # Bypass SamplingParams.greedy: top_k=1 as a filter on a random row must give the argmax as well.
    md = SamplingMetadata(
        temperature=torch.full((16,), 1.0), all_greedy=False, all_random=True, top_k=torch.ones(16, dtype=torch.long)
    )
    for _ in range(5):
        assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = torch.randn(12, V) * 0.1  # flat logits: random rows would rarely hit the argmax by chance
    params = [SamplingParams(temperature=0.0) if i % 3 == 0 else SamplingParams(top_p=0.95, min_p=0.01)
              for i in range(12)]
    greedy_rows = torch.arange(0, 12, 3)
    hits_random = 0
    for _ in range(10):
        out = sample(logits, params)
        assert torch.equal(out[greedy_rows], logits.argmax(-1)[greedy_rows])
        hits_random += int((out != logits.argmax(-1)).sum())
    assert hits_random > 0  # the random rows really sampled


# ------------------------------------------------------------------ seeding
def _seeded_run(batch: list[tuple[SamplingParams, int | None]], row_logits: list[torch.Tensor], steps: int):
    """Sample `steps` steps with one generator per seeded row, carried across steps; returns [steps, B]."""
    gens = {i: make_generator(s, CPU) for i, (_, s) in enumerate(batch) if s is not None}
    logits = torch.stack(row_logits)
    params = [p for p, _ in batch]
    return torch.stack([sample(logits, params, gens) for _ in range(steps)])


def test_seeded_row_is_independent_of_batch_composition():
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(V, generator=g)
    target = SamplingParams(temperature=1.3, top_k=40, top_p=0.9, seed=77)
    steps = 8
    alone = _seeded_run([(target, 77)], [target_logits], steps)[:, 0]

    others = [torch.randn(V, generator=g) for _ in range(4)]
    batch = [
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=0.7, seed=5), 5),
        (SamplingParams(min_p=0.05), None),
        (target, 77),
        (SamplingParams(top_k=3), None),
    ]
    mixed = _seeded_run(batch, others[:3] + [target_logits] + others[3:], steps)[:, 3]
    assert torch.equal(alone, mixed)
    assert len(set(alone.tolist())) > 1  # several distinct tokens: the generator state really advanced

    different_seed = _seeded_run([(target.clone(seed=78), 78)], [target_logits], steps)[:, 0]
    assert not torch.equal(alone, different_seed)


# ------------------------------------------------------------------ filters
def test_top_k_never_samples_outside_top_k():
    logits = torch.randn(4000, V)
    k = 5
    out = sample(logits, [SamplingParams(top_k=k)] * 4000)
    top = logits.topk(k, dim=-1).indices
    assert (top == out.unsqueeze(1)).any(-1).all()


def test_top_p_keeps_only_the_nucleus():
    # softmax: top two hold ~0.93 > top_p, the third would be needed only for p > 0.93.
    row = torch.tensor([4.0, 3.5, 1.0, 0.5, 0.0, -1.0])
    probs = row.softmax(-1)
    assert probs[:2].sum() > 0.9 > probs[0]
    out = sample(row.expand(5000, -1).clone(), [SamplingParams(top_p=0.9)] * 5000)
    assert set(out.tolist()) == {0, 1}
    expected = torch.zeros(6)
    expected[:2] = probs[:2] / probs[:2].sum()
    assert tv_distance(out, expected) < 0.03


def test_top_p_smaller_than_top_prob_keeps_only_top():
    row = torch.tensor([2.0, 1.0, 0.0])
    out = sample(row.expand(2000, -1).clone(), [SamplingParams(top_p=0.1)] * 2000)
    assert set(out.tolist()) == {0}


def test_min_p_drops_tokens_below_fraction_of_max():
    row = torch.tensor([3.0, 2.5, 1.0, 0.0, -2.0])
    probs = row.softmax(-1)
    min_p = 0.3  # keeps tokens with prob >= 0.3 * p_max: 0 and 1 only (p1/p0 = e^-0.5 = 0.61, p2/p0 = e^-2)
    out = sample(row.expand(5000, -1).clone(), [SamplingParams(min_p=min_p)] * 5000)
    assert set(out.tolist()) == {0, 1}
    expected = torch.zeros(5)
    expected[:2] = probs[:2] / probs[:2].sum()
    assert tv_distance(out, expected) < 0.03


def _kept_reference(row: list[float], k: int, p: float, slack: float) -> set[int]:
    """Tokens top-k then top-p keeps, computed in float64; `slack` widens p to absorb float32 rounding."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if k > 0:
        order = order[:k]
    m = max(row[i] for i in order)
    w = [math.exp(row[i] - m) for i in order]
    total, cum, kept = sum(w), 0.0, set()
    for i, wi in zip(order, w):
        kept.add(i)
        cum += wi / total
        if cum >= p + slack:
            break
    return kept


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(-20, 20), min_size=8, max_size=8, unique=True), min_size=1, max_size=6),
    k=st.integers(0, 10),
    p=st.floats(0.05, 1.0),
)
def test_top_k_top_p_mask_matches_reference(rows, k, p):
    # Unique integer logits (scaled) so there are no ties at the top-k cut.
    logits = torch.tensor(rows, dtype=torch.float32) * 0.37
    n = logits.shape[0]
    out = apply_top_k_top_p(logits.clone(), torch.full((n,), k), torch.full((n,), p))
    for r in range(n):
        kept = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        vals = logits[r].double().tolist()
        assert _kept_reference(vals, k, p, -1e-5) <= kept <= _kept_reference(vals, k, p, 1e-5)
        assert int(logits[r].argmax()) in kept
        assert torch.equal(out[r][list(kept)], logits[r][list(kept)])  # kept logits unchanged, in vocab order


def test_apply_min_p_zero_keeps_everything():
    probs = torch.softmax(torch.randn(3, V), -1)
    assert torch.equal(apply_min_p(probs.clone(), torch.zeros(3)), probs)


# ------------------------------------------------------------------ distribution
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    row = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    n = 20_000
    out = sample(row.expand(n, -1).clone(), [SamplingParams(temperature=temperature)] * n)
    assert tv_distance(out, (row / temperature).softmax(-1)) < 0.02


def test_top_k_frequencies_are_renormalised():
    row = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    n = 20_000
    out = sample(row.expand(n, -1).clone(), [SamplingParams(top_k=3, temperature=0.8)] * n)
    expected = (row / 0.8).softmax(-1)
    expected[[2, 4]] = 0.0  # the two lowest logits
    assert tv_distance(out, expected / expected.sum()) < 0.02


@pytest.mark.parametrize("draw", [exponential_race, inverse_cdf_sample])
def test_draws_follow_unnormalised_weights_and_never_pick_zero_mass(draw):
    w = torch.tensor([0.0, 1.0, 3.0, 0.0, 6.0, 0.0])
    out = draw(w.expand(20_000, -1).clone(), {})
    assert tv_distance(out, w / w.sum()) < 0.02
    assert not torch.isin(out, torch.tensor([0, 3, 5])).any()


def test_inverse_cdf_seeded_row_ignores_its_batch():
    w = torch.rand(4, 50)
    alone = inverse_cdf_sample(w[2:3].clone(), {0: torch.Generator().manual_seed(7)})
    batched = inverse_cdf_sample(w.clone(), {2: torch.Generator().manual_seed(7)})
    assert batched[2] == alone[0]


# ------------------------------------------------------------------ extremes
def test_tiny_temperature_behaves_like_greedy_without_nan():
    logits = torch.randn(32, V) * 1000.0  # large logits: logits / T far beyond exp's range
    params = [SamplingParams(temperature=1e-4, top_p=0.9, top_k=10, min_p=0.1)] * 16
    params += [SamplingParams(temperature=2e-5)] * 16
    for _ in range(3):
        assert torch.equal(sample(logits, params), logits.argmax(-1))
    # Below the greedy cut-off (metadata made by hand, bypassing SamplingParams): treated as greedy, no 0-division.
    md = SamplingMetadata(temperature=torch.full((32,), 1e-7), all_greedy=False, all_random=False)
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=3.0),
        SamplingParams(top_k=50),  # more than the finite entries
        SamplingParams(top_p=0.999, temperature=5.0),
        SamplingParams(min_p=1e-6, temperature=10.0),
    ],
)
def test_neg_inf_logits_never_sampled(params):
    n = 2000
    logits = torch.zeros(n, V)
    allowed = torch.tensor([3, 17, 40])
    mask = torch.ones(V, dtype=torch.bool)
    mask[allowed] = False
    logits[:, mask] = float("-inf")
    out = sample(logits, [params] * n)
    assert torch.isin(out, allowed).all()
    assert len(set(out.tolist())) == 3
