"""report.json / report.md / console table, from a hand-built LadderResult."""

from __future__ import annotations

import json
import math

import pytest
import torch
from rich.console import Console

from speedkit.errors import ConfigError
from speedkit.report import load_report, to_json_safe, write_report
from speedkit.report.console import render_console
from speedkit.report.environment import collect_environment
from speedkit.report.markdown import MISSING, render_markdown
from speedkit.results import (
    SCHEMA_VERSION,
    Decision,
    LadderResult,
    Measurement,
    PairedResult,
    Parity,
    RungResult,
    comparison_figure,
)

CONVENTION = "FLOPs per step = what torch.utils.flop_counter counts; MFU against the bf16 peak."


def _measurement(
    step_ms: float, *, mfu: float | None = 0.1, memory: int | None = 2_000_000_000, telemetry: dict | None = None
) -> Measurement:
    tokens = 16 * 1024
    return Measurement(
        step_ms=step_ms,
        spread=0.012,
        window_ms=[step_ms * 0.99, step_ms, step_ms * 1.002],
        warmup=3,
        steps=10,
        throughput=tokens / (step_ms / 1000),
        throughput_unit="tokens/s",
        items_per_step=tokens,
        mfu=mfu,
        tflops=None if mfu is None else mfu * 784,
        peak_memory_bytes=memory,
        telemetry=telemetry,
        clock="cuda_events",
    )


def _parity(passed: bool, max_rel: float) -> Parity:
    return Parity(
        steps=3,
        tolerance=1e-2,
        precision="bf16",
        reference_losses=[10.9, 10.5, 10.1],
        losses=[10.9, 10.5 * (1 + max_rel), 10.1],
        max_rel_diff=max_rel,
        passed=passed,
    )


@pytest.fixture
def result() -> LadderResult:
    telemetry = {
        "samples": 20,
        "util_mean": 97.5,
        "util_max": 100.0,
        "mem_used_max_bytes": 31_000_000_000,
        "power_mean_w": 650.0,
        "power_max_w": 700.0,
        "sm_clock_mean_mhz": 1950.0,
        "sm_clock_min_mhz": 1755.0,
        "clock_event_reasons": ["gpu_idle", "sw_power_cap"],
        "slowdown_reasons": ["sw_power_cap"],
        "slowdown_fraction": 0.25,
        "duration_s": 2.0,
        "error": None,
    }
    baseline = RungResult(
        "baseline",
        "baseline",
        measurement=_measurement(365.9, telemetry=telemetry),
        seconds=12.0,
    )
    tf32 = RungResult(
        "tf32",
        "kept",
        reason="2.62x faster, parity within tolerance",
        changes=["torch.set_float32_matmul_precision('high') (was 'highest')"],
        precision="tf32",
        measurement=_measurement(139.7, mfu=None),
        parity=_parity(True, 1.2e-3),
        comparison=PairedResult(2.62, 2.55, 2.69, 0.95, 6, "faster", 0.01),
        seconds=5.0,
    )
    fused = RungResult(
        "fused_optimizer",
        "reverted",
        options={"foreach": False},
        reason="not faster beyond noise (1.004x, spread 1.2%)",
        precision="tf32",
        measurement=_measurement(139.2, memory=None),
        parity=_parity(True, 0.0),
        comparison=PairedResult(1.004, 0.99, 1.018, 0.95, 8, "undecided", 0.01),
        seconds=4.0,
    )
    autocast = RungResult(
        "autocast", "not_applicable", options={"dtype": "bf16"}, reason="the model already runs in bf16 | nothing to do"
    )
    compile_ = RungResult(
        "compile",
        "failed",
        options={"mode": "default", "fullgraph": False},
        reason="torch._dynamo.exc.Unsupported: [graph break]\nsecond line",
        changes=["torch.compile(model)"],
        precision="tf32",
        seconds=30.5,
        parity=_parity(False, float("nan")),
    )
    return LadderResult(
        schema_version=SCHEMA_VERSION,
        recipe="gpt2-naive",
        environment=collect_environment(torch.device("cpu")),
        device="cpu",
        flops={
            "per_step": 1_745_000_000_000,
            "convention": CONVENTION,
            "peak_tflops": 784.0,
            "peak_source": "measured bf16 GEMM ceiling",
        },
        measure={"warmup": 3, "steps": 10, "repeats": 3, "peak_tflops": None},
        rungs=[baseline, tf32, fused, autocast, compile_],
        ledger=[
            Decision("the climb", ["tf32"], True, [comparison_figure(tf32.comparison)], "faster"),
            Decision("the climb", ["fused_optimizer"], False, [comparison_figure(fused.comparison)], "undecided"),
        ],
        final_order=["tf32"],
    )


