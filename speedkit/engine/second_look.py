"""The ladder's second look: the rungs reverted on speed (or rejected on numerics under another
precision, or failed beneath other rungs or without the rungs they need) judged again on the final
configuration, with the rungs they need and their partners, alone, and together with the others
leaning faster, pass after pass until a pass keeps nothing; and a group kept together judged member
by member (:func:`leave_one_out`), so that nothing rides along that slows the step. Verbs of the
ladder's policy, taking the :class:`~speedkit.engine.trials.Trials` (the ladder).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speedkit.engine import comparison
from speedkit.engine.comparison import compare, record
from speedkit.engine.stack import RungProblem, agreed_problem
from speedkit.errors import first_line
from speedkit.measure.stats import describe
from speedkit.results import Parity, RungResult
from speedkit.rungs.base import Rung

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials


def second_look(ladder: Trials, reference: list[float]) -> list[float]:
    """Judge the rungs reverted on speed again, on the final configuration, pass after pass until
    a pass keeps none (``together_passes`` at most): a rung whose gain was hidden in the noise of
    the step in front of it (fused_optimizer on a host-bound eager step) or that pays only with
    rungs kept after it. Each goes in at its place in the ladder, beneath the kept rungs after it
    (switched off, then on again on top of it, rebased), and is judged against the final
    configuration without it, in the order of :func:`second_look_groups`: a rung with the
    partners it names (bf16 with channels_last and compile on a convnet), each rung alone (the
    likeliest to pay first), and the rungs still undecided but leaning faster, all together.
    A group of the first pass gets all the rungs' time left for its comparison (where small gains add
    up, they are what that time is best spent on); once the rungs' share of the trials' budget is
    spent, the rest is skipped and the report says so. A configuration already judged is not
    judged again."""
    for n in range(ladder.cfg.together_passes):
        changed, skipped = False, False
        for group in second_look_groups(ladder):
            key = (tuple(r.name for r in group), tuple(s.rung.name for s in ladder.slots))
            if key in ladder.judged or not all(worth_another_look(ladder, r) for r in group):
                continue  # judged on this configuration already, or kept since in this pass
            if ladder.budget.spent():
                skipped = True
                continue
            ladder.judged.add(key)
            # a group of the first pass: its likeliest gains, judged once with the rungs' whole time left
            # (at the minimum of blocks, Lightning's demo Transformer's rungs leaning faster measured
            # 1.53x [0.24, 9.58] together over 2 blocks and were reverted)
            kept, reference = look_again(ladder, group, reference, whole_budget=n == 0 and len(group) > 1)
            if kept and len(group) > 1:
                leave_one_out(ladder, [r.name for r in group])
            changed = changed or kept
        if skipped:
            ladder.note_budget("second look" if n == 0 and not changed else "second look (the rest)")
            break
        if not changed:
            break
    return reference


def worth_another_look(ladder: Trials, rung: Rung) -> bool:
    """Worth another look: measured and reverted for not paying (undecided or slower), or rejected
    on numerics under another precision than the final configuration's (channels_last against an
    fp32 envelope, before bf16 was kept), or failed in the climb beneath other kept rungs than the
    final configuration's (cuda_graph refused for a sync in eager code that the compiled step does
    not make: transformers' check whether a padding mask is all ones), and not kept since."""
    entry = ladder.entry(rung.name)
    if entry is None or any(s.rung is rung for s in ladder.slots):
        return False
    if entry.status == "failed":
        beneath = ladder.failed_beneath.get(rung.name)
        return beneath is not None and (beneath != tuple(s.rung.name for s in ladder.slots) or bool(missing_needs(ladder, rung)))
    if entry.status != "reverted":
        return False
    if entry.comparison is not None:
        return True
    parity = entry.parity  # a rewrite is judged at full precision anyway: its function differs
    return (
        parity is not None
        and not parity.passed
        and parity.precision != ladder.state.precision
        and not rung.judged_at_full_precision
    )


