"""The plan (speedkit.engine.plan): each rung's gain bounded by its targets' share of the diagnosed
step, rungs bounded under the minimum gain set aside with their reason, and the first configuration
the diagnosis points to, with its prerequisites; and every shipped rung declares what it cuts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from speedkit import config, rungs
from speedkit.engine.diagnose import diagnose
from speedkit.engine.plan import TARGET_NAMES, first_configuration, gain_bound, prerequisites, prune
from speedkit.profile.categories import CATEGORIES
from speedkit.profile.window import ProfileWindow
from speedkit.results import Measurement
from speedkit.rungs.base import Rung


@dataclass
class StandIn:
    """A rung as the plan sees it: a name, what it cuts, what it needs."""

    name: str
    targets: tuple[str, ...]
    needs: tuple[str, ...] = ()


def _measurement(step, *, wait=None, host=None, util=None, clock="cuda_events"):
    telemetry = {"util_mean": util} if util is not None else None
    return Measurement(
        step, 0.02, [step], 1, 10, 1.0, "samples/s", 1, telemetry=telemetry, clock=clock, data_wait_ms=wait, host_ms=host
    )


def _window(step, *, busy=0.99, device="cuda", **ms):
    breakdown = {c: float(ms.get(c, 0.0)) for c in CATEGORIES}
    return ProfileWindow("baseline", 3, step, breakdown, device, device_busy_fraction=busy)


def _device_bound():
    """100 ms: GEMM 60, elementwise 20, normalization 10, attention 2, optimizer 5, host idle 3."""
    profile = _window(100.0, gemm=60.0, elementwise=20.0, normalization=10.0, attention=2.0, optimizer=5.0, host_idle=3.0)
    return diagnose(_measurement(100.0, wait=0.0, host=99.0, util=99.0), profile, syncs=[])


def _shipped():
    """The default ladder's rungs, built as the ladder builds them."""
    return rungs.make_all(config.default_ladder())


def test_a_rung_can_remove_at_most_its_targets_share():
    d = _device_bound()
    assert gain_bound(("gemm",), d, precision_factor=1.0) == (pytest.approx(1 / 0.4), "GEMM is 60% of the step: at most 2.50x")
    bound, reason = gain_bound(("elementwise", "normalization"), d, precision_factor=1.0)
    assert bound == pytest.approx(1 / 0.7)
    assert reason == "elementwise and normalization are 30% of the step: at most 1.43x"
    # the profile's shares are estimates: by default each counts precision_factor times
    factor = config.diagnosis_thresholds()["precision_factor"]
    bound, reason = gain_bound(("attention",), d)
    assert bound == pytest.approx(1 / (1 - 0.02 * factor))
    assert reason.startswith("attention is 2% of the step: at most 1.03x (the share taken 1.25 times")


def test_what_the_diagnosis_cannot_bound_is_unbounded():
    d = _device_bound()
    assert gain_bound(("*",), d) == (None, "it can change any part of the step")
    assert gain_bound((), d)[0] is None
    # without a profile only the data wait's share is known
    unprofiled = diagnose(_measurement(100.0, wait=10.0, host=90.0, util=99.0))
    assert gain_bound(("gemm",), unprofiled) == (None, "the share of GEMM is not known (no profile window)")
    assert gain_bound(("data_wait",), unprofiled, precision_factor=1.0) == (
        pytest.approx(1 / 0.9),
        "the data wait is 10% of the step: at most 1.11x",
    )
    # syncs not looked for
    profile = _window(100.0, busy=0.4, gemm=40.0, host_idle=60.0)
    not_looked = diagnose(_measurement(100.0, host=99.0), profile)
    assert (
        gain_bound(("syncs",), not_looked)[1] == "the share of the host syncs' wait is not known (the syncs were not looked for)"
    )
    # targets taking the whole step (with the margin)
    assert gain_bound(("gemm", "elementwise", "normalization"), d)[0] is None
    with pytest.raises(ValueError, match="unknown rung target"):
        gain_bound(("gemms",), d)


