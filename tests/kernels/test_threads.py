"""When a kernel call wakes the OpenMP team: only when its single-thread time pays for the wake-up."""

from __future__ import annotations

import pytest
import torch

from vx.kernels import threads
from vx.kernels.quant_matmul import serial_us


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("policy,spins,wake_us", [("PASSIVE", None, 80.0), ("passive", "0", 80.0),
                                                  ("PASSIVE", "100000", 5.0), ("ACTIVE", None, 5.0),
                                                  (None, None, 5.0)])
def test_the_wake_up_cost_follows_the_wait_policy(monkeypatch, policy, spins, wake_us):
    """Threads that sleep at once cost a call a wake-up; ones that spin a while (vx's default) barely any."""
    threads.wake_cost_us.cache_clear()
    if spins is None:
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    else:
        monkeypatch.setenv("GOMP_SPINCOUNT", spins)
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    try:
        assert threads.wake_cost_us() == wake_us
        assert threads.min_parallel_us(2) == 2 * wake_us  # serial / 2 + wake < serial
        assert threads.min_parallel_us(4) == pytest.approx(wake_us * 4 / 3)
        assert threads.min_parallel_us(1) == float("inf")
    finally:
        threads.wake_cost_us.cache_clear()


def test_small_calls_stay_on_the_calling_thread(monkeypatch, two_threads):
    monkeypatch.setattr(threads, "wake_cost_us", lambda: 80.0)
    assert threads.threads_for(159.0) == 1
    assert threads.threads_for(160.0) == 2


def test_the_default_models_layers_run_serially_at_batch_1_and_its_lm_head_in_parallel(monkeypatch, two_threads):
    """Measured on the default model's shapes with sleeping threads (benchmarks.quant_matmul --threads 1 vs 2)."""
    monkeypatch.setattr(threads, "wake_cost_us", lambda: 80.0)
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        assert threads.threads_for(serial_us(1, n, k)) == 1
    assert threads.threads_for(serial_us(1, 49152, 576)) == 2
    assert threads.threads_for(serial_us(32, 3072, 576)) == 2