def missing_needs(ladder: Trials, rung: Rung) -> list[Rung]:
    """The rungs ``rung`` needs in effect (``Rung.needs``) that are in the ladder, were tried and are
    not kept (reverted as undecided, say): undecided is not no, so it is tried again with them."""
    kept = {s.rung.name for s in ladder.slots}
    out = []
    for need in ladder.rungs:
        if need.name in rung.needs and need.name not in kept:
            entry = ladder.entry(need.name)
            if entry is not None and entry.status in ("reverted", "failed"):
                out.append(need)
    return out


def second_look_groups(ladder: Trials) -> list[list[Rung]]:
    """Each rung with the rungs it needs that are not kept (cuda_graph with explicit_mask reverted as
    undecided before it); each rung reverted on speed with the partners it names that were reverted
    too; then, while
    the trials' budget lasts, each rung alone, the highest point estimate first (a rung rejected on
    numerics under another precision, never timed, counts as even); then all those still
    undecided with a gain in their point estimate together: small gains (2-3% each on a noisy
    host-bound step) that no comparison of one could tell from the noise add up to one it can.
    Alone first, so that a rung judged on its own is not kept on another's gain (fused AdamW's
    3% riding on compile's 19% in a group); with the budget spent the singles are skipped and
    the groups still judged."""
    candidates = [r for r in ladder.rungs if worth_another_look(ladder, r)]
    groups: list[list[Rung]] = []
    for rung in candidates:
        needed = missing_needs(ladder, rung)
        if needed:
            group = sorted({id(r): r for r in [rung, *needed]}.values(), key=ladder.rungs.index)
            if group not in groups:
                groups.append(group)
    for rung in candidates:
        partners = [p for p in candidates if p.name in rung.partners]
        if partners:
            group = sorted([rung, *partners], key=ladder.rungs.index)
            if group not in groups:
                groups.append(group)

    def estimate(rung: Rung) -> float:
        paired = ladder.last_comparison.get(rung.name)
        return paired.speedup if paired is not None else 1.0

    groups += [[r] for r in sorted(candidates, key=estimate, reverse=True)]
    leaning = [r for r in candidates if leans_faster(ladder, r)]
    if len(leaning) > 1 and leaning not in groups:
        groups.append(leaning)
    return groups


def leans_faster(ladder: Trials, rung: Rung) -> bool:
    """Undecided in its last comparison, with a point estimate that clears the minimum gain: a rung
    measured under it would not be kept were its estimate exact (on an H200 a ResNet-50's
    cudnn_benchmark, 1.002x, joined the leaning group in one run of three and rode along in it,
    its leave-one-out undecided)."""
    paired = ladder.last_comparison.get(rung.name)
    return paired is not None and paired.verdict == "undecided" and paired.speedup > 1.0 + ladder.cfg.min_gain


