"""The ladder's stack of rungs: each kept (or candidate) rung in a slot, in the ladder's order, and
switching a configuration of them on and off (:class:`Stack`), the slots above a changed one switched
off and on again on top of it (rebased); :class:`RungProblem`, a rung's report that its change stopped working.
"""

from __future__ import annotations

from typing import Any

from speedkit import distributed
from speedkit.handle import Handle
from speedkit.results import RungResult
from speedkit.rungs.base import Rung
from speedkit.training.state import TrainState


class RungProblem(Exception):
    """A rung's own report that its change stopped working (e.g. compile fell back to eager)."""


def agreed_check(rung: Rung, state: TrainState) -> str | None:
    """``rung.check`` on every rank: it applies only where it applies on every rank (DDP); else the
    reason of the first rank where it does not (its own reason on that rank). A check that raises
    on one rank raises on every rank. One process: the rung's own check."""
    with distributed.together():
        reason = rung.check(state)
    return distributed.first_said(reason)


def agreed_apply(rung: Rung, state: TrainState) -> Handle:
    """``rung.apply`` on every rank; where it raised on any rank, undone where it applied and raised
    on every rank (:func:`speedkit.distributed.together`)."""
    handle: Handle | None = None
    try:
        with distributed.together():
            handle = rung.apply(state)
    except Exception:
        if handle is not None:
            handle.undo()
        raise
    assert handle is not None
    handle.traced = rung.recompiles  # a compiled forward above it traces anew per configuration of such changes
    return handle


def agreed_problem(handle: Handle) -> str | None:
    """A rung's report that its change stopped working (``handle.problem()``), where it says so on
    any rank: every rank then takes it for a failure alike."""
    return distributed.first_said(handle.problem())


class Slot:
    """A kept (or candidate) rung in the stack, switched off and on through its handle: suspended
    and resumed when the handle can redo its changes, else undone and applied again."""

    def __init__(self, rung: Rung, handle: Handle, below: tuple[bool, ...]) -> None:
        self.rung, self.handle = rung, handle
        #: which slots beneath it were on when it was last switched on (applied on top of them)
        self.below = below

    @property
    def on(self) -> bool:
        return self.handle is not None and self.handle.active and not self.handle.suspended

    def disable(self) -> None:
        if not self.on:
            return
        if self.handle.toggleable:
            self.handle.suspend()
        else:
            self.handle.undo()

    def enable(self, state: TrainState) -> None:
        if self.on:
            return
        if self.handle.active and self.handle.suspended:
            self.handle.resume()
            return
        reason = agreed_check(self.rung, state)
        if reason is not None:
            raise RuntimeError(f"{self.rung.name} no longer applies: {reason}")
        self.handle = agreed_apply(self.rung, state)

    def undo(self) -> None:
        self.handle.undo()

    def rewrite_report(self) -> dict[str, Any] | None:
        """What its rung rewrote in the model's source and left alone, as plain data; None for a rung
        that rewrites none."""
        return self.handle.rewrite.as_dict() if self.handle.rewrite is not None else None


