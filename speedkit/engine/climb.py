"""The climb: the plan's rungs tried one by one in its order (:func:`climb`), each its own trial
(:func:`speedkit.engine.trial.try_rung`), within the rungs' share of the trials' budget: a rung that
the time left cannot hold is not begun, and says why. A verb of the ladder's policy, taking the
:class:`~speedkit.engine.trials.Trials` (the ladder).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speedkit import compat
from speedkit.engine.trial import try_rung
from speedkit.results import RungResult

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials
    from speedkit.rungs.base import Rung


def climb(ladder: Trials, order: list[Rung], reference: list[float]) -> list[float]:
    """Try each rung of ``order``; returns the reference trajectory of the configuration it leaves."""
    result = ladder.result
    assert result is not None
    total = len(ladder.rungs)
    for i, rung in enumerate(order, 1):
        ladder.phase = rung.name
        ladder.on_event(f"[{i}/{total}] {rung.name}")
        ladder.on_progress(i - 1, len(order), rung.name)
        # the bottleneck's own remedy is tried whatever the budget: on a data-bound step it is what pays
        # (on an H200 a ResNet-18 waiting 93% of its step skipped data_path in one run of two, 13.3x in the other)
        # (a device-bound step's "remedy", the kernel rungs on its top categories, is no such bundle: budgeted)
        whatever = rung.name in ladder.remedy and (ladder.diagnosis is None or ladder.diagnosis.kind != "device-bound")
        why_not = None if whatever else no_room_for(ladder, rung)
        if why_not is not None:
            entry = RungResult(rung.name, "skipped", options=rung.options_dict(), precision=ladder.state.precision)
            entry.reason = f"not tried: {why_not}"
            result.rungs.append(entry)
            result.run["budget"]["skipped"].append(rung.name)
            ladder.budget.done_with(rung.name)
            ladder.on_event(f"[{i}/{total}] {rung.name}: {entry.reason}")
            continue
        compiled_before = compat.compile_seconds()
        entry, reference = try_rung(ladder, rung, reference)
        ladder.budget.done_with(rung.name)
        note_trial_compile(ladder, compat.compile_seconds() - compiled_before)
        result.rungs.append(entry)
        ladder.on_event(f"[{i}/{total}] {rung.name}: {entry.status}" + (f" ({entry.reason})" if entry.reason else ""))
    ladder.on_progress(len(order), len(order), "closing check, second look, final check, profile")
    return reference


def note_trial_compile(ladder: Trials, seconds: float) -> None:
    """Keep ``seconds`` a trial (a rung's, or the remedy's together) spent compiling, where it compiled
    at all: the most any has is what the next trial that compiles anew is expected to cost."""
    if seconds > 1.0:
        ladder.trial_compile_s = max(ladder.trial_compile_s, seconds)


def compile_in_effect(ladder: Trials) -> bool:
    """Whether the step runs compiled code (the floor's compile, or the user's own): a rung with
    ``recompiles`` then compiles anew in its trial."""
    return "compile" in ladder.floor or compat.runs_compiled_code(ladder.state.model)


def fresh_compile_s(seconds: float, caches: dict[str, int]) -> float:
    """``seconds`` of compiling where most of the graphs compiled from scratch (Inductor's FX-graph cache
    missed more than it hit): what compiling the model anew costs here; 0.0 where they came from the caches."""
    hits, misses = caches.get("fxgraph_cache_hit", 0), caches.get("fxgraph_cache_miss", 0)
    return seconds if seconds > 1.0 and misses >= max(1, hits) else 0.0


def expected_compile_s(ladder: Trials, rung: Rung) -> float:
    """What the compiling ``rung``'s trial is expected to cost. For a rung that compiles the model anew
    beneath compile: where the floor's compile compiled from scratch, the most of that and of what a trial
    has compiled here (a trial that compiled a little, a remedy's CUDA graph, is no guide alone: on an
    H100 nanogpt's fused_lm_head trial, begun on such a figure, compiled for 25 s as its floor had, 21.8 s
    from scratch, and the final check found no time left); else what a trial has compiled, or, before any
    has, ``recompile_prior_s`` (the floor's compile from Inductor's caches is no guide: on an H100
    ResNet-50's floor compiled in 4.5 s from them, its channels_last trial in 37 s, 15 s past the budget's
    end). Other rungs: what a trial has compiled here."""
    if not (rung.recompiles and compile_in_effect(ladder)):
        return ladder.trial_compile_s
    if ladder.floor_compile_s > 0:
        return max(ladder.trial_compile_s, ladder.floor_compile_s)
    return ladder.trial_compile_s if ladder.trial_compile_s > 0 else ladder.cfg.recompile_prior_s


def holds_a_trial(ladder: Trials, compiles_s: float) -> bool:
    """Whether the rungs' share of the budget left holds a trial's fewest steps and ``compiles_s`` of
    compiling on top (any trial, where it compiles nothing)."""
    budget = ladder.budget
    return compiles_s <= 0 or budget.left_for_rungs() >= budget.min_trial_s + compiles_s


def no_room_for_remedy(ladder: Trials, bundle: list[Rung]) -> str | None:
    """Why the remedy's ``bundle`` is not begun together (None: it is): the rungs' share of the budget is
    spent; or, where the diagnosis is device-bound (its "remedy" the kernel rungs on the step's top
    categories, no bottleneck's own cure), what is left of it does not hold the fewest steps of a trial
    with the compile the costliest member is expected to cost (:func:`expected_compile_s`: on an H100
    GPT-2's fused_lm_head + triton_layers + aligned_linear compiled for 44 s together and lost). Its members
    are then tried on their own, each as the budget allows (:func:`no_room_for`)."""
    budget = ladder.budget
    if budget.spent():
        return f"the trials' time budget ({budget.budget_s:.0f} s) was spent"
    if ladder.diagnosis is None or ladder.diagnosis.kind != "device-bound":
        return None  # the bottleneck's own remedy: what pays on such a step
    compiles = max(expected_compile_s(ladder, rung) for rung in bundle)
    if holds_a_trial(ladder, compiles):
        return None
    return (
        f"the {max(0.0, budget.left_for_rungs()):.0f} s left of the trials' time budget hold no trial of them "
        f"together that compiles anew (expected {compiles:.0f} s)"
    )


def no_room_for(ladder: Trials, rung: Rung) -> str | None:
    """Why ``rung`` is not begun (None: it is): the rungs' share of the budget is spent, or what is left
    of it does not hold the fewest steps of a trial together with the compile the trial is expected to
    cost (:func:`expected_compile_s`: a rung beneath compile is compiled anew, charged to the budget,
    never timed: on an H200 one such trial compiled for 66 s past the budget's end). A rung that does
    not apply where it would be tried (at its place: beneath the kept rungs after it) is let through,
    to say why; one that applies there is not begun, whatever it says on top of them (on an H100
    GPT-2's fused_lm_head, which does not apply on top of compile, was let through with the budget spent,
    applied beneath compile and compiled for 46 s: the trials ran 57 s past their 140-s budget)."""
    budget = ladder.budget
    compiles = expected_compile_s(ladder, rung)
    if not budget.spent() and holds_a_trial(ladder, compiles):
        return None
    try:
        if ladder.stack.check_at_place(rung) is not None:  # as its trial would check it
            return None
    except Exception:  # let through: its trial says the check failed
        return None
    finally:
        ladder.stack.all_on()
    if budget.spent():
        return f"the trials' time budget ({budget.budget_s:.0f} s) was spent"
    if ladder.floor_compile_s > 0 and compiles == ladder.floor_compile_s:
        like = f"anew as the floor's compile did ({compiles:.0f} s, from scratch)"
    elif ladder.trial_compile_s > 0:
        like = f"as long as one has here ({compiles:.0f} s)"
    else:
        like = f"anew (expected {compiles:.0f} s: recompile_prior_s)"
    return f"the {max(0.0, budget.left_for_rungs()):.0f} s left of the trials' time budget hold no trial that compiles {like}"
