"""The diagnosis of a step (speedkit.engine.diagnose): each class from synthetic step figures (a
Measurement and a ProfileWindow built directly, nothing run or timed), the precedence between them,
the summary lines, the shares a rung's targets take, and the JSON round trip."""

from __future__ import annotations

import json

import pytest

from speedkit.engine.diagnose import KINDS, Diagnosis, diagnose
from speedkit.errors import ConfigError
from speedkit.profile.categories import CATEGORIES
from speedkit.profile.window import ProfileWindow
from speedkit.results import Measurement

TRANSFORMER_SYNC = {
    "where": "torch/nn/modules/transformer.py:1252 in _detect_is_causal_mask",
    "code": "make_causal = bool((mask == causal_comparison).all())",
    "count": 1,
}


def _measurement(step, *, wait=None, host=None, util=None, peak=None, clock="cuda_events", spread=0.02):
    return Measurement(
        step,
        spread,
        [step],
        1,
        10,
        1.0,
        "samples/s",
        1,
        peak_memory_bytes=peak,
        telemetry={"util_mean": util} if util is not None else None,
        clock=clock,
        data_wait_ms=wait,
        host_ms=host,
    )


def _window(step, *, device="cuda", busy=None, peak=None, **ms):
    return ProfileWindow(
        label="baseline",
        steps=3,
        step_ms=step,
        breakdown_ms={c: float(ms.get(c, 0.0)) for c in CATEGORIES},
        device=device,
        device_busy_fraction=busy,
        peak_memory_bytes=peak,
    )


def test_a_step_waiting_for_its_batches_is_data_bound():
    # the ResNet-18 with per-sample CPU augmentation: 211.7 of 227.1 ms waiting for batches
    d = diagnose(_measurement(227.1, wait=211.7, host=14.0, util=6.0))
    assert d.kind == "data-bound"
    assert d.summary() == "data-bound: 211.7 of 227.1 ms per step waiting for batches (93%)"
    assert "211.7 of 227.1 ms" in d.rule


def test_the_data_bound_threshold_is_the_defaults_and_can_be_overridden():
    assert diagnose(_measurement(100.0, wait=29.0, host=70.0, util=99.0)).kind == "device-bound"
    assert diagnose(_measurement(100.0, wait=31.0, host=68.0, util=99.0)).kind == "data-bound"
    assert diagnose(_measurement(100.0, wait=20.0, host=79.0, util=99.0), thresholds={"data_bound_share": 0.15}).kind == (
        "data-bound"
    )
    with pytest.raises(ConfigError, match=r"diagnosis\.data_bound: unknown threshold"):
        diagnose(_measurement(100.0), thresholds={"data_bound": 0.15})


def test_a_host_issuing_most_of_the_step_to_an_idle_gpu_is_host_bound():
    profile = _window(30.0, busy=0.15, gemm=2.5, elementwise=2.0, host_idle=25.5)
    d = diagnose(_measurement(24.4, wait=0.3, host=23.9, util=32.0), profile, syncs=[])
    assert d.kind == "host-bound"
    assert d.summary() == "host-bound: 23.9 of 24.4 ms per step issuing work, the GPU busy 15%"


def test_host_bound_without_a_profile_reads_nvml():
    d = diagnose(_measurement(24.4, host=23.9, util=32.0))
    assert d.kind == "host-bound"
    assert d.summary() == "host-bound: 23.9 of 24.4 ms per step issuing work, the GPU busy 32%"
    # NVML saw the GPU busy: the host waited for it at a sync, it did not set the pace
    assert diagnose(_measurement(340.2, host=339.5, util=99.0)).kind == "device-bound"


def test_the_profiles_busy_fraction_overrides_nvml():
    # NVML counts a sample busy where any kernel ran; the profile's union of kernel intervals says 97%
    profile = _window(341.0, busy=0.97, gemm=300.0, elementwise=30.0, host_idle=10.0)
    d = diagnose(_measurement(340.2, host=339.5, util=80.0), profile, syncs=[])
    assert d.kind == "device-bound"
    # and the other way round: NVML at 95%, the profile 40% busy
    profile = _window(25.0, busy=0.4, gemm=8.0, elementwise=2.0, host_idle=15.0)
    assert diagnose(_measurement(24.4, host=23.9, util=95.0), profile, syncs=[]).kind == "host-bound"


