"""The report of a ladder run: ``report.json`` (for machines), ``report.md`` and ``report.html`` (for people).

``report.json`` is :meth:`speedkit.results.LadderResult.to_dict`, made JSON-safe (a NaN or
infinite float is written as ``null``; tuples become lists; anything else unknown becomes its
``str``). ``report.md`` (:func:`speedkit.report.markdown.render_markdown`) and ``report.html``
(:func:`speedkit.report.html.render_html`: one self-contained page with plots) are rendered from
that dict alone, so ``speedkit report DIR`` can render them again from a ``report.json``.
Schema version 3, field by field:

* ``schema_version`` (int) — ``4`` (``3``: before the ledger and the figures derived from it, whose
  figures the renderers derive from its rows; ``2``: before the profile, attribution, telemetry timeline
  and fit monitor). :func:`load_report` reads all three and refuses any other value.
* ``recipe`` (str | null) — the recipe's name, or null when the ladder ran without one.
* ``device`` (str) — the torch device measured, e.g. ``"cuda:0"`` or ``"cpu"``.
* ``environment`` (object) — :func:`speedkit.report.environment.collect_environment`; every key is
  present, null where it does not apply:

  - ``device``, ``python``, ``platform``, ``speedkit`` (``"0+unknown"`` in an uninstalled
    checkout), ``torch``, ``torch_cuda`` (the CUDA torch was built with), ``triton``,
    ``lightning`` (versions; null where not installed);
  - ``cpu_model``, ``cpu_count``, ``cpu_usable`` (CPUs this process may run on),
    ``torch_threads``;
  - on CUDA: ``gpu_name``, ``gpu_compute_capability`` (``"9.0"``), ``gpu_memory_bytes``,
    ``gpu_count`` (visible to CUDA), ``gpu_driver`` (via NVML; null without it), ``cudnn``.

* ``flops`` (object) — how MFU is counted, one convention for every rung:

  - ``per_step`` (int | null) — model FLOPs of one training step;
  - ``convention`` (str) — what ``per_step`` counts and what MFU divides by;
  - ``peak_tflops`` (float | null) — the peak MFU is reported against; null: no MFU;
  - ``peak_source`` (str) — where that peak came from (datasheet table, recipe override) or why
    there is none.

* ``measure`` (object) — the measurement settings used: ``configs/defaults.yaml``'s ``measure``
  section after the recipe's overrides (``warmup``, ``steps``, ``repeats``, ``parity_steps``,
  ``min_gain``, ``memory_gain``, ``confidence``, ``min_blocks``, ``max_blocks``, ``budget_s``,
  ``settle``, ``final_check``, ``holds_windows``, ``holds_threshold``, ``throughput_unit``,
  ``mfu_precision``, ``peak_tflops``, ``telemetry``).
* ``run`` (object) — the run the trials ran in: ``precision``, ``accumulate_grad_batches``,
  ``gradient_clip_val``, ``gradient_clip_algorithm``, ``strategy``, ``optimizer``,
  ``lr_schedulers`` (empty outside Lightning).
* ``rungs`` (list) — the baseline first, then one entry per ladder rung in the order tried:

  - ``name`` (str); ``status`` — ``"baseline"``, ``"kept"``, ``"reverted"`` (applied and
    measured, but not shown to pay, or off parity; undone), ``"not_applicable"`` (its check said
    why it cannot help here; never applied), ``"skipped"`` (not tried: the trials' time budget was
    spent before its turn; never applied), ``"failed"`` (raised; undone), ``"closing"`` (the
    configuration the closing check left after reverting a rung, or a second look after keeping
    one) or ``"interrupted"`` (being tried when the run was interrupted; undone);
  - ``options`` (object) — the rung's options as used;
  - ``reason`` (str | null) — why it was kept, reverted, not applicable or failed;
  - ``changes`` (list of str) — what applying it changed, one line each;
  - ``rewrite`` (object | null) — for a rung that rewrites the model's source, what it rewrote and
    left alone (:meth:`speedkit.rewrite.pipeline.RewriteReport.as_dict`: the site counts per kind,
    ``rewrites`` where listed, ``left_alone``); null for other rungs;
  - ``precision`` (str) — effective numerics with the rung applied (``"fp32"``, ``"tf32"``,
    ``"bf16"``...), which picks the parity tolerance;
  - ``measurement`` (object | null) — null when not measured:
    ``step_ms`` (median over windows of the mean step time), ``spread`` (the noise estimate, a
    fraction: 1.4826 · MAD / median of the window means, a robust relative standard deviation), ``window_ms`` (each window's mean), ``warmup``, ``steps``
    (per window), ``throughput`` and ``throughput_unit`` (``"tokens/s"`` or ``"samples/s"``, at
    the median step time), ``items_per_step``, ``mfu`` (fraction 0..1 | null), ``tflops``
    (achieved | null), ``peak_memory_bytes`` (``torch.cuda.max_memory_allocated`` over the timed
    steps | null), ``clock`` (``"cuda_events"`` or ``"perf_counter"``) and ``telemetry`` — null
    without a GPU, else the NVML summary of :class:`speedkit.measure.nvml.NvmlSampler`:
    ``samples``, ``util_mean``, ``util_max`` (%), ``mem_used_max_bytes``, ``power_mean_w``,
    ``power_max_w``, ``sm_clock_mean_mhz``, ``sm_clock_min_mhz``, ``clock_event_reasons`` (every
    reason seen, ``gpu_idle`` included), ``slowdown_reasons`` (power/thermal/hardware slowdowns
    only), ``slowdown_fraction`` (of samples), ``duration_s``, ``error`` (null, or why sampling
    stopped early); ``data_wait_ms`` (median per-step host time waiting for the batch: fetch,
    collate, copy) and ``host_ms`` (median per-step host time issuing the step). For a rung this
    is the configuration with it, from its comparison;
  - ``comparison`` (object | null) — the rung against the configuration before it, timed in
    interleaved A B B A blocks: ``speedup`` (with it over without, the exp of the mean per-block
    log ratio), ``low``/``high`` (its confidence interval), ``confidence``, ``blocks``,
    ``verdict`` (``"faster"``, ``"not_faster"``, ``"undecided"``), ``min_gain``, ``a`` and ``b``
    (measurements without and with it, from the same blocks), ``seconds``;
  - ``parity`` (object | null) — the loss trajectory against the state before the rung, same
    weights, batches and RNG: ``steps``, ``tolerance``, ``precision`` (whose tolerance),
    ``reference_losses``, ``losses``, ``max_rel_diff``, ``passed``;
  - ``figure`` (str | null, schema 4) — its one figure, the account's (``figures.rungs``): a kept
    rung's decided gain (``1.12× [1.05–1.19]``, or ``with its group (a + b): 1.53× [...]``), a rung
    not kept its last comparison's; null for a rung never timed (schema 3: ``gain_vs_previous``,
    ``gain_vs_baseline``, read no more);
  - ``seconds`` (float) — wall time spent on the rung, compilation included.

* ``final_check`` (object | null) — the final configuration against the baseline, interleaved,
  as a ``comparison``; null when nothing was kept.
* ``holds`` (object | null) — does the ladder's figure hold in training: ``ladder`` and ``fit``
  (measurements of the final configuration in the trials and in the fit's own next steps),
  ``gap`` (fit / ladder step time − 1), ``flagged`` (its size above ``threshold``), ``cause``
  (the likely cause of a flagged gap: data wait, host time, or neither), ``note``, ``between_ms``
  (ms per step of each of Lightning's profiler actions run between the fit's timed steps, largest
  first: ``[_TrainingEpochLoop].train_dataloader_next`` fetches the next batch, ``[Callback]X.hook``
  a callback's hook; empty outside a Trainer).
* ``interrupted`` (str | null) — what interrupted the run and where ("KeyboardInterrupt during
  sdpa"); the rungs are then those finished before it.
* ``parity_calibration`` (object) — per precision in play, how its parity tolerance was set on
  this model: ``epsilon`` (the rounding step applied to every weight and leaf module output),
  ``sensitivity`` (how far the baseline loss trajectory moved under it, relative, worst step),
  ``safety``, ``floor`` (``configs/tolerances.yaml``) and ``tolerance`` (max(floor, safety ·
  sensitivity)).
* ``summary`` (object) — the headline, from ``figures``: ``baseline_step_ms`` and ``final_step_ms``,
  ``baseline_throughput`` and ``final_throughput`` (the one baseline, and it over the chain),
  ``speedup`` (the headline's: the final check's, else the chain's product), ``speedup_ci`` (its interval, or null), ``shown`` (false where the
  interval holds 1.0), ``figures_from``, ``kept`` (names, in the final configuration's order),
  ``vs_switches`` (``[speedup, low, high]`` of the links on top of the user's switches, or null),
  ``switches_are_final``, ``check`` (the final check, a check of the chain), ``throughput_unit``,
  ``interrupted``.

New in schema version 4, where every printed figure comes from (:func:`speedkit.figures.account.account`):

* ``ledger`` (list) — every decision of the trials, in the order taken, never edited: ``phase``,
  ``names`` (kept or dropped together), ``kept`` (bool), ``comparisons`` (the paired comparisons whose
  product is their figure: ``speedup``, ``low``, ``high``, ``confidence``, ``blocks``, ``verdict``,
  ``min_gain``, ``power`` (-1: taken inverted, a member left out of its group), ``label``; empty where the
  decision stands on an earlier one's), ``why``.
* ``final_order`` (list of str) — the kept rungs in the final configuration's order.
* ``floor`` (list of str) — the user's switches kept as the floor.
* ``figures`` (object) — the account: ``baseline`` (the one baseline: the final check's baseline
  windows where there was one, else the baseline timed alone; ``step_ms``, ``throughput``, ``mfu``,
  ``spread``, ``source``), ``links`` (the chain: each ``names``, ``floor``, ``speedup``, ``low``, ``high``,
  ``verdict``, ``comparisons``, ``text``, ``vs_baseline`` (the product so far), ``step_ms``, ``throughput``,
  ``mfu``; where the final check timed the final configuration and the rungs' gains multiply to something
  else, a last link of no rung, ``together`` true and ``label``: the check over their product), ``rungs`` (per rung its one figure: ``kept``, ``link``, ``group``, ``speedup``, ``low``,
  ``high``, ``verdict``, ``text``), ``headline`` (the final check's figure where one was made, else the chain's product: ``speedup``,
  ``low``, ``high``, ``shown``, ``text``, ``from``, ``step_ms``, ``throughput``, ``mfu``), ``vs_switches``, ``switches_are_final``, ``check``
  (the final check: ``speedup``, ``low``, ``high``, ``verdict``, ``blocks``, ``text``, ``measured_in``,
  ``is_the_chain``), ``unit``, ``attribution`` (as below, at the chain's figures).

New in schema version 3; each may be absent or null (not measured in this run), and the renderers
then say so in one line:

* ``profile`` (object | null) — where the step's time goes, from ``torch.profiler`` windows run after
  the timed trials:

  - ``steps`` (int) — optimizer steps per profiled window;
  - ``categories`` (list of str) — the breakdown's categories in their fixed order:
    ``data_wait`` (host waiting for the batch), ``host_idle`` (the GPU idle while the host issues
    work), ``gemm``, ``attention``, ``normalization``, ``elementwise``, ``loss``, ``optimizer``,
    ``memcpy``, ``communication``, ``other``;
  - ``labels`` (object) — each category's name for people (``"host_idle"``: ``"host-bound idle GPU"``);
  - ``windows`` (list) — ``"baseline"``, then one per kept rung (the configuration after keeping
    it), then ``"final"``; each: ``label``, ``rungs`` (those applied), ``steps``, ``step_ms``,
    ``device``, ``breakdown_ms`` (ms per step of every category; they sum to about ``step_ms``),
    ``device_busy_fraction`` (0..1), ``top_ops`` (``name``, ``category``, ``ms`` per step, largest
    first), ``trace`` (the Chrome/Perfetto trace's path relative to the report's folder | null),
    ``trace_note`` (null, or why there is no trace), ``peak_memory_bytes`` (| null);
  - ``host_syncs`` (object) — per window label (``"baseline"``, ``"final"``), the places the host
    waited for the device: ``where`` (file:line in function), ``code``, ``reason``, ``count`` (per step);
  - ``note`` (str | null) — why profiling was skipped or partial.

* ``attribution`` (object | null) — what each kept rung bought, from the profiled windows, at the
  account's figures: ``rungs`` (each: ``name``, ``group``, ``speedup`` (its link's, on the link's first
  rung), ``figure`` (its one figure), ``ms_per_step`` (its link's change to the step time; negative is
  faster), ``share`` (of the whole gain, 0..1), ``moved`` (the categories it changed most: ``category``,
  ``before_ms``, ``after_ms``), ``peak_memory_delta_bytes``, ``line`` (all of it in one sentence)),
  ``product`` (the chain's, the headline), ``measured`` (the final check's speedup), ``agrees`` (bool:
  whether the two agree), ``interaction`` (null, or a sentence naming the rungs that interact).
* ``telemetry_timeline`` (object | null) — NVML sampled over one configuration's timed windows:
  ``interval_s``, ``label`` (which configuration), ``samples`` (each: ``t_s``, ``util`` (%),
  ``power_w``, ``power_limit_w``, ``sm_clock_mhz``, ``reasons`` (clock-event reasons in that
  sample: a confounder of the timing, ``gpu_idle`` aside)).
* ``fit_monitor`` (object | null) — the fit's own steps after the ladder: ``steps``,
  ``step_ms_median``, ``throughput``, ``throughput_unit``, ``mfu`` (| null), ``data_wait_ms``,
  ``peak_memory_bytes``, ``reserved_bytes``, ``alloc_retries`` (the caching allocator's retries
  after a failed allocation), ``overhead_note`` (what monitoring cost).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from speedkit.errors import ConfigError, OutputError
from speedkit.files import write_text_atomic
from speedkit.report.html import render_html
from speedkit.report.markdown import render_markdown
from speedkit.results import SCHEMA_VERSION, LadderResult

__all__ = ["FORMATS", "READS_SCHEMA_VERSIONS", "load_report", "render_html", "render_markdown", "to_json_safe", "write_report"]

#: what :func:`write_report` can write, and the file name of each
FORMATS = {"json": "report.json", "md": "report.md", "html": "report.html"}

#: the ``schema_version`` values :func:`load_report` reads (2: before the profile and attribution keys)
READS_SCHEMA_VERSIONS = tuple(sorted({2, 3, SCHEMA_VERSION}))


def write_report(
    result: LadderResult | Mapping[str, Any], out_dir: Path | str, formats: Iterable[str] = ("json", "md", "html")
) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` and/or ``report.html`` into ``out_dir`` (created if missing).

    ``report.html`` is written without its plots when matplotlib is missing (the page says so); that
    never fails the run.

    Returns:
        The path written for each format, e.g. ``{"json": out_dir / "report.json", ...}``.

    Each file is written whole or not at all (a temporary file renamed over it), so a failure
    leaves every file either complete or as it was before.

    Raises:
        ConfigError: a format other than those in :data:`FORMATS`, before anything is written.
        OutputError: a file could not be written (a full disk); its ``written`` holds the files
            written before it.
    """
    formats = tuple(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ConfigError("report.formats", f"unknown format(s) {unknown}; allowed: {sorted(FORMATS)}")
    d = to_json_safe(result.to_dict() if isinstance(result, LadderResult) else dict(result))
    texts = {}
    if "json" in formats:
        texts["json"] = json.dumps(d, indent=2, allow_nan=False, ensure_ascii=False) + "\n"
    if "md" in formats:
        texts["md"] = render_markdown(d)
    out_dir = Path(out_dir)
    if "html" in formats:
        texts["html"] = render_html(d, out_dir)
    written: dict[str, Path] = {}
    for fmt, text in texts.items():
        try:
            written[fmt] = write_text_atomic(out_dir / FORMATS[fmt], text)
        except OutputError as exc:
            exc.written = dict(written)
            raise
    return written


def load_report(path: Path | str) -> dict[str, Any]:
    """Read a ``report.json`` (or the one in a directory) of a schema version in
    :data:`READS_SCHEMA_VERSIONS` (2, 3 or 4).

    Raises:
        ConfigError: the file is missing, not JSON, not a report, or has another ``schema_version``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / FORMATS["json"]
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("report", f"{path} does not exist; pass a report.json or the directory speedkit wrote it to") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("report", f"{path} is not a JSON report ({exc})") from None
    except OSError as exc:
        raise ConfigError(
            "report", f"cannot read {path} ({exc.strerror or exc}); pass a report.json or the directory speedkit wrote it to"
        ) from None
    found = d.get("schema_version") if isinstance(d, dict) else None
    if type(found) is not int or found not in READS_SCHEMA_VERSIONS:
        if not isinstance(d, dict) or "rungs" not in d:
            raise ConfigError(
                "report",
                f"{path} is JSON but not a speedkit report (no schema_version and rungs); pass the report.json speedkit wrote",
            )
        versions = " or ".join(str(v) for v in READS_SCHEMA_VERSIONS)
        raise ConfigError(
            "report",
            f"{path} has schema_version {found!r}; this speedkit reads "
            f"schema_version {versions}. Re-run the ladder, or read it "
            "with the speedkit version that wrote it",
        )
    return d


def to_json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` and every container a dict or list."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [to_json_safe(v) for v in items]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return to_json_safe(value.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)
