"""The engine's heap freezer: survivors of start-up leave the collector's full passes, and an idle engine freezes
again only once the heap has grown."""

from __future__ import annotations

import gc

import pytest

from vx.core.heap_freezer import HeapFreezer


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the test process's heap goes back to the collector as it was


def test_freeze_moves_survivors_out_of_the_oldest_generation(unfrozen):
    kept = [[i] for i in range(1000)]
    HeapFreezer().freeze()
    assert gc.get_freeze_count() >= len(kept)
    assert len(gc.get_objects(generation=2)) < len(kept)
    gc.collect()
    assert all(k == [i] for i, k in enumerate(kept))  # frozen is alive, not freed


def test_freeze_if_grown_waits_for_growth(unfrozen):
    freezer = HeapFreezer(refreeze_growth=5000)
    freezer.freeze()
    few = [[i] for i in range(100)]
    gc.collect()  # survivors reach the oldest generation
    assert not freezer.freeze_if_grown()
    many = [[i] for i in range(10_000)]
    gc.collect()
    frozen = gc.get_freeze_count()
    assert freezer.freeze_if_grown()
    assert gc.get_freeze_count() >= frozen + len(many) + len(few)
    assert len(gc.get_objects(generation=2)) < 5000