def look_again(ladder: Trials, group: list[Rung], reference: list[float], whole_budget: bool = False) -> tuple[bool, list[float]]:
    """Apply ``group`` at its places in the final configuration and judge it against that
    configuration without it (``whole_budget``: see :meth:`speedkit.engine.ladder.Ladder.compare`); keep it if it pays. Returns
    whether it was kept, and the reference trajectory from then on."""
    result = ladder.result
    assert result is not None
    order = {rung.name: i for i, rung in enumerate(ladder.rungs)}
    entries = [ladder.entry(r.name) for r in group]
    first = min(order[r.name] for r in group)
    above = [s.rung.name for s in ladder.slots if order[s.rung.name] > first]
    where = (
        f"beneath {', '.join(above)}"
        if above
        else f"on top of {', '.join(s.rung.name for s in ladder.slots)}"
        if ladder.slots
        else "on the baseline"
    )
    label = " + ".join(r.name for r in group)
    ladder.on_event(f"second look: {label} {where}")
    t0, inserted = ladder.host_clock(), []
    parity: Parity | None = None
    try:
        for rung in group:  # in ladder order: each at its place among the kept rungs
            place = ladder.stack.insert_at_place(rung)
            inserted = [i + (i >= place) for i in inserted] + [place]
        n = len(ladder.slots)
        losses, parity, problem = judge_inserted(ladder, inserted, reference)
        if problem:
            raise RuntimeError(problem)
        without = [i not in inserted for i in range(n)]
        paired = compare(
            ladder,
            lambda on: ladder.stack.configure([True] * n if on else without),
            label,
            shared_batches=ladder.stack.shares_batches(),
            whole_budget=whole_budget,
        )
        for i in inserted:  # a change that stopped working while timed (a graph stopped): not what was timed
            problem = agreed_problem(ladder.slots[i].handle)
            if problem:
                raise RuntimeError(problem)
        status, why = comparison.decide(ladder.cfg, paired, all(r.memory_comparable for r in group))
        if len(group) == 1:
            ladder.last_comparison[group[0].name] = paired
    except Exception as exc:  # a rung's own report of a problem is said as it is, as in the climb
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        why = str(exc) if isinstance(exc, RungProblem) else f"{type(exc).__name__}: {first_line(exc)}"
        paired, status = None, "failed"
    finally:
        ladder.snapshot.restore()
    together = f" together with {', '.join(r.name for r in group[1:])}" if len(group) > 1 else ""
    if status != "failed":
        record(ladder, "the second look", [r.name for r in group], status == "kept", paired, why)
    if status == "kept":  # its entry keeps its first figures; the row after says what changed
        assert paired is not None
        for rung, entry in zip(group, entries):
            assert entry is not None
            slot = next(s for s in ladder.slots if s.rung is rung)
            entry.status, entry.changes = "kept", list(slot.handle.changes) + slot.handle.report()
            entry.rewrite = slot.rewrite_report()
            partners = [r.name for r in group if r is not rung]
            entry.reason = (
                f"kept on a second look {where}"
                + (f", with {', '.join(partners)}" if partners else "")
                + f": {why}; before them: {entry.reason}"
            )
        result.rungs.append(
            RungResult(
                f"second look: {label} {where}",
                "closing",
                precision=ladder.state.precision,
                changes=[f"applied {label} {where}"],
                parity=parity,
                comparison=paired,
                measurement=paired.b,
                reason=f"final configuration with {label}",
                seconds=ladder.host_clock() - t0,
            )
        )
        kept = True
    else:
        for i in sorted(inserted, reverse=True):
            ladder.stack.remove(i)
        ladder.stack.all_on()
        for entry in entries:
            assert entry is not None
            entry.reason = f"{entry.reason}; second look {where}{together}: {why}, reverted"
        kept = False
    for entry in entries:
        assert entry is not None
        entry.seconds = (entry.seconds or 0.0) + (ladder.host_clock() - t0) / len(group)
    ladder.on_event(f"second look: {label} {'kept' if kept else 'reverted'} ({why})")
    return kept, (losses if kept else reference)


def judge_inserted(ladder: Trials, inserted: list[int], reference: list[float]) -> tuple[list[float], Parity, str | None]:
    """The slots at ``inserted`` (just put in, all slots on) judged before they are timed: the loss
    trajectory against ``reference`` (the configuration without them), each one's own report of a
    problem, and a rewrite's parity with the precision rungs off. Returns the trajectory, its parity
    and the first problem found (None: they may be timed)."""
    n = len(ladder.slots)
    losses, parity = ladder.parity.of([True] * n, [i not in inserted for i in range(n)], reference)
    if not parity.passed:
        return losses, parity, f"numerics changed: loss differs by {parity.max_rel_diff:.2e} > {parity.tolerance:.0e}"
    for i in inserted:
        problem = agreed_problem(ladder.slots[i].handle)
        if problem:
            return losses, parity, problem
        if ladder.slots[i].rung.judged_at_full_precision:
            precise = ladder.parity.at_full_precision(i)
            if precise is not None and not precise.passed:
                return (
                    losses,
                    parity,
                    f"numerics changed: {ladder.slots[i].rung.name} moves the loss by "
                    f"{precise.max_rel_diff:.2e} > {precise.tolerance:.0e} with the precision rungs off",
                )
    return losses, parity, None


