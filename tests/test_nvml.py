"""NvmlSampler against a deterministic fake pynvml (CPU), and against the real GPU when there is one."""

from __future__ import annotations

import sys
import threading
import types
from statistics import fmean

import pytest
import torch

from speedkit.measure import nvml
from speedkit.measure.nvml import NvmlSampler, decode_clock_event_reasons, nvml_index, summarize_samples

GPU_IDLE, SW_POWER_CAP, HW_SLOWDOWN = 0x1, 0x4, 0x8


def _util(k: int) -> int:
    return (k % 5) * 20  # 0, 20, 40, 60, 80, 0, ...


def _mem(k: int) -> int:
    return 1_000_000 + 1000 * k


def _power_mw(k: int) -> int:
    return 300_000 + 1500 * k  # NVML reports milliwatts


def _sm_clock(k: int) -> int:
    return 1980 - 15 * k


def _reasons(k: int) -> int:
    return GPU_IDLE if k % 2 == 0 else SW_POWER_CAP | HW_SLOWDOWN


class FakeNvml(types.ModuleType):
    """The subset of pynvml the sampler calls; the k-th read of each quantity returns f(k)."""

    NVML_CLOCK_SM = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    nvmlClocksEventReasonGpuIdle = GPU_IDLE
    nvmlClocksEventReasonSwPowerCap = SW_POWER_CAP
    nvmlClocksEventReasonHwSlowdown = HW_SLOWDOWN

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(
        self,
        *,
        count: int = 4,
        enough: int = 6,
        fail_power_at: int | None = None,
        power_not_supported: bool = False,
        init_error: bool = False,
    ) -> None:
        super().__init__("pynvml")
        self.count, self.enough = count, enough
        self.fail_power_at, self.power_not_supported, self.init_error = fail_power_at, power_not_supported, init_error
        self.calls = {"util": 0, "mem": 0, "power": 0, "clock": 0, "reasons": 0}
        self.inits = self.shutdowns = 0
        self.enough_samples = threading.Event()  # set once `enough` samples were read

    def _next(self, key: str) -> int:
        k = self.calls[key]
        self.calls[key] += 1
        return k

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index >= self.count:
            raise self.NVMLError(2)
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{'abcd'[handle] * 8}-1111-2222-3333-444455556666"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=_util(self._next("util")), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(used=_mem(self._next("mem")), total=80 * 10**9)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        k = self._next("power")
        if self.power_not_supported:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        if k == self.fail_power_at:
            raise self.NVMLError(999)  # NVML_ERROR_UNKNOWN
        return _power_mw(k)

    def nvmlDeviceGetClockInfo(self, handle: int, clock_type: int) -> int:
        assert clock_type == self.NVML_CLOCK_SM
        return _sm_clock(self._next("clock"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        k = self._next("reasons")
        if k + 1 >= self.enough:
            self.enough_samples.set()
        return _reasons(k)


@pytest.fixture
def fake(monkeypatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml, "_torch_uuid", lambda index: None)  # the fake GPUs are not torch's
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def _fake_clock(*times: float):
    it = iter(times)
    return lambda: next(it)


def test_create_is_none_without_a_gpu():
    assert NvmlSampler.create(torch.device("cpu")) is None
    assert NvmlSampler.create("meta") is None


def test_create_is_none_without_pynvml_or_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert NvmlSampler.create(torch.device("cuda", 0)) is None
    broken = FakeNvml(init_error=True)
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert NvmlSampler.create(torch.device("cuda", 0)) is None


def test_create_maps_the_cuda_index_through_cuda_visible_devices(fake, monkeypatch):
    assert NvmlSampler.create(torch.device("cuda", 1)).device_index == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    assert NvmlSampler.create(torch.device("cuda", 1)).device_index == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccccccc")
    assert NvmlSampler.create(torch.device("cuda", 0)).device_index == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # not on this machine
    assert NvmlSampler.create(torch.device("cuda", 0)) is None
    assert fake.inits == fake.shutdowns  # every probe shut NVML down again


def test_nvml_index(fake):
    assert nvml_index(2, fake, visible=None) == 2
    assert nvml_index(0, fake, visible="") is None
    assert nvml_index(1, fake, visible="3, 0") == 0
    assert nvml_index(2, fake, visible="0,1") is None
    assert nvml_index(0, fake, visible="GPU-bbbb") == 1
    assert nvml_index(0, fake, visible="GPU-ffff") is None
    assert nvml_index(0, fake, visible="MIG-0123") is None
    assert nvml_index(1, fake, visible="0,oops,1") is None  # CUDA stops at the first bad entry
    # torch's UUID wins over the environment (CUDA_DEVICE_ORDER may differ from NVML's order).
    assert nvml_index(0, fake, visible="0", uuid="dddddddd-1111-2222-3333-444455556666") == 3


def test_decode_clock_event_reasons():
    assert decode_clock_event_reasons(0) == []
    assert decode_clock_event_reasons(0x1 | 0x4 | 0x40) == ["gpu_idle", "sw_power_cap", "hw_thermal_slowdown"]
    assert decode_clock_event_reasons(0x80 | 0x100 | 0x2 | 0x10 | 0x8 | 0x20) == [
        "applications_clocks_setting",
        "hw_slowdown",
        "sync_boost",
        "sw_thermal_slowdown",
        "hw_power_brake",
        "display_clocks_setting",
    ]
    assert decode_clock_event_reasons(0x4 | 0x10000) == ["sw_power_cap", "0x10000"]


def test_sampler_summary_is_exact(fake):
    sampler = NvmlSampler(2, interval_s=0.001, clock=_fake_clock(100.0, 102.5))
    with sampler:
        assert fake.enough_samples.wait(timeout=5)
    s = sampler.summary
    n = s["samples"]
    assert n >= fake.enough and fake.calls["util"] == n
    ks = range(n)
    assert s["util_mean"] == fmean(float(_util(k)) for k in ks)
    assert s["util_max"] == max(_util(k) for k in ks) == 80
    assert s["mem_used_max_bytes"] == _mem(n - 1)
    assert s["power_mean_w"] == fmean(_power_mw(k) / 1000 for k in ks)
    assert s["power_max_w"] == _power_mw(n - 1) / 1000
    assert s["sm_clock_mean_mhz"] == fmean(float(_sm_clock(k)) for k in ks)
    assert s["sm_clock_min_mhz"] == _sm_clock(n - 1)
    assert s["clock_event_reasons"] == ["gpu_idle", "hw_slowdown", "sw_power_cap"]
    assert s["slowdown_reasons"] == ["hw_slowdown", "sw_power_cap"]
    assert s["slowdown_fraction"] == (n // 2) / n
    assert s["duration_s"] == 2.5
    assert s["error"] is None
    assert fake.inits == fake.shutdowns == 1
    assert sampler.stop() is s  # stopping twice returns the same summary


def test_error_in_thread_ends_in_summary_not_raised(fake):
    fake.fail_power_at = 2
    sampler = NvmlSampler(0, interval_s=0.001).start()
    sampler._thread.join(timeout=5)  # the thread ends on its own after the error
    s = sampler.stop()
    assert s["samples"] == 2
    assert "NVML error 999" in s["error"]
    assert s["power_mean_w"] == fmean([_power_mw(0) / 1000, _power_mw(1) / 1000])
    assert fake.inits == fake.shutdowns == 1


def test_unsupported_quantity_is_skipped(fake):
    fake.power_not_supported = True
    sampler = NvmlSampler(0, interval_s=0.001).start()
    assert fake.enough_samples.wait(timeout=5)
    s = sampler.stop()
    assert s["error"] is None and s["samples"] >= fake.enough
    assert s["power_mean_w"] is None and s["power_max_w"] is None
    assert fake.calls["power"] == 1  # asked once, then no more
    assert s["util_max"] == 80


def test_bad_device_index_is_an_error_in_the_summary(fake):
    s = NvmlSampler(9, interval_s=0.001).start().stop()
    assert s["samples"] == 0 and "NVML error 2" in s["error"] and s["util_mean"] is None


def test_never_started_and_validation():
    assert NvmlSampler().stop() is None
    with pytest.raises(ValueError, match="interval_s"):
        NvmlSampler(interval_s=0)
    with pytest.raises(ValueError, match="device_index"):
        NvmlSampler(-1)


def test_summarize_samples_empty():
    s = summarize_samples([], duration_s=0.0)
    assert s["samples"] == 0 and s["util_mean"] is None and s["clock_event_reasons"] == []
    assert s["slowdown_fraction"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_gpu():
    pytest.importorskip("pynvml")
    sampler = NvmlSampler.create(torch.device("cuda"), interval_s=0.02)
    assert sampler is not None
    a = torch.randn(4096, 4096, device="cuda")
    with sampler:
        for _ in range(200):
            a = (a @ a).tanh()
        torch.cuda.synchronize()
    s = sampler.summary
    assert s["error"] is None, s["error"]
    assert s["samples"] >= 2 and s["duration_s"] > 0
    assert 0 <= s["util_mean"] <= 100 and s["sm_clock_min_mhz"] > 0
    assert s["mem_used_max_bytes"] >= 4096 * 4096 * 4


def test_the_timeline_places_each_sample_at_the_time_it_was_taken_and_marks_the_windows():
    from speedkit.measure.nvml import timeline

    samples = [
        {"t": 0.0, "util": 10.0, "power_w": 100.0, "power_limit_w": 700.0, "sm_clock": 1980.0, "reasons": []},
        {"t": 0.37, "util": 95.0, "power_w": 600.0, "power_limit_w": 700.0, "sm_clock": 1755.0, "reasons": ["sw_power_cap"]},
        {"util": 90.0},
    ]  # a sample without a time: placed by the interval
    out = timeline(samples, 0.1, [(0.0, "baseline"), (0.3, "final")])
    assert [s["t_s"] for s in out["samples"]] == [0.0, 0.37, 0.2]
    assert out["samples"][1] == {
        "t_s": 0.37,
        "util": 95.0,
        "power_w": 600.0,
        "power_limit_w": 700.0,
        "sm_clock_mhz": 1755.0,
        "reasons": ["sw_power_cap"],
    }
    assert out["marks"] == [{"t_s": 0.0, "label": "baseline"}, {"t_s": 0.3, "label": "final"}]
    assert timeline([], 0.1) is None