def test_write_report_writes_both_files_and_json_round_trips(result, tmp_path):
    paths = write_report(result, tmp_path / "out")
    assert set(paths) == {"json", "md", "html"}
    assert paths["json"].name == "report.json" and paths["json"].is_file()
    assert paths["md"].name == "report.md" and paths["md"].is_file()

    d = load_report(paths["json"])
    assert d == load_report(tmp_path / "out")  # a directory finds its report.json
    assert d["schema_version"] == SCHEMA_VERSION
    assert [r["name"] for r in d["rungs"]] == ["baseline", "tf32", "fused_optimizer", "autocast", "compile"]
    assert d["summary"]["kept"] == ["tf32"]
    assert d["summary"]["speedup"] == pytest.approx(2.62)
    assert d["summary"]["baseline_step_ms"] == pytest.approx(365.9)
    assert d["summary"]["final_step_ms"] == pytest.approx(365.9 / 2.62)  # the one baseline over the chain
    assert d["summary"]["throughput_unit"] == "tokens/s"
    # NaN is not JSON: it is written as null, and the file is strict JSON.
    assert d["rungs"][4]["parity"]["max_rel_diff"] is None
    json.loads(paths["json"].read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert d["environment"]["gpu_name"] is None and d["environment"]["torch"] == torch.__version__


def test_write_report_single_format_and_unknown_format(result, tmp_path):
    assert set(write_report(result, tmp_path, formats=("json",))) == {"json"}
    assert not (tmp_path / "report.md").exists()
    with pytest.raises(ConfigError, match="pdf"):
        write_report(result, tmp_path / "never", formats=("json", "pdf"))
    assert not (tmp_path / "never").exists()


def test_markdown_has_every_rung_status_missing_value_and_convention(result):
    md = render_markdown(to_json_safe(result.to_dict()))
    for name in ("baseline", "tf32", "fused_optimizer", "autocast", "compile"):
        assert f"| {name} |" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 5  # header + one row per rung
    rows = {line.split(" | ")[0][2:]: line for line in table[1:]}
    assert "| baseline |" in rows["baseline"]
    assert "| kept |" in rows["tf32"]
    assert "| reverted |" in rows["fused_optimizer"]
    assert "| n/a |" in rows["autocast"]
    assert "| failed |" in rows["compile"]
    # a kept rung: the chain's step time, throughput and MFU after it; a rung not kept: only its own figure
    assert rows["tf32"].split(" | ")[2] == "139.7" and rows["tf32"].split(" | ")[7] == "2.62×"
    assert rows["fused_optimizer"].split(" | ")[2:8] == [MISSING] * 4 + ["1.00× [0.99–1.02]", MISSING]
    assert rows["autocast"].split(" | ")[2:8] == [MISSING] * 6
    assert "365.9 ± 1.2%" in rows["baseline"] and "44.8k tokens/s" in rows["baseline"]
    assert "2.62×" in rows["tf32"] and "✓ 1.2e-03 (tol 1e-02)" in rows["tf32"]
    assert "✗ —" in rows["compile"]
    # A pipe in a reason must not split the table; a newline must not end the line.
    assert "already runs in bf16 \\| nothing to do" in md
    assert "[graph break] second line" in md
    assert CONVENTION in md and "measured bf16 GEMM ceiling" in md
    assert "44.8k → 117.3k tokens/s (2.62× [2.55–2.69] the baseline" in md and "kept: tf32" in md
    assert "sw_power_cap" in md and "97.5% mean" in md  # telemetry details
    assert "| 1 | 10.500000 | 10.512600 | 1.20e-03 |" in md  # parity losses


def test_markdown_of_minimal_dict_does_not_crash():
    md = render_markdown({"schema_version": 2, "rungs": [{"name": "baseline", "status": "baseline"}]})
    assert "| baseline | baseline |" in md and MISSING in md


def test_console_table_names_every_rung(result):
    console = Console(record=True, width=200, color_system=None)
    render_console(to_json_safe(result.to_dict()), console)
    text = console.export_text()
    for name in ("baseline", "tf32", "fused_optimizer", "autocast", "compile"):
        assert name in text
    assert "n/a" in text and "reverted" in text and "failed" in text
    assert "[graph break] second line" in text  # as written, not eaten as rich markup; one line


def test_load_report_rejects_other_schema_versions(result, tmp_path):
    path = write_report(result, tmp_path, formats=("json",))["json"]
    d = json.loads(path.read_text())
    for bad in (1, None, "2"):
        d["schema_version"] = bad
        path.write_text(json.dumps(d))
        with pytest.raises(ConfigError, match="schema_version") as info:
            load_report(path)
        assert info.value.where == "report"
    path.write_text("not json")
    with pytest.raises(ConfigError, match="not a JSON report"):
        load_report(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_report(tmp_path / "missing.json")


def test_to_json_safe():
    assert to_json_safe({"a": (1, float("inf")), 2: {float("nan")}, "t": torch.tensor(1.5), "d": torch.float32}) == {
        "a": [1, None],
        "2": [None],
        "t": 1.5,
        "d": "torch.float32",
    }
    assert not math.isnan(to_json_safe(0.5))


def test_collect_environment_on_cpu():
    env = collect_environment(torch.device("cpu"))
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert env["gpu_name"] is None and env["gpu_driver"] is None
    assert isinstance(env["speedkit"], str) and env["cpu_count"] >= 1
    json.dumps(env)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_collect_environment_on_gpu():
    env = collect_environment(torch.device("cuda"))
    assert env["gpu_name"] == torch.cuda.get_device_name(0)
    assert env["gpu_count"] == torch.cuda.device_count() and env["gpu_memory_bytes"] > 0
    json.dumps(env)


def test_the_fit_check_names_the_likely_cause_of_a_gap():
    from speedkit.measure.holds import judge_holds

    def m(step, wait, host, clock="cuda_events", spread=0.01):
        return Measurement(step, spread, [step], 1, 10, 1.0, "samples/s", 1, clock=clock, data_wait_ms=wait, host_ms=host)

    held = judge_holds(m(30.0, 0.2, 5.0), m(30.9, 0.3, 5.1), 0.05)
    assert not held.flagged and held.gap == pytest.approx(0.03) and held.cause is None
    loader = judge_holds(m(30.0, 0.2, 5.0), m(40.0, 9.5, 5.1), 0.05)
    assert loader.flagged and loader.cause.startswith("time between steps")
    host = judge_holds(m(30.0, 0.2, 25.0), m(40.0, 0.3, 34.0), 0.05)
    assert host.flagged and host.cause.startswith("host time in the steps")
    faster = judge_holds(m(30.0, 0.2, 5.0), m(25.0, 0.2, 5.0), 0.05)
    assert faster.flagged and faster.cause.startswith("the fit ran faster")
    cpu = judge_holds(m(50.0, 0.3, 49.0, "perf_counter"), m(60.0, 0.5, 59.0, "perf_counter"), 0.05)
    assert cpu.flagged and cpu.cause.startswith("on a CPU")
    shapes = judge_holds(m(30.0, 0.2, 25.0), m(40.0, 0.3, 34.0), 0.05, shapes_vary=True)
    assert shapes.flagged and "the fit meets shapes this process has not run" in shapes.cause
    compiled = judge_holds(
        m(50.0, 0.3, 49.0, "perf_counter"), m(900.0, 0.5, 899.0, "perf_counter"), 0.05, None, "torch.compile compiled"
    )
    assert compiled.flagged and compiled.cause.startswith("torch.compile compiled (")  # before the CPU's own noise
    compiled_held = judge_holds(m(30.0, 0.2, 5.0), m(30.9, 0.3, 5.1), 0.05, "1 of 3 windows", "torch.compile compiled")
    assert not compiled_held.flagged and compiled_held.note == "torch.compile compiled; 1 of 3 windows"
    # flagged for another cause (the fit faster on a CPU): what compiled is still said, in the note
    compiled_faster = judge_holds(
        m(50.0, 0.3, 49.0, "perf_counter"), m(40.0, 0.5, 39.0, "perf_counter"), 0.05, "1 of 3 windows", "torch.compile compiled"
    )
    assert compiled_faster.flagged and compiled_faster.cause.startswith("on a CPU")
    assert compiled_faster.note == "torch.compile compiled; 1 of 3 windows"
    ema = judge_holds(
        m(40.7, 0.8, 39.9),
        m(47.6, 6.9, 40.1),
        0.05,
        between_ms={
            "[Callback]WeightAveraging.on_train_batch_end": 5.9,
            "[_TrainingEpochLoop].train_dataloader_next": 0.4,
            "[LightningModule]Net.on_train_batch_end": 0.01,
        },
    )
    assert ema.flagged and ema.between_ms["[Callback]WeightAveraging.on_train_batch_end"] == 5.9
    assert ema.cause.startswith(
        "time between steps: 6.90 ms/step between steps (of it, ms/step: WeightAveraging.on_train_batch_end "
        "5.90, fetching the next batch 0.40) and 40.10 ms/step in them"
    )
    assert "per-batch hooks of the fit that the trials do not run" in ema.cause
    slow_loader = judge_holds(
        m(30.0, 0.2, 5.0), m(40.0, 9.5, 5.1), 0.05, between_ms={"[_TrainingEpochLoop].train_dataloader_next": 9.1}
    )
    assert "(of it, ms/step: fetching the next batch 9.10)" in slow_loader.cause
    assert slow_loader.cause.endswith("the next batch: the loader does not keep up (workers, pinned memory, prefetch)")
    # the move to the device runs in the trials too: the hook the trials lack is named as the cause (H100, ConvNeXt-T)
    convnext = judge_holds(
        m(46.8, 11.8, 34.9),
        m(61.3, 19.4, 42.1),
        0.05,
        between_ms={
            "[Strategy]SingleDeviceStrategy.batch_to_device": 7.25,
            "[Callback]WeightAveraging.on_train_batch_end": 4.74,
            "[_TrainingEpochLoop].train_dataloader_next": 0.89,
        },
    )
    assert "per-batch hooks of the fit that the trials do not run" in convnext.cause
    # H100, lstm-lm after 98 s of trials: the fetch and the move took what they took in the trials; the host ran
    # the whole loop (between the steps and in them) more slowly: not the loader
    host_wide = judge_holds(
        m(10.35, 0.31, 9.68),
        m(11.32, 0.91, 10.46),
        0.05,
        between_ms={"[Strategy]SingleDeviceStrategy.batch_to_device": 0.20, "[_TrainingEpochLoop].train_dataloader_next": 0.12},
    )
    assert host_wide.flagged and "host time between and in the steps alike" in host_wide.cause
    assert "loader" not in host_wide.cause
    fetch_as_in_trials = judge_holds(
        m(10.35, 0.31, 9.68),
        m(11.32, 1.28, 9.70),
        0.05,
        between_ms={"[Strategy]SingleDeviceStrategy.batch_to_device": 0.20, "[_TrainingEpochLoop].train_dataloader_next": 0.30},
    )
    assert fetch_as_in_trials.cause.endswith(
        "the loop's own per-batch work outside its hooks (its logging and metrics bookkeeping, a progress bar)"
    )
    bookkeeping = judge_holds(
        m(30.0, 0.2, 5.0),
        m(40.0, 9.5, 5.1),
        0.05,
        between_ms={"[_TrainingEpochLoop].train_dataloader_next": 0.3, "[Callback]Bar.on_train_batch_end": 0.2},
    )
    assert "no Lightning hook (the loop's own bookkeeping) 9.00" in bookkeeping.cause
    assert bookkeeping.cause.endswith(
        "the loop's own per-batch work outside its hooks (its logging and metrics bookkeeping, a progress bar)"
    )
    validating = judge_holds(
        m(51.4, 15.5, 36.0),
        m(330.0, 289.4, 39.6),
        0.05,  # H100: ResNet-50 validated every 4 steps
        between_ms={
            "[Callback]ModelCheckpoint{'monitor': 'val_loss'}.on_validation_end": 187.1,
            "[_EvaluationLoop].val_next": 25.3,
            "[Strategy]SingleDeviceStrategy.validation_step": 11.7,
            "[Strategy]SingleDeviceStrategy.batch_to_device": 14.6,
        },
    )
    assert "(of it, ms/step: ModelCheckpoint.on_validation_end 187.10, no Lightning hook" in validating.cause
    assert "validation and checkpoints ran between the timed steps" in validating.cause
    missing = judge_holds(m(30.0, 0.2, 5.0), None, 0.05, "the fit ran 2 steps")
    assert missing.gap is None and not missing.flagged and missing.note == "the fit ran 2 steps"


def test_the_in_training_line_keeps_its_note_when_flagged():
    from speedkit.report.markdown import holds_line

    h = {
        "ladder": {"step_ms": 30.0},
        "fit": {"step_ms": 40.0, "spread": 0.01},
        "gap": 0.333,
        "flagged": True,
        "threshold": 0.05,
        "cause": "host time in the steps",
        "note": "1 window left out: torch.compile compiled",
    }
    line = holds_line({"holds": h})
    assert "Likely cause: host time in the steps." in line and line.endswith("(1 window left out: torch.compile compiled)")


@pytest.mark.parametrize("seed", range(3))
def test_the_headline_is_one_measurement_under_drift_and_noise(seed):
    """The baseline timed alone at the start of a drifting run is slower or faster than it is by the
    final check: the headline's throughputs, step times and speedup all come from the final check's
    blocks, so they agree (make demo printed "27.8k -> 74.1k tokens/s (1.68x)")."""
    from fakes import SpeedRung, VirtualTime, timed_state

    from speedkit.engine.ladder import Ladder
    from speedkit.report.markdown import summary_line

    time = VirtualTime(drift=0.6, noise=0.05, seed=seed, horizon=400)
    measure = {
        "warmup": 1,
        "steps": 3,
        "repeats": 3,
        "parity_steps": 3,
        "telemetry": False,
        "min_blocks": 3,
        "max_blocks": 12,
        "budget_s": 1e9,
    }
    result = Ladder(timed_state(time), [SpeedRung("x", time, 0.01, -1 / 3)], measure, clock=time.clock(), host_clock=time).run()
    d = result.to_dict()
    s = d["summary"]
    assert s["kept"] == ["x"] and d["figures"]["baseline"]["source"] == "the final check's baseline windows"
    # one baseline, the final check's (the latest): every figure of the report is derived from it and the chain
    assert s["baseline_step_ms"] == result.final_check.a.step_ms
    assert s["baseline_step_ms"] / s["final_step_ms"] == pytest.approx(s["speedup"], rel=1e-9)
    assert s["final_throughput"] / s["baseline_throughput"] == pytest.approx(s["speedup"], rel=1e-9)
    assert s["speedup"] == result.final_check.speedup  # the final configuration, measured directly
    assert s["baseline_step_ms"] > result.baseline.measurement.step_ms * 1.05  # the run drifted since the baseline
    assert "note:" not in summary_line(d) and "checked against" not in summary_line(d)  # the headline is the check


def test_the_final_check_is_the_headline_and_the_chain_ends_on_what_the_rungs_do_together(result):
    from speedkit.report.markdown import summary_line
    from speedkit.results import PairedResult

    result.final_check = PairedResult(1.2, 1.1, 1.3, 0.95, 6, "faster", 0.01, a=_measurement(300.0), b=_measurement(200.0))
    d = result.to_dict()
    s = d["summary"]
    # one baseline (the final check's, the latest), one figure: the final check's, the final configuration
    # measured directly; the rungs' gains (2.62x together) do not compose to it, and the chain says so
    assert (s["baseline_step_ms"], s["speedup"]) == (300.0, 1.2) and s["final_step_ms"] == pytest.approx(300.0 / 1.2)
    assert s["speedup_ci"] == [1.1, 1.3]
    *rungs, together = d["figures"]["links"]
    assert together["together"] and together["names"] == [] and together["speedup"] == pytest.approx(1.2 / 2.62)
    assert math.prod(link["speedup"] for link in rungs) == pytest.approx(2.62)
    line = summary_line(d)
    assert "(1.20× [1.10–1.30] the baseline;" in line
    assert "checked against" not in line  # the headline is the check: no second line for it
    assert s["check"]["speedup"] == 1.2 and s["check"]["is_the_chain"]
    result.final_check = None  # no final check: the baseline timed alone, and no check printed
    d = result.to_dict()
    assert d["figures"]["baseline"]["source"] == "the baseline timed alone" and d["summary"]["check"] is None
    assert "checked against" not in summary_line(d)