def test_syncs_with_a_device_both_idle_and_busy_make_a_step_sync_bound():
    profile = _window(26.0, busy=0.45, gemm=8.0, attention=2.0, elementwise=1.7, host_idle=14.0)
    d = diagnose(_measurement(24.4, wait=0.2, host=24.0, util=60.0), profile, syncs=[TRANSFORMER_SYNC])
    assert d.kind == "sync-bound"
    assert d.also == ["host-bound"]
    assert d.summary() == (
        "sync-bound: 1 host sync per step (torch/nn/modules/transformer.py:1252 in _detect_is_causal_mask); "
        "the GPU idle 54% and busy 45% of the 24.4 ms step"
    )
    two = dict(TRANSFORMER_SYNC, where="model.py:40 in training_step", count=2)
    assert "3 host syncs per step (torch/nn/modules/transformer.py:1252 in _detect_is_causal_mask and 1 other line)" in (
        diagnose(_measurement(24.4, host=24.0), profile, syncs=[TRANSFORMER_SYNC, two]).summary()
    )


def test_syncs_behind_a_host_that_keeps_the_device_idle_anyway_are_host_bound():
    # the device busy 10%: the host's own issuing sets the pace, with or without the syncs
    profile = _window(26.0, busy=0.10, gemm=2.0, elementwise=0.6, host_idle=23.4)
    d = diagnose(_measurement(24.4, host=24.0, util=30.0), profile, syncs=[TRANSFORMER_SYNC])
    assert d.kind == "host-bound"
    # and syncs on a busy device cost little: device-bound
    profile = _window(50.0, busy=0.95, gemm=40.0, elementwise=7.0, host_idle=2.5)
    assert diagnose(_measurement(49.0, host=48.5, util=99.0), profile, syncs=[TRANSFORMER_SYNC]).kind == "device-bound"


def test_a_step_near_the_devices_memory_is_memory_bound():
    gb = 10**9
    d = diagnose(_measurement(50.0, host=10.0, util=99.0, peak=75 * gb), memory_capacity_bytes=80 * gb)
    assert d.kind == "memory-bound"
    assert d.summary() == "memory-bound: peak 75.0 of 80.0 GB of device memory (94%)"
    # the profile window's peak counts too
    profile = _window(50.0, busy=0.98, peak=76 * gb, gemm=45.0)
    assert diagnose(_measurement(50.0, host=10.0, peak=60 * gb), profile, memory_capacity_bytes=80 * gb).kind == "memory-bound"
    assert diagnose(_measurement(50.0, host=10.0, peak=70 * gb), memory_capacity_bytes=80 * gb).kind == "device-bound"
    # unknown capacity: no memory class
    assert diagnose(_measurement(50.0, host=10.0, peak=79 * gb)).kind == "device-bound"


def test_a_device_bound_step_names_its_largest_categories():
    profile = _window(50.0, busy=0.99, gemm=30.5, attention=9.0, elementwise=4.5, normalization=2.0, optimizer=1.5, other=0.5)
    d = diagnose(_measurement(50.0, host=49.0, util=99.0), profile, syncs=[])
    assert d.kind == "device-bound"
    assert d.summary() == "device-bound: GEMM 61%, attention 18%, elementwise 9%"
    assert [t["category"] for t in d.top_categories] == ["gemm", "attention", "elementwise"]
    assert d.top_categories[0]["share"] == pytest.approx(0.61)


def test_a_device_bound_step_without_a_profile_says_its_categories_are_unknown():
    d = diagnose(_measurement(46.7, host=46.0, util=99.0))
    assert d.kind == "device-bound"
    assert d.top_categories == []
    assert d.summary() == "device-bound: 46.7 ms per step (no profile: its categories are not known)"


