"""The ladder's profile: where the time goes in the baseline and each prefix of the final
configuration's rungs (:mod:`speedkit.profile`), NVML sampled across them; each kept rung's attribution
is derived from these windows with the other figures (:mod:`speedkit.figures.attribution`). A verb of
the ladder, taking the :class:`~speedkit.engine.trials.Trials` (the ladder).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from speedkit import distributed
from speedkit.errors import first_line

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials


def rank_communication_of(communication_ms: float | None, step_ms: float | None) -> dict[str, Any]:
    """This rank's device time in collectives (a profile's "communication" category: NCCL's or gloo's
    all-reduces, all-gathers and reduce-scatters) in its profiled step, and its share of that step.
    Collectives run beside the compute on their own stream: the share is what they took, of which the
    step waited for some part at most; None where the profile did not run."""
    share = round(communication_ms / step_ms, 4) if communication_ms is not None and step_ms else None
    return {"rank": distributed.rank(), "communication_ms": communication_ms, "step_ms": step_ms, "share": share}


def profile_configurations(ladder: Trials, edges_only: str | None = None) -> None:
    """Where the time goes (:mod:`speedkit.profile`): a short profiler window of the baseline and
    of each prefix of the final configuration's rungs (the last one the final configuration),
    host syncs and traces of the first and the last, NVML sampled across them (each kept rung's
    attribution is the account's, from these windows). Never fails the run: a window that cannot
    be taken leaves the profile's ``note``.

    Within the budget: after the baseline's window, the prefixes' windows are taken only where what
    the budget has left holds them at the baseline window's pace (on an H200 7 windows took 8.6 s,
    which had run the trials past their 120 s); else the final configuration's alone, and the note
    says so. ``edges_only``: the reason to take the baseline's and the final configuration's alone
    (a cached decision: its prefixes are in the report of the fit that made it)."""
    from speedkit.measure.nvml import NvmlSampler, timeline
    from speedkit.profile import CATEGORIES, CATEGORY_LABELS, ProfileUnavailable, find_host_syncs, profile_window

    result, state, n = ladder.result, ladder.state, len(ladder.slots)
    assert result is not None
    names = [s.rung.name for s in ladder.slots]
    profile: dict[str, Any] = {
        "steps": ladder.cfg.profile_steps,
        "categories": list(CATEGORIES),
        "labels": dict(CATEGORY_LABELS),
        "windows": [],
        "host_syncs": {},
        "note": None,
        "host_syncs_note": "found on CUDA only (its sync debug mode): a CPU step has no device to wait for"
        if state.device.type != "cuda"
        else "not looked for across several processes: the sync debug mode stops one rank's step where the others go on"
        if distributed.world_size() > 1
        else None,
    }
    result.profile = profile
    sampler = NvmlSampler.create(state.device) if ladder.cfg.telemetry else None
    marks: list[tuple[float, str]] = []
    if sampler is not None:
        sampler.start()
    started = time.monotonic()  # the sampler's own start, within microseconds
    skipped: str | None = edges_only
    first_from = ladder.host_clock()  # the budget's clock
    try:
        for k in range(n + 1):
            if 0 < k < n and skipped is None:
                per_window = ladder.host_clock() - first_from  # the baseline's window: settle, steps, start and stop
                if ladder.budget.closing_left() < per_window * (n - k + 1):
                    skipped = (
                        f"the budget's {max(0.0, ladder.budget.closing_left()):.1f} s left holds no "
                        f"{n - k + 1} windows of ~{per_window:.1f} s"
                    )
            if 0 < k < n and skipped is not None:
                continue
            label = "baseline" if k == 0 else "final" if k == n else names[k - 1]
            ladder.on_event(f"profile: {label}" + (f" ({' + '.join(names[:k])})" if 0 < k < n else ""))
            edge = k in (0, n)
            trace = ladder.trace_dir / f"{label}.json.gz" if edge and ladder.trace_dir is not None else None
            marks.append((time.monotonic() - started, label))
            with distributed.together():  # a window that fails on one rank stops the profile on every rank
                ladder.stack.configure([i < k for i in range(n)])
                run_one = ladder.timing.runner()
                for _ in range(ladder.timing.settle()):
                    run_one()
                window = profile_window(
                    run_one, steps=ladder.cfg.profile_steps, label=label, device=state.device, trace_path=trace
                ).to_dict()
            window["rungs"] = names[:k]
            if trace is not None and window.get("trace"):
                window["trace"] = f"{ladder.trace_dir.name}/{trace.name}"  # beside the report
            profile["windows"].append(window)
            if k == n and distributed.world_size() > 1:  # every rank reaches it (a failed window raised on all)
                own = rank_communication_of(window["breakdown_ms"].get("communication"), window["step_ms"])
                result.run["ranks_communication_final"] = {
                    "of": "the final configuration's step",
                    "ranks": distributed.gather(own),
                }
            if edge and state.device.type == "cuda" and distributed.world_size() == 1:
                profile["host_syncs"][label] = find_host_syncs(run_one, state.device)
                if k == 0 and n == 0:
                    profile["host_syncs"]["final"] = profile["host_syncs"][label]
    except ProfileUnavailable as exc:
        profile["note"] = f"profile stopped at {len(profile['windows'])} of {n + 1} windows: {first_line(exc)}"
    except Exception as exc:  # the decisions stand; only the picture of where the time goes is missing
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        profile["note"] = (
            f"profile stopped at {len(profile['windows'])} of {n + 1} windows: {type(exc).__name__}: {first_line(exc)}"
        )
    finally:
        if sampler is not None:
            sampler.stop()
            result.telemetry_timeline = timeline(sampler.samples, sampler.interval_s, marks)
        ladder.stack.configure([True] * n)
        ladder.snapshot.restore()
    if skipped is not None and n > 1 and profile["note"] is None:
        profile["note"] = f"the baseline and the final configuration profiled, not the {n - 1} rungs' prefixes between: {skipped}"