class Stack:
    """The slots of the rungs on ``state``, bottom first, and the configuration they are in.

    Args:
        state: the training objects the rungs change.
        order: the ladder's rungs, in its order: where a rung goes among the kept ones.
    """

    def __init__(self, state: TrainState, order: list[Rung]) -> None:
        self.state = state
        self.order = {r.name: i for i, r in enumerate(order)}
        self.slots: list[Slot] = []
        self._settle_needed = 0  # untimed steps a rebased rung asks for after the next switch

    @property
    def handles(self) -> list[Handle]:
        return [s.handle for s in self.slots]

    def names(self) -> list[str]:
        return [s.rung.name for s in self.slots]

    def place(self, rung: Rung) -> int:
        """Where ``rung`` goes among the kept rungs: after those before it in the ladder's order."""
        return sum(self.order.get(s.rung.name, -1) < self.order[rung.name] for s in self.slots)

    def insert(self, place: int, rung: Rung, below: tuple[bool, ...]) -> Slot:
        """Apply ``rung`` on the configuration in effect and put its slot at ``place``."""
        slot = Slot(rung, agreed_apply(rung, self.state), below)
        self.slots.insert(place, slot)
        return slot

    def check_at_place(self, rung: Rung) -> str | None:
        """Whether ``rung`` applies where it would go (:meth:`place`): the kept rungs after its place
        switched off, as its trial and its insertion run it, and left so; why not, or None. A rung may
        not apply on top of a kept rung and apply beneath it (a fused LM head beneath compile)."""
        place = self.place(rung)
        self.configure([i < place for i in range(len(self.slots))])
        return agreed_check(rung, self.state)

    def insert_at_place(self, rung: Rung) -> int:
        """Put ``rung`` in at its place among the kept rungs, applied on those before it in the ladder's
        order (the rungs after it off), once it says again that it applies there; returns the place.
        Raises :class:`RungProblem` where it no longer applies. The slots after it stay off."""
        place = self.place(rung)
        reason = self.check_at_place(rung)
        if reason is not None:
            raise RungProblem(f"{rung.name} no longer applies: {reason}")
        self.insert(place, rung, (True,) * place)
        return place

    def dependents(self, j: int) -> list[int]:
        """The slots above ``j`` that cannot work without it (``Rung.requires``), directly or through
        another of them, bottom first."""
        out: list[int] = []
        gone = {self.slots[j].rung.name}
        for i in range(j + 1, len(self.slots)):
            if gone & set(self.slots[i].rung.requires):
                out.append(i)
                gone.add(self.slots[i].rung.name)
        return out

    def with_requirements(self, mask: list[bool]) -> list[bool]:
        """``mask`` with every slot off whose required rung (``Rung.requires``) is in the stack beneath
        it and off: a CUDA graph switched on above the sync explicit_mask removes would stop for good."""
        mask = list(mask)
        for i, slot in enumerate(self.slots):
            if mask[i] and any(not mask[j] and self.slots[j].rung.name in slot.rung.requires for j in range(i)):
                mask[i] = False
        return mask

    def configure(self, mask: list[bool]) -> None:
        """Switch the kept rungs to ``mask`` (on/off per slot; a slot whose required rung is off is off
        too: :meth:`with_requirements`), touching only the slots from the first that changes upward
        (rungs above it may depend on it)."""
        mask = self.with_requirements(mask)
        current = [s.on for s in self.slots]
        if current == mask:
            return
        first = next(i for i, (c, m) in enumerate(zip(current, mask)) if c != m)
        for slot in reversed(self.slots[first:]):
            slot.disable()
        for i in range(first, len(self.slots)):
            slot = self.slots[i]
            if not mask[i]:
                continue
            slot.enable(self.state)
            below = tuple(mask[:i])
            if slot.below != below:  # what it wraps changed beneath it while it was off
                slot.handle.rebase()
                self._settle_needed = max(self._settle_needed, slot.handle.settle_steps)
            slot.below = below

    def all_on(self) -> None:
        self.configure([True] * len(self.slots))

    def settle(self, configured: int) -> int:
        """Untimed steps after switching configuration: ``configured``, or more where a rung that was
        rebased needs them (and forget that need)."""
        steps, self._settle_needed = max(configured, self._settle_needed), 0
        return steps

    def remove(self, j: int) -> list[str]:
        """Undo the rung of slot ``j`` and those that cannot work without it (:meth:`dependents`), the
        slots above switched back on without them (rebased). Returns the names of those dependents."""
        gone = [j, *self.dependents(j)]
        names = [self.slots[i].rung.name for i in gone[1:]]
        self.configure([i not in gone for i in range(len(self.slots))])
        for k in reversed(gone):
            self.slots.pop(k).undo()
            for above in self.slots[k:]:  # what they were applied on no longer has slot k
                above.below = above.below[:k] + above.below[k + 1 :]
        return names

    def drop(self, added: list[Slot]) -> None:
        """Undo candidate slots appended above the kept ones (they were applied with those off)."""
        for slot in reversed(added):
            if slot in self.slots:
                slot.disable()
                self.slots.remove(slot)
                slot.undo()

    def revert(self) -> None:
        """Undo every kept rung, last first."""
        while self.slots:
            self.slots.pop().undo()

    def undo_all(self) -> None:
        """Undo every kept rung, last first, going on past one whose undo raises: nothing of the trials
        may stay on the user's model (an interrupted run, a cached decision that did not hold)."""
        for slot in self.slots[::-1]:
            try:
                slot.undo()
            except Exception:  # keep undoing the rest
                pass
        self.slots = []

    def shares_batches(self) -> bool:
        """Whether the kept rungs may be timed on batches an A/B block shares (none of them does work
        per new input shape)."""
        return not any(s.rung.new_shape_cost for s in self.slots)


def kept_entry(slot: Slot, precision: str, reason: str, **figures: Any) -> RungResult:
    """The report's row of a rung kept in ``slot``: what it changed (its handle's changes and report),
    its rewrite's report, ``reason`` and ``figures`` (parity, comparison, gains)."""
    return RungResult(
        slot.rung.name,
        "kept",
        options=slot.rung.options_dict(),
        precision=precision,
        changes=list(slot.handle.changes) + slot.handle.report(),
        rewrite=slot.rewrite_report(),
        reason=reason,
        **figures,
    )
