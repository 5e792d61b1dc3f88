"""Does the ladder's figure hold in training? The final configuration's step time in the trials
against the same Trainer's next real steps, and, where they differ, the likely cause.

Host time splits in two: between steps (``data_wait_ms``: fetching and moving the next batch and,
in Lightning's loop, its per-batch bookkeeping, where its logging waits for the GPU) and in the
steps (``host_ms``). A gap mostly explained by one of them is attributed to it, unless the fit's
timed steps compiled: then the compilation explains it. Where Lightning's own actions between the
steps were timed (its fetch of the next batch, the hooks of callbacks and of the module), the
largest are named."""

from __future__ import annotations

from typing import NamedTuple

from speedkit import compat
from speedkit.results import Holds, Measurement


def left_out_at_most(holds_windows: int) -> int:
    """Windows in which ``torch.compile`` compiled that the fit check leaves out before it takes them
    as the figure: a few compilations are paid once (another range of a dynamic size); one window
    after another is a cost of every step."""
    return max(3, holds_windows)


#: an action between steps is named when it takes at least this share of that time, or of the gap
NAMED_SHARE = 0.1


#: the host is named slower throughout where the time between steps and the host time in them each rose
#: by at least this share of the gap (and no action between the steps explains the former)
HOST_WIDE = 0.25

#: Lightning's actions between steps that the trials run too: the fetch of the next batch and its move to the device
IN_TRIALS = {"fetch", "transfer"}


class Between(NamedTuple):
    """What took the host time between the fit's steps, by Lightning's actions there (ms/step)."""

    hooks_ms: float  # in actions the trials do not run: callbacks' and the module's hooks, validation, checkpoints
    validation_ms: float  # of it, in validation and checkpoints
    in_trials_ms: float  # in the fetch of the next batch and its move to the device, which the trials run too
    wording: str  # " (of it, ms/step: ...)": the actions that count, the fetch, what no action explains


def between_steps(between_ms: dict[str, float], wait_ms: float, gap_ms: float) -> Between:
    """Sum and word ``between_ms`` (ms/step of each Lightning action run between the fit's steps);
    ``wait_ms``: all the time between them, the rest being the loop's own bookkeeping."""
    labels = {a: compat.lightning_action_label(a) for a in between_ms}
    hooks = sum(ms for a, ms in between_ms.items() if labels[a][0] not in IN_TRIALS)
    validation = sum(ms for a, ms in between_ms.items() if labels[a][0] == "validation")
    in_trials = sum(between_ms.values()) - hooks
    counts = NAMED_SHARE * max(min(wait_ms, abs(gap_ms)), 1e-9)
    parts = [f"{labels[a][1]} {ms:.2f}" for a, ms in between_ms.items() if ms >= counts][:4]
    rest = wait_ms - sum(between_ms.values())
    if rest >= NAMED_SHARE * wait_ms:
        parts.append(f"no Lightning hook (the loop's own bookkeeping) {rest:.2f}")
    if not parts:
        return Between(hooks, validation, in_trials, "")
    parts += [f"{labels[a][1]} {ms:.2f}" for a, ms in between_ms.items() if ms < counts and labels[a][0] == "fetch"]
    return Between(hooks, validation, in_trials, f" (of it, ms/step: {', '.join(parts)})")


def _what_ran_between(between: Between, wait: float, timed: bool, trials_wait: float) -> str:
    """The cause of a gap in the time between steps (``wait``: the fit's above the trials'), from
    Lightning's actions there where they were ``timed``. The fetch and the move to the device run in
    the trials too (``trials_wait``: all their time between steps there): only what they took above
    that names the loader."""
    if between.validation_ms >= 0.5 * wait:
        return (
            "validation and checkpoints ran between the timed steps (the trials time training steps only): their "
            "cost over the run is the fit's, at the validation interval it has"
        )
    if between.hooks_ms >= 0.5 * wait:
        return (
            "per-batch hooks of the fit that the trials do not run (they time the training step, the fetch of the "
            "batch and its move to the device, not the callbacks' and the module's batch hooks)"
        )
    if not timed:
        return (
            "the next batch (the loader does not keep up: workers, pinned memory, prefetch) or the loop's own "
            "per-batch work (callbacks, logging)"
        )
    if _loader_rose(between, wait, trials_wait):
        return "the next batch: the loader does not keep up (workers, pinned memory, prefetch)"
    return "the loop's own per-batch work outside its hooks (its logging and metrics bookkeeping, a progress bar)"


