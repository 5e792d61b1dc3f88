"""gc_freeze: the objects alive at apply leave the collector's passes; undo puts them back; it says why not."""

from __future__ import annotations

import gc

import pytest

from speedkit import rungs
from speedkit.rungs import gc_freeze


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


def test_freezes_what_is_alive_toggles_and_undoes(unfrozen, monkeypatch):
    from conftest import mlp_state

    state = mlp_state()
    monkeypatch.setattr(gc_freeze, "MIN_OBJECTS", 0)
    rung = rungs.make("gc_freeze")
    assert rung.check(state) is None and rung.cuts_host_work
    handle = rung.apply(state)
    frozen = gc.get_freeze_count()
    assert frozen > 0 and gc.isenabled() and "objects alive now" in handle.changes[0]
    garbage = [[]]
    garbage[0].append(garbage)  # a cycle made after the freeze is still collected
    del garbage
    assert gc.collect() >= 1
    monkeypatch.setattr(gc_freeze, "MIN_OBJECTS", 10_000)
    assert "more frozen already" in rung.check(state)  # what is left outside the frozen ones is small now
    handle.suspend()
    assert gc.get_freeze_count() == 0
    handle.resume()
    assert gc.get_freeze_count() > 0
    handle.undo()
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_says_why_not(unfrozen):
    from conftest import mlp_state

    state = mlp_state()
    rung = rungs.make("gc_freeze")
    gc.disable()
    assert "disabled" in rung.check(state)
    gc.enable()
    small = gc_freeze.MIN_OBJECTS
    try:
        gc_freeze.MIN_OBJECTS = 10**9
        assert "objects (under" in rung.check(state)
    finally:
        gc_freeze.MIN_OBJECTS = small


def test_a_few_objects_frozen_by_a_library_do_not_stop_it(unfrozen, monkeypatch):
    """A library froze a few hundred objects before forking its workers (375 in the zoo's GPU runs): the
    million the run holds are still scanned, so the rung applies, and says its undo unfreezes those too."""
    from conftest import mlp_state

    state = mlp_state()
    gc.freeze()  # what is alive now stands for the library's few
    held = [[] for _ in range(5000)]  # what the run holds after it (tracked, not frozen)
    monkeypatch.setattr(gc_freeze, "MIN_OBJECTS", 1000)
    rung = rungs.make("gc_freeze")
    assert rung.check(state) is None
    handle = rung.apply(state)
    assert "frozen before it too" in handle.changes[0]
    assert len(gc.get_objects()) < len(held)  # the run's objects are frozen now
    handle.undo()
    assert gc.get_freeze_count() == 0
