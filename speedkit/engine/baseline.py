"""The ladder's baseline, its diagnosis and the trials' plan: the baseline's flops, measuring session,
timing, parity reference and tolerances, its measurement, window length and the trials' budget; one
short profile window and the step's host syncs, read as a :class:`~speedkit.engine.diagnose.Diagnosis`;
then which rungs are not worth timing (their targets' share of the step bounds their gain under the
minimum) and which go first (the diagnosed bottleneck's remedy). Verbs of the ladder's policy, taking
the :class:`~speedkit.engine.trials.Trials` (the ladder).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from speedkit import compat, config, distributed
from speedkit.data.batch import count_items
from speedkit.data.static import signature
from speedkit.engine.budget import window_steps
from speedkit.engine.cache import CachedDecision
from speedkit.engine.climb import compile_in_effect
from speedkit.engine.diagnose import Diagnosis, diagnose
from speedkit.engine.plan import first_configuration, gain_bound, prune
from speedkit.engine.profile_run import rank_communication_of
from speedkit.engine.stack import agreed_check
from speedkit.engine.timing import Timing
from speedkit.errors import SpeedkitError, first_line
from speedkit.kernels.recognise import gates
from speedkit.measure import layer_shapes
from speedkit.measure.flops import CONVENTION, count_step_flops, peak_tflops
from speedkit.measure.noise import host_bound
from speedkit.measure.session import MeasureSession
from speedkit.results import Measurement, Parity, RungResult
from speedkit.rungs.base import Rung

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials


class TrialsNotRun(SpeedkitError):
    """The trials cannot judge anything on this run (the baseline's own loss is not finite): nothing
    was applied, the state is the user's, the message says why."""


def baseline_setup(ladder: Trials) -> None:
    """The baseline's parity batches, flops, measuring session and timing; its time counts from here
    (``ladder.baseline_started``). Its parity reference runs where first needed (:func:`baseline_reference`)."""
    state, cfg, result, snapshot = ladder.state, ladder.cfg, ladder.result, ladder.snapshot
    assert result is not None and snapshot is not None
    if state.data is None:
        raise RuntimeError("the ladder needs batches: give the state a data source")
    ladder.phase = "the baseline"
    accumulate = state.step.accumulate
    ladder.parity.batches = state.data.parity_batches(ladder.parity.steps * accumulate)
    #: batches differ in shape: each A/B block times both configurations on the same batches
    # (on any rank: every rank then times its blocks alike, each rank's shard having its own lengths)
    shapes_vary = distributed.any_rank(len({repr(signature(b)) for b in ladder.parity.batches}) > 1)
    if shapes_vary:
        result.run["batch_shapes"] = "vary: each A/B block times both configurations on the same batches"
    first = state.data.to_device(ladder.parity.batches[0])
    # the input shapes of the norms and the gated products' activations (a library's own SiLU/GELU module
    # too), for the kernels' per-shape choice under compile (triton_layers); not in a model the user
    # compiled (hooks added and removed would make Dynamo compile it twice more)
    with layer_shapes.recording(state.model, when=not compat.user_compiled(state.model), also=gates) as fed:
        flops = count_step_flops(state.step, first)
    state.notes[layer_shapes.NOTE] = fed
    snapshot.restore()
    if ladder.cache is not None and distributed.world_size() == 1:
        # where every parity trajectory starts: a cached decision's trajectory recorded from the same
        # start stands for its own (one process: a sharded or per-rank state is not compared)
        try:
            ladder.start_digest = snapshot.digest(ladder.parity.batches)
        except Exception as exc:  # a state it cannot read (a sparse or meta tensor): judged against the baseline
            ladder.stop.reraise(exc)
            ladder.start_digest = None
    peak, peak_source = peak_tflops(state.device, cfg.mfu_precision, cfg.peak_tflops)
    items, unit = count_items(ladder.parity.batches[0], cfg.throughput_unit)
    result.flops = {
        "per_step": flops * accumulate if flops else flops,
        "convention": CONVENTION.format(precision=cfg.mfu_precision, source=peak_source),
        "peak_tflops": peak,
        "peak_source": peak_source,
        "precision": cfg.mfu_precision,
    }
    ladder.session = MeasureSession(
        state.device,
        clock=ladder.clock,
        host_clock=ladder.host_clock,
        flops_per_step=result.flops["per_step"],
        peak_tflops=peak,
        items_per_step=items * accumulate * state.step.world_size(),  # under DDP: every rank's items
        unit=unit,
        telemetry=cfg.telemetry,
        across_ranks=True,  # under DDP: the slowest rank's windows, every rank's figures kept
    )
    # what the step in effect holds outside the allocator's peak (a kept or tried CUDA graph's pool)
    ladder.session.memory_outside_peak = lambda: int(state.step.memory_outside_peak())
    ladder.timing = Timing(
        state,
        cfg,
        ladder.session,
        ladder.stack,
        snapshot,
        host_clock=ladder.decision_clock,
        on_event=ladder.on_event,
        shapes_vary=shapes_vary,
        # alone, a process stops at its next step; several stop together between phases (a collective)
        poll=ladder.stop.check if distributed.world_size() == 1 else (lambda: None),
    )
    if distributed.world_size() == 1:
        ladder.parity.poll = ladder.stop.check

    ladder.baseline_started = ladder.host_clock()


def baseline_reference(ladder: Trials) -> list[float]:
    """The baseline's parity reference (the trajectory every rung's numerics are judged against), run
    now where it has not run yet (its pace: ``ladder.parity.reference_pace_s``). Raises :class:`TrialsNotRun`
    where its loss is not finite."""
    if not ladder.parity.has_reference:
        ladder.on_event("baseline: parity reference")
    reference = ladder.parity.reference
    broken = next((i for i, loss in enumerate(reference) if not math.isfinite(loss)), None)
    if broken is not None:
        raise TrialsNotRun(
            f"the training loss is {reference[broken]} at step {broken + 1} of the baseline, before any "
            "rung: no rung's numerics can be checked against it; fix the model's loss first"
        )
    return reference


def measure_baseline(ladder: Trials, cached: CachedDecision | None = None) -> Measurement:
    """The parity tolerances of every precision in play, the baseline's measurement, the window length
    and the trials' budget; returns the measurement.

    ``cached``: a decision cache's entry for this run's key. Its calibration stands for the precisions it
    holds, and, where it holds the baseline's figures, they stand for the measurement (marked as the
    earlier fit's): a re-check times the final configuration, not the baseline again, and runs the
    baseline's parity reference only where a judgement needs it.

    The baseline's windows are sized by time as the comparisons' are (at most ``steps`` steps, at least
    ``min_window_steps``), at the pace of the parity trajectories just run: a 450 ms fp32 step timed in
    windows of 10 steps had taken 24 s of the trials."""
    state, cfg, result = ladder.state, ladder.cfg, ladder.result
    assert result is not None and ladder.timing is not None
    t0 = ladder.baseline_started
    figures = (cached.baseline or {}) if cached is not None else {}
    cached_m = cached_baseline(cached)
    # a slow step (at the parity reference's pace, or the cached fit's baseline) gets the short forms of
    # the baseline's phases
    reference_s = baseline_pace_s(ladder, cached)
    slow = reference_s * 1e3 >= cfg.slow_step_ms
    if slow:
        ladder.parity.seeds = 1
        ladder.on_event(
            f"baseline: a slow step (~{reference_s:.2f} s): one draw per precision for the tolerances, the baseline "
            "in three windows of two steps"
        )
    in_play = {"fp32", state.precision, *filter(None, (r.precision_in_play(state) for r in ladder.rungs))}
    stored = (cached.calibration or {}) if cached is not None else {}
    reused = sorted(in_play & stored.keys())
    for precision in reused:
        ladder.parity.calibration[precision] = stored[precision]
    todo = sorted(in_play - stored.keys(), key=config.PRECISION_ORDER.index)
    if todo:
        ladder.on_event(f"baseline: parity tolerances from the model's sensitivity ({', '.join(todo)})")
    if reused:
        ladder.on_event(f"baseline: parity tolerances of the cached decision's fit ({', '.join(reused)})")
    if todo or cached_m is None:  # the tolerances and the baseline's own timing start from it
        baseline_reference(ladder)
    calibrating = ladder.host_clock()
    for precision in todo:
        ladder.parity.tolerance(precision)
    calibrated_s = ladder.host_clock() - calibrating
    reference = ladder.parity.reference if ladder.parity.has_reference else None
    if cached_m is not None:
        base_m = cached_m
        noise = dict(figures.get("noise") or window_steps(base_m, cfg, ladder.clock.name))
        measured_in = "the fit that made the cached decision"
    else:
        assert reference is not None
        # the parity steps run for the baseline: the reference's, and each calibrated precision's seeds'
        steps_run = len(reference) * (1 + len(todo) * int(config.parity_calibration().get("seeds", 1)))
        elapsed = reference_s * len(reference) + calibrated_s
        steps = 2 if slow else baseline_window_steps(ladder, elapsed, steps_run)
        ladder.on_event("baseline: measuring")
        with distributed.together():  # a slow step's parity trajectories warmed it up already
            base_m = ladder.timing.alone(steps, 3 if slow else None, warmup=1 if slow else None)
        noise = window_steps(base_m, cfg, ladder.clock.name)
        measured_in = None
    result.run["noise"] = noise
    ladder.timing.window_steps = noise["window_steps"]
    # one block's log gain varies as one window's mean does (its four windows' logs, halved): the
    # baseline's spread is the noise each comparison's design is sized for (at least half a percent:
    # five windows can look quieter than the blocks will be)
    ladder.timing.noise = max(0.005, base_m.spread) if math.isfinite(base_m.spread) else None
    ladder.on_event(
        f"baseline: {base_m.step_ms:.1f} ms per step, windows vary by {noise['baseline_spread']:.1%} "
        f"({noise['source']}); comparisons time windows of {noise['window_steps']} steps (~{noise['window_s']:.2f} s)"
        + (f" (as measured in {measured_in})" if measured_in else "")
    )
    result.run["budget"] = ladder.budget.plan(
        base_m, ladder.planned_steps, noise["window_steps"], ladder.parity.steps * state.step.accumulate
    )
    result.rungs = [r for r in result.rungs if r.status != "baseline"]  # measured again after a re-check that failed
    result.rungs.insert(
        0,
        RungResult(
            "baseline",
            "baseline",
            precision=state.precision,
            measurement=base_m,
            parity=Parity(len(reference), 0.0, state.precision, reference, reference, 0.0, True) if reference else None,
            seconds=ladder.host_clock() - t0,
            reason=f"measured in {measured_in}" if measured_in else None,
        ),
    )
    return base_m


def cached_baseline(cached: CachedDecision | None) -> Measurement | None:
    """The baseline's measurement in the fit that made ``cached`` (None: no entry, or none held)."""
    figures = (cached.baseline or {}) if cached is not None else {}
    return Measurement.from_dict(figures["measurement"]) if figures.get("measurement") else None


def baseline_pace_s(ladder: Trials, cached: CachedDecision | None = None) -> float:
    """Seconds a parity step of the baseline takes: its parity reference's pace (an upper bound: its
    first steps include first calls), or, where the reference has not run and ``cached`` holds the
    baseline's figures, that fit's step; else the reference runs now."""
    parity = ladder.parity
    if parity.reference_pace_s is None:
        cached_m = cached_baseline(cached)
        if cached_m is not None:
            return cached_m.step_ms / 1e3
        baseline_reference(ladder)
    assert parity.reference_pace_s is not None
    return parity.reference_pace_s


def baseline_window_steps(ladder: Trials, elapsed: float, steps_run: int) -> int:
    """Steps per window of the baseline's measurement: ``window_s`` at the pace of ``steps_run`` parity
    steps that took ``elapsed`` seconds (an upper bound on the step time: their first steps include
    first calls), between ``min_window_steps`` and ``steps``."""
    cfg = ladder.cfg
    if steps_run <= 0 or elapsed <= 0:
        return cfg.steps
    pace_s = elapsed / steps_run
    return max(min(cfg.min_window_steps, cfg.steps), min(cfg.steps, math.ceil(cfg.window_s / pace_s)))


def diagnose_baseline(ladder: Trials, baseline: Measurement) -> Diagnosis:
    """What sets the pace of the step in effect (the baseline's, or the floor's where the user's switches
    are applied: the step the rungs are judged on) (:func:`speedkit.engine.diagnose.diagnose`): its step clock's
    figures (``baseline``), one short profile window of ``profile_steps`` steps (device time by category,
    the device's busy share, the data wait) and, on one CUDA process, the host syncs one step makes,
    each with its source line. A profile that cannot be taken leaves the diagnosis to the step clock's
    figures (no category then bounds any rung). Recorded in ``run["diagnosis"]`` and said in one line."""
    from speedkit.profile import ProfileUnavailable, find_host_syncs, profile_window

    state, cfg, result = ladder.state, ladder.cfg, ladder.result
    assert result is not None and ladder.timing is not None and ladder.snapshot is not None
    window, syncs, note = None, None, None
    try:
        with distributed.together():  # a window that fails on one rank is given up on every rank
            run_one = ladder.timing.runner()
            window = profile_window(run_one, steps=cfg.profile_steps, label="diagnosis", device=state.device)
            if state.device.type == "cuda" and distributed.world_size() == 1:
                syncs = find_host_syncs(run_one, state.device)
    except ProfileUnavailable as exc:
        note = f"no profile: {first_line(exc)}"
    except Exception as exc:  # the step clock's figures still diagnose; nothing is lost but the categories
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        note = f"no profile: {type(exc).__name__}: {first_line(exc)}"
    finally:
        ladder.snapshot.restore()
    capacity = None
    if state.device.type == "cuda":
        import torch

        capacity = torch.cuda.get_device_properties(state.device).total_memory
    # one diagnosis for every rank (rank 0's): each rank profiled its own step, and under sharding their
    # categories differ (one rank's profile shows its wait in a collective as communication, another's not),
    # which would plan each rank's trials differently and leave their collectives out of step
    own = diagnose(baseline, window, syncs, memory_capacity_bytes=capacity)
    # the step the rungs will be judged on: the user's switches where they are the floor
    of = f"the switches' step ({' + '.join(s.rung.name for s in ladder.slots)})" if ladder.slots else "the baseline's step"
    if distributed.world_size() > 1:  # each rank's own share of its profiled step in collectives, for the report
        result.run["ranks_communication"] = {"of": of, "ranks": distributed.gather(rank_communication(own))}
    diagnosis, note = distributed.broadcast((own, note))
    result.run["diagnosis"] = {**diagnosis.to_dict(), "summary": diagnosis.summary(), "note": note, "of": of}
    ladder.on_event(f"diagnosis: {diagnosis.summary()} (of {of})" + (f" ({note})" if note else ""))
    return diagnosis


def rank_communication(diagnosis: Diagnosis) -> dict[str, Any]:
    """This rank's device time in collectives in the diagnosis's profiled step, and its share of that
    step (:func:`speedkit.engine.profile_run.rank_communication_of`)."""
    comm = diagnosis.breakdown_ms.get("communication") if diagnosis.breakdown_ms else None
    return rank_communication_of(comm, diagnosis.profile_step_ms or diagnosis.step_ms)


def trial_order(
    ladder: Trials, baseline: Measurement, diagnosis: Diagnosis | None = None
) -> tuple[list[Rung], list[tuple[Rung, str]]]:
    """The rungs to try, in order, and those not worth timing with the reason (their targets' share of
    the diagnosed step bounds their gain under ``min_gain``: :func:`speedkit.engine.plan.prune`).

    The remedy of the diagnosed bottleneck goes first, with its prerequisites
    (:func:`speedkit.engine.plan.first_configuration`: a data-bound step tries ``data_path`` first, a
    host-bound one compile and the rungs that remove syncs, a device-bound one the rungs on its top
    categories), the others after it in the ladder's order, except on a GPU where the step clock shows
    who sets the pace (:func:`_pace_order`). Each rung still goes in at its place in the ladder's order
    (beneath the kept rungs that come after it there): only the order of the trials changes."""
    rungs, pruned = list(ladder.rungs), []
    if diagnosis is not None:
        remedy = set(first_configuration(ladder.rungs, diagnosis))  # never pruned: the bottleneck's own
        kept, pruned = prune(ladder.rungs, _once_fed(diagnosis), ladder.cfg.min_gain)
        pruned = [(r, why) for r, why in pruned if r.name not in remedy]
        rungs = [r for r in ladder.rungs if r in kept or r.name in remedy]
    order = _pace_order(ladder, baseline, rungs)
    if diagnosis is not None:
        # the user's switches in effect already (the floor) are no part of what is tried first
        first = [n for n in first_configuration(order, diagnosis) if n not in ladder.floor]
        if first:
            order = [r for r in order if r.name in first] + [r for r in order if r.name not in first]
            assert ladder.result is not None
            ladder.result.run["first_tried"] = f"{diagnosis.kind}: {', '.join(first)} first (its remedy)"
            ladder.remedy = set(first)
            ladder.on_event(f"plan: {diagnosis.kind} step: trying {', '.join(first)} first")
    order = _cheap_first(ladder, order)
    for rung, reason in pruned:
        ladder.on_event(f"plan: {rung.name} not timed: {reason}")
    return order, pruned


def planned_bounds(ladder: Trials, order: list[Rung], diagnosis: Diagnosis | None) -> dict[str, float | None]:
    """The rungs of ``order`` the plan will time, each with its bound (:func:`speedkit.engine.plan.gain_bound`
    on the step once fed, where the diagnosis names a data wait; None: not bounded): those that apply on
    the configuration in effect now (a rung that does not apply takes no share of the budget)."""
    bounds: dict[str, float | None] = {}
    fed = _once_fed(diagnosis) if diagnosis is not None else None
    for rung in order:
        try:
            if agreed_check(rung, ladder.state) is not None:
                continue
        except Exception:  # its trial says why
            continue
        bounds[rung.name] = gain_bound(rung.targets, fed)[0] if fed is not None else None
    return bounds


def _cheap_first(ladder: Trials, order: list[Rung]) -> list[Rung]:
    """``order`` with the rungs that compile anew beneath a kept compile (``Rung.recompiles``) after
    those that do not, each part in its order, where compile is in effect (the floor's, or the user's
    own). Within one budget this tries first what costs seconds: on an H200, GPT-2 diagnosed
    device-bound spent its budget compiling two kernel rewrites (56 s, neither paid) and never tried
    the progress bar's sync (1.057x when tried) or a CUDA graph; diagnosed host-bound in another run
    (the GPU 90% busy, at the threshold), it kept both: two kept sets for one model."""
    later = [r for r in order if r.recompiles]
    if not compile_in_effect(ladder) or not later or len(later) == len(order):
        return order
    cheap = [r for r in order if not r.recompiles]
    if cheap + later != order:
        named = [r.name for r in later if r.name not in ladder.floor]  # the floor's are in effect, not tried
        ladder.on_event(
            f"plan: beneath compile, {', '.join(named)} (each compiled anew) after "
            f"{', '.join(r.name for r in cheap if r.name not in ladder.floor)}"
        )
    return cheap + later


def _once_fed(diagnosis: Diagnosis) -> Diagnosis:
    """The diagnosis the bounds are read from: on a data-bound step, the step as it will be once its
    remedy (tried first) removed the wait for batches. The rungs after it are judged on that step, where
    the host's and the device's shares are the wait's remainder's, not the wait-bound step's (on a
    ResNet-18 waiting 92% of its step, host time read 0% and pruned cuda_graph and the progress bar's
    sync, which the fed step may need)."""
    if diagnosis.kind != "data-bound" or not diagnosis.data_wait_ms:
        return diagnosis
    wait = diagnosis.data_wait_ms
    profile_wait = (diagnosis.breakdown_ms or {}).get("data_wait", 0.0)
    fed = dataclasses.replace(
        diagnosis,
        step_ms=max(1e-9, diagnosis.step_ms - wait),
        data_wait_ms=0.0,
        profile_step_ms=max(1e-9, diagnosis.profile_step_ms - profile_wait)
        if diagnosis.profile_step_ms
        else diagnosis.profile_step_ms,
        breakdown_ms={**diagnosis.breakdown_ms, "data_wait": 0.0} if diagnosis.breakdown_ms else diagnosis.breakdown_ms,
    )
    return fed


def _pace_order(ladder: Trials, baseline: Measurement, rungs: list[Rung]) -> list[Rung]:
    """``rungs`` in the ladder's order, except on a GPU where the baseline's step clock shows who sets
    the step's pace:

    - a host-bound step (the host drives the device, see :func:`speedkit.measure.noise.host_bound`):
      the rungs that cut host work (``Rung.cuts_host_work``: compile, CUDA graphs, the progress bar's
      sync) are tried first, compile first of them: in the host's noise the others' device-side gains do not
      show, beneath them they do;
    - a device-bound step: the rungs whose only gain is the device's wait for the host
      (``Rung.host_side``: the loader's path, the garbage collector, the progress bar's sync, CUDA
      graphs) are tried after the others, on the step they made fast, where a wait can show (on
      GPT-2 in fp32, 340 ms a step on a GPU 99% busy, data_path and gc_freeze measured 1.00x in 20 s
      each; compiled in bf16 the step is 51 ms)."""
    host, step = baseline.host_ms, baseline.step_ms
    # where the step clock is the host's (a CPU), every step is host time: nothing to reorder
    # (nor where the host's time is not known)
    if ladder.clock.name == "perf_counter" or host is None or not step:
        return list(rungs)
    assert ladder.result is not None
    if not host_bound(baseline, ladder.cfg.host_bound_share, ladder.cfg.busy_util):
        later = [r for r in rungs if r.host_side]
        order = [r for r in rungs if not r.host_side] + later
        if order != list(rungs):
            util = (baseline.telemetry or {}).get("util_mean")
            pace = (
                f"GPU busy {util:.0f}% of the time"
                if host >= ladder.cfg.host_bound_share * step and util is not None
                else f"host {host:.1f} of {step:.1f} ms per step"
            )
            moved = ", ".join(r.name for r in later)
            ladder.result.run["trial_order"] = f"device-bound baseline ({pace}): {moved} tried last"
            ladder.on_event(f"device-bound baseline ({pace}): trying {moved} last, on the step the others made fast")
        return order
    # compile first of them: the others are judged on the step it compiled, where the host's noise is
    # least and what they remove shows (a graph break's sync: explicit_mask, 1.04x undecided in eager
    # on Lightning's demo Transformer, 1.26x beneath compile; the progress bar's sync)
    first = sorted((r for r in rungs if r.cuts_host_work), key=lambda r: r.name != "compile")
    if not first:
        return list(rungs)
    order = first + [r for r in rungs if not r.cuts_host_work]
    ladder.result.run["trial_order"] = (
        f"host-bound baseline (host {host:.1f} of {step:.1f} ms per step): {', '.join(r.name for r in first)} tried first"
    )
    ladder.on_event(
        f"host-bound baseline ({host:.1f} ms of host time in a {step:.1f} ms step): trying "
        f"{', '.join(r.name for r in first)} first, the others beneath them"
    )
    return order