def test_on_a_cpu_the_device_is_the_cpu_and_the_gpu_classes_do_not_arise():
    # a CPU step is all host time, makes no syncs and has no device memory to fill
    profile = _window(12.0, device="cpu", gemm=6.0, elementwise=2.4, loss=0.6, optimizer=1.0, data_wait=0.1)
    d = diagnose(_measurement(10.0, wait=0.1, host=9.9, peak=None, clock="perf_counter"), profile, syncs=[])
    assert d.kind == "device-bound"
    assert d.device == "cpu"
    assert d.device_busy_fraction is None
    assert d.summary() == "device-bound (the CPU's ops): GEMM 60%, elementwise 24%, optimizer 10%"
    # a data-bound CPU step is still data-bound
    assert diagnose(_measurement(10.0, wait=5.0, host=5.0, clock="perf_counter")).kind == "data-bound"


def test_precedence_data_then_memory_then_sync_then_host():
    gb = 10**9
    idle_and_busy = _window(100.0, busy=0.35, gemm=30.0, host_idle=25.0, data_wait=40.0)
    figures = {"host": 59.0, "util": 35.0, "peak": 78 * gb}
    everything = diagnose(
        _measurement(100.0, wait=40.0, **figures), idle_and_busy, syncs=[TRANSFORMER_SYNC], memory_capacity_bytes=80 * gb
    )
    assert everything.kind == "data-bound"
    assert everything.also == ["memory-bound", "sync-bound"]
    no_wait = diagnose(_measurement(100.0, wait=1.0, host=98.0, util=35.0, peak=78 * gb), memory_capacity_bytes=80 * gb)
    assert (no_wait.kind, no_wait.also) == ("memory-bound", ["host-bound"])
    assert list(KINDS) == ["data-bound", "memory-bound", "sync-bound", "host-bound", "device-bound"]


def test_shares_of_the_targets_a_rung_can_cut():
    profile = _window(30.0, busy=0.3, gemm=5.0, attention=1.0, host_idle=15.0, data_wait=1.0)
    d = diagnose(_measurement(25.0, wait=1.25, host=23.0), profile, syncs=[TRANSFORMER_SYNC])
    shares = d.shares()
    assert shares["data_wait"] == pytest.approx(0.05)  # the timed step's own data wait
    # profiled figures against the shorter of the two steps (the profiler lengthens it): 25 ms
    assert shares["gemm"] == pytest.approx(0.2)
    assert shares["attention"] == pytest.approx(0.04)
    assert shares["host"] == pytest.approx(0.6)
    assert shares["syncs"] == shares["host"]
    assert set(CATEGORIES) - {"data_wait", "host_idle"} <= set(shares)
    # syncs looked for and none found: 0; not looked for: not known
    assert diagnose(_measurement(25.0, host=23.0), profile, syncs=[]).shares()["syncs"] == 0.0
    assert "syncs" not in diagnose(_measurement(25.0, host=23.0), profile).shares()
    # without a profile only the data wait is known
    assert diagnose(_measurement(25.0, wait=1.0, host=23.0)).shares() == {"data_wait": pytest.approx(0.04)}


def test_on_a_cpu_host_time_is_the_step_outside_its_ops():
    profile = _window(10.0, device="cpu", gemm=5.0, elementwise=2.0, data_wait=1.0)
    shares = diagnose(_measurement(10.0, wait=1.0, host=9.0, clock="perf_counter"), profile, syncs=[]).shares()
    assert shares["host"] == pytest.approx(0.2)  # 10 - 7 of ops - 1 of data wait
    assert shares["syncs"] == 0.0


def test_to_dict_round_trips_through_json():
    profile = _window(26.0, busy=0.45, gemm=8.0, attention=2.0, elementwise=1.7, host_idle=14.0)
    d = diagnose(_measurement(24.4, wait=0.2, host=24.0, util=60.0, peak=3 * 10**9), profile, [TRANSFORMER_SYNC], 80 * 10**9)
    data = json.loads(json.dumps(d.to_dict()))
    assert data["summary"] == d.summary()
    assert data["kind"] == "sync-bound"
    back = Diagnosis.from_dict(data)
    assert back == d
    assert back.summary() == d.summary()
    assert back.shares() == d.shares()
    # a dict written before a field existed reads with its default
    del data["also"]
    assert Diagnosis.from_dict(data).also == []
