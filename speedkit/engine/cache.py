"""The decision cache: what the trials kept on a model, so that a later fit of the same model re-checks
that decision in seconds instead of climbing again, and decides the same way every run.

A decision is stored under a key (:func:`decision_key`) of everything that could change it: the model's
structure (each module's type, each parameter's shape, dtype and whether it trains), the batches'
shapes and dtypes, the device (GPU model, or CPU model and threads), the versions of Python, torch,
Triton, Lightning and speedkit, the user's settings (precision, accumulation, clipping, strategy and
world size, optimizer and its implementation flags, schedulers) and the ladder itself (its rungs and
options, and the settings that decide: minimum gain, confidence, the switches). A changed key climbs
again; nothing in the cache hides a change, and the report says whether the decision came from it.

Entries are small JSON files in one folder: ``$SPEEDKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/speedkit``,
else ``~/.cache/speedkit`` (``decisions/<key>.json``). :meth:`DecisionCache.clear` (``speedkit cache
clear``) removes them. A file that cannot be read or written is a warning line, never a failed run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedkit.files import default_cache_dir

#: the entry's format; an entry of another is ignored (climbs again)
CACHE_FORMAT = 2


def model_structure(model: nn.Module) -> list[Any]:
    """Each module's path and type, each parameter's and buffer's path, shape, dtype and whether it trains."""
    modules = [(name, f"{type(m).__module__}.{type(m).__qualname__}") for name, m in model.named_modules()]
    params = [(name, list(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()]
    buffers = [(name, list(b.shape), str(b.dtype)) for name, b in model.named_buffers()]
    return [modules, params, buffers]


def optimizer_settings(optimizer: Any) -> Any:
    """The optimizer's class and the settings that choose its implementation (not its learning rate);
    of each, for a list of several (a manual-optimization step's)."""
    if optimizer is None:
        return None
    if isinstance(optimizer, (list, tuple)):
        return [optimizer_settings(o) for o in optimizer]
    flags = ("fused", "foreach", "capturable", "differentiable", "amsgrad", "nesterov", "maximize")
    groups = [{k: repr(g.get(k)) for k in flags if k in g} for g in getattr(optimizer, "param_groups", [])]
    return [f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", groups]


def decision_key(parts: dict[str, Any]) -> str:
    """The key of a decision: a hash of ``parts`` (every item of what could change it, JSON-able)."""
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def key_parts(
    model: nn.Module,
    optimizer: Any,
    batch_signature: Any,
    environment: dict[str, Any],
    run_info: dict[str, Any],
    ladder: list[tuple[str, dict[str, Any]]],
    deciding: dict[str, Any],
) -> dict[str, Any]:
    """What a decision depends on, as plain data (see the module docstring)."""
    device = {k: environment.get(k) for k in ("device", "gpu_name", "gpu_count", "cpu_model", "torch_threads")}
    versions = {k: environment.get(k) for k in ("python", "torch", "torch_cuda", "triton", "lightning", "speedkit")}
    return {
        "format": CACHE_FORMAT,
        "model": model_structure(model),
        "optimizer": optimizer_settings(optimizer),
        "batch": repr(batch_signature),
        "device": device,
        "versions": versions,
        "run": {k: v for k, v in run_info.items() if k not in ("attributes_restored", "attributes_not_restored")},
        "ladder": ladder,
        "deciding": deciding,
    }


@dataclasses.dataclass
class CachedDecision:
    """What the trials kept under a key, and the figures they measured for it."""

    key: str
    kept: list[str]  # the kept rungs, in the order the ladder applies them
    speedup: float | None = None  # the final configuration against the baseline (the headline figure)
    vs_switches: float | None = None  # against the user's switches, where measured
    trials_s: float | None = None  # what the climb that decided it took
    created: float = 0.0  # time.time() when stored
    speedkit: str | None = None
    #: the parity calibration per precision (:meth:`speedkit.engine.parity.ParityCheck.tolerance`): a
    #: re-check judges the decision against the envelopes the climb calibrated, not calibrating again
    calibration: dict[str, Any] | None = None
    #: the baseline's measurement (a Measurement's fields) and the comparisons' window length and noise
    baseline: dict[str, Any] | None = None
    #: the final check (a PairedResult's fields, its A and B windows among them): the headline a re-check
    #: reports, and the final configuration's step time it re-times
    final_check: dict[str, Any] | None = None
    #: where the climb ended without a final check: the final configuration's measurement it reported
    #: (a Measurement's fields; ``speedup`` is then the kept rungs' comparisons' product), re-timed instead
    final: dict[str, Any] | None = None
    #: what kept rungs chose by measuring (:meth:`speedkit.rungs.base.Rung.chosen`), per rung name: a
    #: re-check applies the same (:meth:`~speedkit.rungs.base.Rung.reuse`) without measuring again
    chosen: dict[str, Any] | None = None
    #: the final configuration's own loss trajectory over the parity steps (``losses``, dropout on: the
    #: graph the fit runs) and the digest of where it started (``digest``: the weights, optimizer state,
    #: random states and parity batches, :meth:`~speedkit.training.snapshot.Snapshot.digest`): a re-check
    #: from the same start judges its numerics against it, and compiles no graph with dropout off
    trajectory: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": CACHE_FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CachedDecision | None:
        """The entry, or None where it is of another format or malformed."""
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            return None
        try:
            return cls(
                key=str(data["key"]),
                kept=[str(n) for n in data["kept"]],
                speedup=None if data.get("speedup") is None else float(data["speedup"]),
                vs_switches=None if data.get("vs_switches") is None else float(data["vs_switches"]),
                trials_s=None if data.get("trials_s") is None else float(data["trials_s"]),
                created=float(data.get("created") or 0.0),
                speedkit=data.get("speedkit"),
                calibration=_mapping(data.get("calibration")),
                baseline=_mapping(data.get("baseline")),
                final_check=_mapping(data.get("final_check")),
                final=_mapping(data.get("final")),
                chosen=_mapping(data.get("chosen")),
                trajectory=_mapping(data.get("trajectory")),
            )
        except (KeyError, TypeError, ValueError):
            return None


def _mapping(value: Any) -> dict[str, Any] | None:
    """``value`` where it is a JSON object, else None (an entry's optional figures)."""
    return dict(value) if isinstance(value, dict) else None


class DecisionCache:
    """Decisions kept as JSON files under ``root`` (default: :func:`default_cache_dir`)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    @property
    def folder(self) -> Path:
        return self.root / "decisions"

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def load(self, key: str) -> CachedDecision | None:
        """The decision stored under ``key``, or None (none, or unreadable: climb again)."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        entry = CachedDecision.from_dict(data)
        return entry if entry is not None and entry.key == key else None

    def store(self, entry: CachedDecision) -> Path:
        """Write ``entry`` (atomically: a reader never sees half a file). Raises OSError where it cannot."""
        entry.created = entry.created or time.time()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(entry.key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry.to_dict(), indent=1, default=str))  # NaN as JSON's NaN: read back as such
        os.replace(tmp, path)
        return path

    def forget(self, key: str) -> None:
        """Remove the decision under ``key`` (it did not hold)."""
        try:
            self.path(key).unlink()
        except OSError:
            pass

    def entries(self) -> list[CachedDecision]:
        """Every readable decision, newest first."""
        out = []
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            try:
                entry = CachedDecision.from_dict(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
            if entry is not None:
                out.append(entry)
        return sorted(out, key=lambda e: e.created, reverse=True)

    def clear(self) -> int:
        """Remove every decision; returns how many files were removed."""
        removed = 0
        for path in self.folder.glob("*.json") if self.folder.is_dir() else []:
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
        return removed


def batch_signature_of(batch: Any) -> Any:
    """A batch's structure, shapes and dtypes (not its device: a fit on another GPU of the same kind
    keeps the key; the device's kind is in the key on its own)."""
    from speedkit.data.batch import batch_leaves, map_batch

    structure = map_batch(lambda leaf: None, batch)
    leaves = tuple(
        (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else ("leaf", type(t).__name__) for t in batch_leaves(batch)
    )
    return repr(structure), leaves
