"""gc_freeze: keep Python's garbage collector off the objects the run holds for good.

Speeds up: host-bound steps in a large process. Python's collector scans every tracked object on
each full (oldest-generation) collection; with torch, Lightning and a model library loaded that is
about half a million objects, with compiled graphs too about a million, a few hundred milliseconds per collection, landing
on whichever step allocated the object that tipped the threshold (on a host-bound step, a slow
step every so often, and noise in every measurement of it). ``gc.freeze()`` after a collection moves
every object alive now (modules, parameters, compiled code, the libraries) into a permanent
generation the collector no longer scans; what the steps allocate is still collected, by the same
thresholds, in collections that are then short. (torchtitan controls the collector too, by turning
automatic collection off and collecting every N steps; freezing keeps the collector's own schedule.)
Does not help: device-bound steps (the host waits anyway); small processes (under 100,000 tracked
objects it refuses).
Costs: a reference cycle among the objects frozen now that becomes garbage later (a model replaced
mid-fit) is kept until undo unfreezes it.
Needs: the collector enabled (not ``gc.disable()``); the tracked objects are counted outside those a
library froze already (a few hundred frozen before forking workers do not stop it).
Numerics: unchanged. Only when garbage is collected changes.

The rung changes process-global state: ``undo`` unfreezes (the objects go back to the oldest
generation), objects some library froze before it too (``gc.unfreeze`` takes no subset; they are then
scanned again, nothing else changes), and leaves the collector on or off as it found it.
"""

from __future__ import annotations

import gc

from speedkit.rungs.base import Handle, Rung
from speedkit.training.state import TrainState

#: frozen objects under which freezing cannot matter (a bare interpreter holds some tens of thousands)
MIN_OBJECTS = 100_000


def _freeze() -> None:
    gc.collect()
    gc.freeze()


class GcFreezeRung(Rung):
    name = "gc_freeze"
    # the collector's full passes, host time landing on some steps
    targets = ("host",)
    lightning_stage = "train_start"  # once the optimizer, loaders and compiled code exist: freeze those too
    cuts_host_work = True
    host_side = True

    def check(self, state: TrainState) -> str | None:
        if not gc.isenabled():
            return "Python's garbage collector is disabled (gc.disable()): no collection to shorten"
        # counted outside the frozen ones: a library may have frozen a few hundred objects before forking
        # workers (375 in the zoo's GPU runs), which leaves the million the run holds still scanned
        tracked = len(gc.get_objects())
        if tracked < MIN_OBJECTS:
            frozen = f", {gc.get_freeze_count()} more frozen already" if gc.get_freeze_count() else ""
            return f"the process tracks {tracked} objects (under {MIN_OBJECTS}){frozen}: its full collections are short already"
        return None

    def apply(self, state: TrainState) -> Handle:
        handle = Handle(self.name)
        before = gc.get_freeze_count()
        _freeze()
        earlier = f" (undo unfreezes all, the {before} frozen before it too: gc.unfreeze() takes no subset)" if before else ""
        handle.record(
            f"gc.collect(); gc.freeze(): {gc.get_freeze_count()} objects alive now left out of every later "
            f"collection (what the steps allocate is still collected){earlier}",
            gc.unfreeze,
            _freeze,
        )
        return handle