def leave_one_out(ladder: Trials, names: list[str]) -> list[str]:
    """Judge a group kept together member by member: the final configuration with the member (B) against
    it without (A), each member in turn, last in the ladder's order first, while the rungs' share of the
    budget lasts. A member stays only where the group without it is decided slower (it earns its place:
    B decided faster by the minimum gain); undecided or not faster, it is removed and reverted, said
    why, and the group's figure becomes the group's less it (the account's chain: the removal's comparison
    goes to the rest of the group). Returns the
    members removed. Where the budget is spent before a member's turn, it and the rest stay on the
    group's figure, and the report says so."""
    removed: list[str] = []
    order = {r.name: i for i, r in enumerate(ladder.rungs)}
    for name in sorted(names, key=lambda n: order.get(n, 0), reverse=True):
        index = next((i for i, s in enumerate(ladder.slots) if s.rung.name == name), None)
        entry = ladder.entry(name)
        if index is None or entry is None or len(ladder.slots) < 2:
            continue
        if ladder.budget.spent():
            ladder.note_budget(f"leave-one-out of {' + '.join(names)}")
            break
        n = len(ladder.slots)
        # a member that another on above cannot work without is left out with it (a graph without its
        # sync removal would stop for good, not be timed)
        needing = [ladder.slots[i].rung.name for i in ladder.stack.dependents(index)]
        without = [i != index for i in range(n)]
        with_needing = f" (and {', '.join(needing)}, which cannot work without it)" if needing else ""
        ladder.on_event(f"leave-one-out: {' + '.join(names)} without {name}{with_needing}")
        try:
            ladder.stack.configure(without)  # A: the group without it; B: with it
            paired = compare(
                ladder,
                lambda on, without=without, n=n: ladder.stack.configure([True] * n if on else without),
                f"with {name}",
                shared_batches=ladder.stack.shares_batches(),
            )
        except Exception as exc:  # a member the others need (a graph without its sync removal): it stays
            ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
            entry.reason = f"{entry.reason}; left out of its group it failed ({type(exc).__name__}: {first_line(exc)}): stays"
            continue
        finally:
            ladder.stack.all_on()
            ladder.snapshot.restore()
        if comparison.decide(ladder.cfg, paired)[0] == "kept":  # shown to earn its place
            record(ladder, "leave-one-out", [name], True, None, f"the group without it is slower ({paired.speedup:.3f}x with it)")
            entry.reason = (
                f"{entry.reason}; judged within its group: with it against the group without it{with_needing}: "
                f"{describe(paired)}, so it stays"
            )
        else:
            with_it = ladder.stack.remove(index)
            ladder.stack.all_on()
            gone_names = [name, *with_it]
            why = f"with it against the group without it{with_needing}: {describe(paired)}, not shown to earn its place"
            record(ladder, "leave-one-out", gone_names, False, paired, why)
            for gone in gone_names:
                # judged on the configuration that stays: a second look would time the same pair again
                ladder.judged.add(((gone,), tuple(s.rung.name for s in ladder.slots)))
                gone_entry = ladder.entry(gone)
                if gone_entry is not None:
                    gone_entry.status = "reverted"
                    gone_entry.reason = (
                        f"{gone_entry.reason}; left out of its group: {why}"
                        if gone == name
                        else f"{gone_entry.reason}; left out of its group with {name}, which it cannot work without ({why})"
                    )
                removed.append(gone)
        ladder.on_event(f"leave-one-out: {name} {'removed' if name in removed else 'stays'} ({describe(paired)})")
    return removed
