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
    assert rung.check(state) is not None  # frozen already
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
