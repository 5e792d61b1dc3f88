"""The report's "Across ranks" section (a run under DDP): each rank's step time, data wait, host time
and peak memory in the baseline and the final configuration, the slowest rank named, and the scaling
efficiency the ladder measured. Empty for a run on one process."""

from __future__ import annotations

from typing import Any


def _measurements(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, measurement) of the baseline and the final configuration where they hold rank figures."""
    fc = d.get("final_check") or {}
    base = fc.get("a") or next((r.get("measurement") for r in d.get("rungs") or [] if r.get("status") == "baseline"), None)
    final = fc.get("b")
    return [(label, m) for label, m in (("baseline", base), ("final", final)) if m and m.get("ranks")]


def rank_rows(d: dict[str, Any]) -> list[tuple[str, str, float, float, float, int | None]] | None:
    """(configuration, rank, step ms, data wait ms, host ms, peak bytes) of each rank in the baseline
    and the final configuration, the slowest rank marked; None where the run had one process."""
    found = _measurements(d)
    if not found:
        return None
    rows = []
    for label, m in found:
        slowest = max(m["ranks"], key=lambda r: r.get("step_ms") or 0.0)["rank"]
        for r in m["ranks"]:
            mark = " (slowest)" if r["rank"] == slowest and len(m["ranks"]) > 1 else ""
            rows.append((label, f"{r['rank']}{mark}", r["step_ms"], r["data_wait_ms"], r["host_ms"], r.get("peak_memory_bytes")))
    return rows


#: the per-rank table's columns
HEADERS = ("configuration", "rank", "step ms", "data wait ms", "host ms", "peak memory")


def scaling_line(d: dict[str, Any]) -> str | None:
    """The scaling efficiency the ladder measured, in one line; None where it did not."""
    s = (d.get("run") or {}).get("scaling")
    if not s:
        return None
    if s.get("efficiency") is None:
        bound = s.get("efficiency_at_least")
        at_least = (
            f"; at least {bound:.2f} from the profile (1 - the share of its step the rank the others wait for spent "
            "in collectives: what one GPU would save were every collective exposed)"
            if bound is not None
            else ""
        )
        return f"Scaling efficiency: not measured ({s.get('note', 'no reason recorded')}){at_least}"
    return (
        f"Scaling efficiency over {s['world_size']} ranks: {s['efficiency']:.2f} (the final configuration's step "
        f"with DDP's gradient all-reduce, {s['step_ms_synced']:.2f} ms, against the same step without it, "
        f"{s['step_ms_unsynced']:.2f} ms: what one GPU runs with this per-rank batch; {s['note']})"
    )


#: the run's per-rank communication figures, in the report's order: the floor's profile (the step the
#: rungs were judged on), then the final configuration's
COMMUNICATION_KEYS = ("ranks_communication", "ranks_communication_final")


def communication_lines(d: dict[str, Any], key: str = "ranks_communication") -> list[str]:
    """Each rank's share of its profiled step in collectives, one line a rank: ``key``
    "ranks_communication" the diagnosis's profile window (the step the rungs were judged on),
    "ranks_communication_final" the final configuration's; [] where the run had one process or no profile."""
    found = (d.get("run") or {}).get(key)
    if not found:
        return []
    lines = []
    for r in found["ranks"]:
        if r.get("share") is None:
            lines.append(f"rank {r['rank']}: no profile of collectives")
        else:
            lines.append(
                f"rank {r['rank']}: {r['communication_ms']:.2f} ms of collectives in a {r['step_ms']:.2f} ms step "
                f"({r['share']:.0%}; they overlap the compute, so the step waits for part of it at most)"
            )
    return [f"Communication ({found['of']}, from the profile):", *lines]