def _loader_rose(between: Between, wait: float, trials_wait: float) -> bool:
    """The fetch and the move to the device took at least half the rise ``wait`` above ``trials_wait``,
    all the time between steps in the trials (which run them too)."""
    return between.in_trials_ms - trials_wait >= 0.5 * wait


def _host_wide(between: Between, wait: float, host: float, gap_ms: float, trials_wait: float) -> bool:
    """Both host times rose (between the steps and in them), and no action between the steps the fit
    runs (hooks, validation, a slower fetch) explains the rise between them."""
    if min(wait, host) < HOST_WIDE * gap_ms:
        return False
    return between.hooks_ms < 0.5 * wait and not _loader_rose(between, wait, trials_wait)


def judge_holds(
    ladder: Measurement | None,
    fit: Measurement | None,
    threshold: float,
    note: str | None = None,
    compiled: str | None = None,
    shapes_vary: bool = False,
    between_ms: dict[str, float] | None = None,
) -> Holds:
    """Compare the two figures; flag a gap over ``threshold`` with what explains most of it.
    ``compiled``: what ``torch.compile`` compiled during the fit's timed steps, where it did;
    ``shapes_vary``: the batches differ in shape (the trials timed shapes their warm pass had run);
    ``between_ms``: ms/step of each of Lightning's actions run between the fit's steps (its fetch of
    the next batch, the callbacks' and the module's hooks)."""
    between_ms = dict(between_ms or {})
    if ladder is None or fit is None:
        return Holds(ladder, fit, None, False, threshold, None, note or "not measured", between_ms)
    gap = fit.step_ms / ladder.step_ms - 1
    if abs(gap) <= threshold:
        return Holds(ladder, fit, gap, False, threshold, None, "; ".join(n for n in (compiled, note) if n) or None, between_ms)
    gap_ms = fit.step_ms - ladder.step_ms
    trials_wait = ladder.data_wait_ms or 0.0  # all the trials' time between steps
    wait = (fit.data_wait_ms or 0.0) - trials_wait
    host = (fit.host_ms or 0.0) - (ladder.host_ms or 0.0)
    between = between_steps(between_ms, fit.data_wait_ms or 0.0, gap_ms)
    per_step = (
        f"{fit.data_wait_ms or 0:.2f} ms/step between steps{between.wording} and {fit.host_ms or 0:.2f} ms/step "
        f"in them on the host in the fit, {ladder.data_wait_ms or 0:.2f} and {ladder.host_ms or 0:.2f} in the trials"
    )
    if compiled is not None and gap_ms > 0:
        cause = f"{compiled} ({per_step})"
    elif fit.clock == "perf_counter":  # a CPU: the step is host time through and through
        cause = (
            f"on a CPU a step is all host time, so this is mostly the machine running at another speed in the trials "
            f"and in the fit (windows vary by {ladder.spread:.1%} and {fit.spread:.1%} within each), and the loop's "
            f"own per-batch work ({per_step})"
        )
    elif gap_ms > 0 and _host_wide(between, wait, host, gap_ms, trials_wait):
        cause = (
            f"host time between and in the steps alike: {per_step}; the host runs all of the loop more slowly than in "
            "the trials (another thread of this process holding the interpreter, or another process on its cores)"
        )
    elif gap_ms > 0 and wait >= 0.5 * gap_ms:
        cause = f"time between steps: {per_step}; {_what_ran_between(between, wait, bool(between_ms), trials_wait)}"
    elif gap_ms > 0 and host >= 0.5 * gap_ms and shapes_vary:
        cause = (
            f"host time in the steps: {per_step}; the batches differ in shape, and the trials timed shapes their "
            "untimed warm pass had run, while the fit meets shapes this process has not run: work libraries do once "
            "per shape (cuDNN attention plans, GEMM heuristics) is paid in its steps and fades as shapes repeat"
        )
    elif gap_ms > 0 and host >= 0.5 * gap_ms:
        cause = f"host time in the steps: {per_step}; the host issues the steps more slowly than in the trials"
    elif gap_ms > 0:
        cause = (
            f"not data wait or host time ({per_step}): other work between steps (validation, checkpoints, "
            "a synchronizing callback) or a different clock or memory state"
        )
    else:
        cause = f"the fit ran faster than the trials measured ({per_step})"
    if compiled is not None and not cause.startswith(compiled):  # what compiled is said, cause or not
        note = "; ".join(n for n in (compiled, note) if n)
    return Holds(ladder, fit, gap, True, threshold, cause, note, between_ms)