def test_host_time_and_syncs_are_one_pool():
    sync = {"where": "model.py:12 in forward", "code": "x.item()", "count": 1}
    profile = _window(100.0, busy=0.4, gemm=40.0, host_idle=60.0)
    d = diagnose(_measurement(100.0, host=99.0), profile, syncs=[sync])
    alone, _ = gain_bound(("host",), d, precision_factor=1.0)
    both, reason = gain_bound(("host", "syncs"), d, precision_factor=1.0)
    assert alone == both == pytest.approx(2.5)
    # a step without syncs: a rung that only removes syncs can gain nothing
    clean = diagnose(_measurement(100.0, host=99.0), profile, syncs=[])
    assert gain_bound(("syncs",), clean) == (1.0, "the host syncs' wait is 0% of the step: at most 1.00x")


def test_memory_is_no_time_share_but_is_the_point_on_a_memory_bound_step():
    gb = 10**9
    d = _device_bound()
    bound, _ = gain_bound(("attention", "memory"), d, precision_factor=1.0)
    assert bound == pytest.approx(1 / 0.98)
    assert gain_bound(("memory",), d) == (1.0, "it only frees memory, and the step is not memory-bound")
    full = diagnose(
        Measurement(100.0, 0.02, [100.0], 1, 10, 1.0, "samples/s", 1, peak_memory_bytes=78 * gb, clock="cuda_events"),
        memory_capacity_bytes=80 * gb,
    )
    assert full.kind == "memory-bound"
    assert gain_bound(("attention", "memory"), full) == (None, "it frees memory, and the step is memory-bound")


def test_a_rung_bounded_under_the_minimum_gain_is_pruned_with_its_reason():
    d = _device_bound()
    attention = StandIn("sdpa_like", ("attention",))
    gemm = StandIn("tf32_like", ("gemm",))
    anything = StandIn("micro_batch_like", ("*",))
    kept, pruned = prune([attention, gemm, anything], d, min_gain=0.05, precision_factor=1.0)
    assert kept == [gemm, anything]
    assert pruned == [(attention, "attention is 2% of the step: at most 1.02x, under the 1.05x minimum")]
    # a smaller minimum keeps it
    assert prune([attention], d, min_gain=0.01, precision_factor=1.0) == ([attention], [])
    with pytest.raises(ValueError, match="min_gain"):
        prune([attention], d, min_gain=-0.1)


def test_a_rung_that_a_kept_rung_needs_is_not_pruned():
    d = _device_bound()  # no host syncs: a sync remover alone is bounded at 1.00x
    remover = StandIn("explicit_mask", ("syncs",))
    graph = StandIn("cuda_graph", ("host", "syncs"), needs=("explicit_mask",))
    kept, pruned = prune([remover, graph], d, min_gain=0.01, precision_factor=3.0)  # host idle 3% -> 9%
    assert [r.name for r in kept] == ["explicit_mask", "cuda_graph"]
    assert pruned == []
    kept, pruned = prune([remover], d, min_gain=0.01)
    assert kept == [] and pruned[0][1].startswith("the host syncs' wait is 0% of the step")


def test_a_data_bound_step_tries_data_path_first():
    d = diagnose(_measurement(227.1, wait=211.7, host=14.0, util=6.0))
    assert d.kind == "data-bound"
    assert first_configuration(_shipped(), d) == ["data_path"]


def test_a_host_bound_step_tries_compile_the_fused_optimizer_the_sync_removers_and_cuda_graph_with_its_needs():
    profile = _window(30.0, busy=0.15, gemm=2.5, elementwise=2.0, host_idle=25.5)
    d = diagnose(_measurement(24.4, wait=0.3, host=23.9, util=32.0), profile, syncs=[])
    assert d.kind == "host-bound"
    # no gradient accumulation, no FSDP2: micro_batch and the sharding rungs do not apply
    applicable = [r for r in _shipped() if r.name != "micro_batch" and not r.name.startswith("fsdp_")]
    assert first_configuration(applicable, d) == [
        "fused_optimizer",
        "explicit_mask",
        "compile",
        "async_progress_bar",
        "cuda_graph",
    ]
    # with accumulation, cuda_graph needs the micro-batches merged into one
    assert "micro_batch" in first_configuration(_shipped(), d)
    # under FSDP2: the blocks kept gathered from forward to backward (one all-gather a block, not two)
    sharded = [r for r in _shipped() if r.name != "micro_batch"]
    assert "fsdp_reshard" in first_configuration(sharded, d)
    assert not {"fsdp_mixed_precision", "fsdp_prefetch"} & set(first_configuration(sharded, d))


def test_cuda_graphs_needs_come_with_it_where_they_apply():
    shipped = _shipped()
    assert prerequisites(["cuda_graph"], shipped) == ["micro_batch", "explicit_mask", "async_progress_bar", "cuda_graph"]
    # a need that does not apply to the run (not among the rungs given) is left out
    some = [r for r in shipped if r.name in ("compile", "async_progress_bar", "cuda_graph")]
    assert prerequisites(["cuda_graph"], some) == ["async_progress_bar", "cuda_graph"]
    # stand-ins: needs are followed through
    a, b, c = StandIn("a", ("host",), ("b",)), StandIn("b", ("host",), ("c",)), StandIn("c", ("syncs",))
    assert prerequisites(["a"], [c, b, a]) == ["c", "b", "a"]


def test_a_sync_bound_step_tries_the_sync_removers_and_cuda_graph():
    sync = {"where": "torch/nn/modules/transformer.py:1252 in _detect_is_causal_mask", "code": "", "count": 1}
    profile = _window(26.0, busy=0.45, gemm=8.0, elementwise=3.7, host_idle=14.0)
    d = diagnose(_measurement(24.4, host=24.0, util=60.0), profile, syncs=[sync])
    assert d.kind == "sync-bound"
    applicable = [r for r in _shipped() if r.name != "micro_batch"]
    assert first_configuration(applicable, d) == ["explicit_mask", "async_progress_bar", "cuda_graph"]


def test_a_device_bound_step_tries_the_rungs_on_its_top_categories():
    d = _device_bound()
    assert [t["category"] for t in d.top_categories] == ["gemm", "elementwise", "normalization"]
    first = first_configuration(_shipped(), d)
    assert {"tf32", "autocast", "compile", "channels_last", "triton_layers"} <= set(first)
    # what cannot cut these categories is not in it, nor what may change anything ("*")
    assert not {"data_path", "gc_freeze", "micro_batch", "fused_optimizer", "cuda_graph"} & set(first)
    # no profile: nothing named to remove
    assert first_configuration(_shipped(), diagnose(_measurement(50.0, host=49.0, util=99.0))) == []


def test_a_memory_bound_step_tries_the_rungs_that_free_memory():
    gb = 10**9
    d = diagnose(
        Measurement(100.0, 0.02, [100.0], 1, 10, 1.0, "samples/s", 1, peak_memory_bytes=78 * gb, clock="cuda_events"),
        memory_capacity_bytes=80 * gb,
    )
    assert first_configuration(_shipped(), d) == [
        "autocast",
        "sdpa",
        "fused_lm_head",
        "triton_layers",
        "ddp_bucket_view",
        "fsdp_mixed_precision",
        "activation_checkpointing",
        "compile",
    ]


@pytest.mark.parametrize("name", rungs.names())
def test_every_shipped_rung_declares_what_it_cuts_and_needs(name):
    cls = rungs.get(name)
    # its own declaration, not the base's "*" (a new rung says what it cuts, or says "*" itself)
    assert "targets" in vars(cls), f"{name} declares no targets"
    assert cls.targets and set(cls.targets) <= set(TARGET_NAMES)
    assert set(cls.needs) <= set(rungs.names()) - {name}


def test_an_undeclared_rung_may_change_anything():
    assert Rung.targets == ("*",)
    assert Rung.needs == ()
