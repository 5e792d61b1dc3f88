"""speedkit.profile: kernel/op names to categories, a profiled window's breakdown, host syncs."""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from speedkit.errors import SpeedkitError
from speedkit.profile import (
    CATEGORIES,
    CATEGORY_LABELS,
    ProfileUnavailable,
    ProfileWindow,
    categorize,
    find_host_syncs,
    profile_window,
)

# -- categorize -----------------------------------------------------------------------------------------

NAMES = [
    # GEMM: cuBLAS/cuBLASLt/CUTLASS/nvjet, Inductor templates, convolutions, the CPU ops
    (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
        "gemm",
    ),
    ("ampere_sgemm_128x64_tn", "gemm"),
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8", "gemm"),
    (
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)",
        "gemm",
    ),
    ("triton_tem_fused_addmm_0", "gemm"),
    ("triton_tem_fused_mm_1", "gemm"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "gemm"),
    (
        "void cudnn::cnn::conv2d_grouped_direct_kernel<false, true, false, false, 0, 0, float, float>(cudnn::cnn::convolve_params)",
        "gemm",
    ),
    ("void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, int, int)", "gemm"),
    ("sm80_xmma_dgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nchw", "gemm"),
    ("sm80_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "gemm"),
    ("aten::mm", "gemm"),
    ("aten::addmm", "gemm"),
    ("aten::bmm", "gemm"),
    ("aten::matmul", "gemm"),
    ("aten::linear", "gemm"),
    ("aten::baddbmm", "gemm"),
    ("aten::convolution", "gemm"),
    ("aten::mkldnn_convolution", "gemm"),
    ("aten::_convolution", "gemm"),
    # attention
    ("flash_fwd_kernel", "attention"),
    ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    (
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>, false, true>(pytorch_flash::Flash_fwd_params)",
        "attention",
    ),
    (
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)",
        "attention",
    ),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0", "attention"),
    ("aten::_scaled_dot_product_flash_attention", "attention"),
    ("aten::scaled_dot_product_attention", "attention"),
    ("aten::_scaled_dot_product_efficient_attention", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("triton_tem_fused__scaled_dot_product_flash_attention_0", "attention"),
    ("triton_tem_fused_flex_attention_0", "attention"),
    # normalization
    (
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float, float const*)",
        "normalization",
    ),
    (
        "void at::native::(anonymous namespace)::layer_norm_grad_input_kernel<float, float>(float const*, float const*)",
        "normalization",
    ),
    (
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float, 32u, 32u, 256u, false>(long, long)",
        "normalization",
    ),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1, true>(cudnnTensorStruct)", "normalization"),
    ("void at::native::batch_norm_collect_statistics_kernel<at::native::Var, float, float, float, int>(float)", "normalization"),
    ("void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 512, true, 1>(float, float)", "normalization"),
    (
        "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>(long, float, float const*, float*, float*)",
        "normalization",
    ),
    (
        "void at::native::(anonymous namespace)::vectorized_rms_norm_kernel<float, float>(int, float, float const*)",
        "normalization",
    ),
    ("triton_red_fused_native_layer_norm_0", "normalization"),
    ("triton_per_fused_native_layer_norm_native_layer_norm_backward_3", "normalization"),
    ("triton_red_fused__native_batch_norm_legit_functional_1", "normalization"),
    ("triton_per_fused_add_mean_mul_pow_rsqrt_2", "normalization"),
    ("triton_red_fused_native_group_norm_0", "normalization"),
    ("_norm_fwd_kernel", "normalization"),
    ("aten::layer_norm", "normalization"),
    ("aten::native_layer_norm", "normalization"),
    ("aten::native_layer_norm_backward", "normalization"),
    ("aten::batch_norm", "normalization"),
    ("aten::native_batch_norm", "normalization"),
    ("aten::native_batch_norm_backward", "normalization"),
    ("aten::group_norm", "normalization"),
    ("aten::rms_norm", "normalization"),
    # loss
    (
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, float*)",
        "loss",
    ),
    (
        "void at::native::(anonymous namespace)::nll_loss_backward_reduce_cuda_kernel_2d<float, long>(float*, float const*)",
        "loss",
    ),
    (
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
        "loss",
    ),
    (
        "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, at::native::(anonymous namespace)::LogSoftMaxBackwardEpilogue>(float*, float const*, float const*, long)",
        "loss",
    ),
    ("triton_red_fused__log_softmax_nll_loss_forward_0", "loss"),
    ("_liger_cross_entropy_kernel", "loss"),
    ("fused_linear_cross_entropy_fwd", "loss"),
    ("_ce_fwd_kernel", "loss"),
    ("aten::cross_entropy_loss", "loss"),
    ("aten::nll_loss", "loss"),
    ("aten::nll_loss_forward", "loss"),
    ("aten::nll_loss_backward", "loss"),
    ("aten::_log_softmax", "loss"),
    ("aten::_log_softmax_backward_data", "loss"),
    ("aten::mse_loss", "loss"),
    ("aten::binary_cross_entropy_with_logits", "loss"),
    # optimizer
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::PointwiseOpScalarFunctor<float, 4, 3, 3>, std::multiplies<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<4>)",
        "optimizer",
    ),
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, float*, double, double>(at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>)",
        "optimizer",
    ),
    ("fused_adam_kernel", "optimizer"),
    ("lamb_stage1_kernel", "optimizer"),
    ("triton_poi_fused__foreach_addcdiv__foreach_sqrt_0", "optimizer"),
    ("triton_for_fused_0", "optimizer"),
    ("aten::_foreach_mul_", "optimizer"),
    ("aten::_fused_adamw_", "optimizer"),
    ("aten::_fused_adam_", "optimizer"),
    ("aten::_fused_sgd_", "optimizer"),
    ("Optimizer.step#AdamW.step", "optimizer"),
    # memcpy
    ("Memcpy HtoD (Pageable -> Device)", "memcpy"),
    ("Memcpy DtoH (Device -> Pinned)", "memcpy"),
    ("Memcpy DtoD (Device -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    ("aten::copy_", "memcpy"),
    ("aten::to", "memcpy"),
    ("aten::_to_copy", "memcpy"),
    # communication
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("nccl:all_reduce", "communication"),
    ("gloo:all_reduce", "communication"),
    ("c10d::allreduce_", "communication"),
    # elementwise: pointwise, reductions, indexing, embeddings, softmax outside attention, dropout
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>)",
        "elementwise",
    ),
    (
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>>(int)",
        "elementwise",
    ),
    (
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast::{lambda(int)#1})",
        "elementwise",
    ),
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4>)",
        "elementwise",
    ),
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float>, unsigned int, float, 4, 4>)",
        "elementwise",
    ),
    (
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>(cuda::detail::TensorInfo<float, unsigned int>)",
        "elementwise",
    ),
    (
        "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float, float, long>(long const*, float const*)",
        "elementwise",
    ),
    ("triton_poi_fused_add_gelu_0", "elementwise"),
    ("triton_red_fused_sum_1", "elementwise"),
    ("triton_per_fused_mul_sum_2", "elementwise"),
    (
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
        "elementwise",
    ),
    (
        "void at::native::(anonymous namespace)::fused_dropout_kernel_vec<float, float, unsigned int, 1, 4, bool>(at::cuda::detail::TensorInfo<float const, unsigned int>)",
        "elementwise",
    ),
    ("aten::add", "elementwise"),
    ("aten::add_", "elementwise"),
    ("aten::mul", "elementwise"),
    ("aten::gelu", "elementwise"),
    ("aten::gelu_backward", "elementwise"),
    ("aten::relu", "elementwise"),
    ("aten::threshold_backward", "elementwise"),
    ("aten::softmax", "elementwise"),
    ("aten::_softmax", "elementwise"),
    ("aten::dropout", "elementwise"),
    ("aten::embedding", "elementwise"),
    ("aten::embedding_dense_backward", "elementwise"),
    ("aten::sum", "elementwise"),
    ("aten::mean", "elementwise"),
    # other: anything the table does not know
    ("aten::empty", "other"),
    ("aten::view", "other"),
    ("aten::t", "other"),
    ("aten::new_empty", "other"),
    ("cudaLaunchKernel", "other"),
    ("some_custom_kernel", "other"),
]


@pytest.mark.parametrize(("name", "expected"), NAMES, ids=[name[:60] for name, _ in NAMES])
def test_categorize_real_names(name, expected):
    assert categorize(name) == expected


def test_categories_are_ordered_and_labelled():
    assert CATEGORIES == (
        "data_wait",
        "host_idle",
        "gemm",
        "attention",
        "normalization",
        "elementwise",
        "loss",
        "optimizer",
        "memcpy",
        "communication",
        "other",
    )
    assert list(CATEGORY_LABELS) == list(CATEGORIES)
    assert CATEGORY_LABELS["host_idle"] == "host-bound idle GPU" and CATEGORY_LABELS["gemm"] == "GEMM"


def test_categorize_never_answers_a_host_category():
    assert {categorize(name) for name, _ in NAMES} <= set(CATEGORIES) - {"data_wait", "host_idle"}


def test_specific_rules_beat_generic_ones():
    assert categorize("triton_red_fused_native_layer_norm_0") == "normalization"  # not elementwise
    assert categorize("triton_tem_fused_mm_1") == "gemm"  # not "other"
    assert categorize("fmha_cutlassF_f32_aligned_64x64_rf_sm80") == "attention"  # not a CUTLASS GEMM
    assert categorize("fused_linear_cross_entropy_bwd") == "loss"  # not a linear's GEMM
    assert categorize("triton_red_fused__log_softmax_mean_0") == "loss"  # not elementwise
    # a kernel's lambda is not the LAMB optimizer
    assert (
        categorize(
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
            "std::array<char*, 1ul> >({lambda()#1})"
        )
        == "elementwise"
    )


# -- profile_window on CPU --------------------------------------------------------------------------------


class ComputedDataset(torch.utils.data.Dataset):
    """Samples that take measurable host work to make (a few small matrix products each), no sleeping."""

    def __init__(self, work: int) -> None:
        self.work = work
        self.mixer = torch.linspace(-1, 1, 64 * 64).reshape(64, 64) / 8

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(64, generator=generator)
        for _ in range(self.work):
            x = torch.tanh(self.mixer @ x + x)
        return x, index % 10


class MLPStep:
    """forward, cross-entropy, backward and an AdamW step on batches from a DataLoader; counts its calls."""

    def __init__(self, work: int = 0, fail_at: int | None = None) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.batches = iter(torch.utils.data.DataLoader(ComputedDataset(work), batch_size=64))
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self) -> float:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the step itself failed")
        x, y = next(self.batches)
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class ClosureStep(MLPStep):
    """The step as Lightning's automatic optimization runs it: forward and backward in a closure that
    ``optimizer.step(closure)`` calls, inside the optimizer's profiler scope."""

    def __call__(self) -> float:
        self.calls += 1
        x, y = next(self.batches)

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

        return self.optimizer.step(closure).detach()


def test_a_closure_run_inside_optimizer_step_keeps_its_own_categories():
    window = profile_window(ClosureStep(), steps=3, warmup=1, label="closure", device=torch.device("cpu"))
    b = window.breakdown_ms
    assert b["gemm"] > 0 and b["loss"] > 0 and b["optimizer"] > 0
    # the update alone is the optimizer's: the forward's and backward's GEMMs, run by the closure inside
    # optimizer.step, keep their own category (read from the ops, not from a comparison of CPU times)
    gemms = [op for op in window.top_ops if op["name"] in ("aten::mm", "aten::addmm")]
    assert gemms and all(op["category"] == "gemm" for op in gemms), gemms


@pytest.fixture(scope="module")
def cpu_window(tmp_path_factory):
    """One profiled CPU window (slow loader, trace asked), shared by the tests that read it."""
    step = MLPStep(work=40)
    trace = tmp_path_factory.mktemp("profile") / "nested" / "baseline.json.gz"
    window = profile_window(step, steps=3, warmup=2, label="baseline", device=torch.device("cpu"), trace_path=trace)
    return window, step, trace


def test_cpu_window_breaks_the_step_down(cpu_window):
    window, step, _ = cpu_window
    assert step.calls == 2 + 3  # warm-up steps run, then the profiled ones
    assert window.steps == 3 and window.label == "baseline" and window.device == "cpu"
    assert set(window.breakdown_ms) == set(CATEGORIES)
    breakdown = window.breakdown_ms
    assert breakdown["gemm"] > 0 and breakdown["optimizer"] > 0 and breakdown["loss"] > 0
    assert breakdown["data_wait"] > 0  # the loader computes its samples
    assert breakdown["host_idle"] == 0.0 and window.device_busy_fraction is None and window.peak_memory_bytes is None
    assert sum(breakdown.values()) <= window.step_ms * 1.1
    assert all(value >= 0 for value in breakdown.values())


def test_the_loaders_work_is_data_wait_not_the_steps():
    # a "step" that only fetches: the samples' matrix products run inside the loader's fetch, so they
    # are data wait and no op category's
    batches = iter(torch.utils.data.DataLoader(ComputedDataset(work=10), batch_size=16))
    window = profile_window(lambda: next(batches), steps=2, warmup=1, label="x", device="cpu")
    ops = sum(ms for category, ms in window.breakdown_ms.items() if category != "data_wait")
    assert window.breakdown_ms["data_wait"] > 0
    assert ops < 0.05 * window.breakdown_ms["data_wait"]


def test_nested_data_wait_scopes_count_once():
    # speedkit's own scope around Lightning's fetch scope: the time inside counts once, not twice
    a, b = torch.randn(96, 96), torch.randn(96, 96)

    def fetch_only():
        with torch.profiler.record_function("speedkit.data_wait"):
            with torch.profiler.record_function("[_TrainingEpochLoop].train_dataloader_next"):
                for _ in range(100):
                    a @ b

    window = profile_window(fetch_only, steps=2, warmup=1, label="x", device="cpu")
    assert 0.5 * window.step_ms < window.breakdown_ms["data_wait"] <= window.step_ms
    assert window.breakdown_ms["gemm"] == 0.0  # the products ran inside the fetch


def test_cpu_window_top_ops(cpu_window):
    window, _, _ = cpu_window
    assert 0 < len(window.top_ops) <= 12
    assert [op["ms"] for op in window.top_ops] == sorted((op["ms"] for op in window.top_ops), reverse=True)
    assert all(len(op["name"]) <= 80 and op["category"] in CATEGORIES for op in window.top_ops)


def test_cpu_window_writes_a_gzipped_chrome_trace(cpu_window):
    window, _, trace = cpu_window
    assert window.trace == str(trace) and window.trace_note is None
    with gzip.open(trace) as handle:
        assert "traceEvents" in json.loads(handle.read())
    assert list(trace.parent.iterdir()) == [trace]  # the plain export was removed


def test_a_trace_over_the_bound_is_not_kept(tmp_path):
    trace = tmp_path / "big.json.gz"
    window = profile_window(MLPStep(), steps=1, warmup=0, label="final", device="cpu", trace_path=trace, max_trace_bytes=1000)
    assert window.trace is None and not trace.exists()
    assert "over the" in window.trace_note and "not kept" in window.trace_note
    assert list(tmp_path.iterdir()) == []


def test_no_trace_asked_says_so():
    step = MLPStep()
    window = profile_window(step, steps=2, warmup=0, label="x", device="cpu")
    assert step.calls == 2 and window.steps == 2
    assert window.trace is None and window.trace_note
    assert window.breakdown_ms["data_wait"] >= 0


def test_an_error_in_the_step_propagates_unchanged(tmp_path):
    trace = tmp_path / "failed.json.gz"
    with pytest.raises(RuntimeError, match="the step itself failed"):
        profile_window(MLPStep(fail_at=3), steps=2, warmup=1, label="x", device="cpu", trace_path=trace)
    assert not torch.autograd._profiler_enabled()  # the profiler was stopped on the way out
    assert list(tmp_path.iterdir()) == []  # and no trace of the failed window was written


def test_a_profiler_already_running_is_profile_unavailable():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(ProfileUnavailable) as raised:
            profile_window(MLPStep(), steps=1, warmup=0, label="x", device="cpu")
    assert isinstance(raised.value, SpeedkitError) and "\n" not in str(raised.value)


def test_unreadable_profiler_results_are_profile_unavailable(monkeypatch):
    def broken(self):
        raise RuntimeError("kineto returned nothing\nsecond line")

    monkeypatch.setattr(torch.profiler.profile, "events", broken)
    with pytest.raises(ProfileUnavailable, match="kineto returned nothing") as raised:
        profile_window(MLPStep(), steps=1, warmup=0, label="x", device="cpu")
    assert "second line" not in str(raised.value)


def test_a_window_needs_a_step():
    with pytest.raises(SpeedkitError, match="profile.steps"):
        profile_window(MLPStep(), steps=0, label="x", device="cpu")


# -- the window as JSON ------------------------------------------------------------------------------------


def test_window_round_trips_through_json():
    window = ProfileWindow(
        label="rung",
        steps=3,
        step_ms=12.5,
        breakdown_ms={**dict.fromkeys(CATEGORIES, 0.0), "gemm": 4.0},
        device="cuda",
        device_busy_fraction=0.75,
        top_ops=[{"name": "ampere_sgemm_128x64_tn", "category": "gemm", "ms": 4.0}],
        trace="runs/p/rung.json.gz",
        trace_note=None,
        peak_memory_bytes=1 << 30,
    )
    data = json.loads(json.dumps(window.to_dict()))
    assert set(data) == {
        "label",
        "steps",
        "step_ms",
        "breakdown_ms",
        "device",
        "device_busy_fraction",
        "top_ops",
        "trace",
        "trace_note",
        "peak_memory_bytes",
    }
    assert ProfileWindow.from_dict(data) == window


def test_real_window_round_trips_through_json(cpu_window):
    window, _, _ = cpu_window
    again = ProfileWindow.from_dict(json.loads(json.dumps(window.to_dict())))
    assert again == window and all(math.isfinite(value) for value in again.breakdown_ms.values())


# -- host syncs ----------------------------------------------------------------------------------------------


def test_find_host_syncs_is_empty_on_cpu():
    step = MLPStep()
    assert find_host_syncs(step, torch.device("cpu")) == []


# -- on a GPU --------------------------------------------------------------------------------------------------


class CudaMLPStep:
    """An MLP training step on CUDA; ``read_loss`` reads the loss on the host (a sync) on a known line."""

    def __init__(self, read_loss: bool = False) -> None:
        torch.manual_seed(0)
        self.device = torch.device("cuda")
        self.model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 10)).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(256, 512, device=self.device)
        self.y = torch.randint(0, 10, (256,), device=self.device)
        self.read_loss = read_loss

    def __call__(self) -> None:
        loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.read_loss:
            self.last = loss.item()  # the sync find_host_syncs must name


@pytest.mark.gpu
def test_cuda_window_breaks_the_step_down(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    trace = tmp_path / "cuda.json.gz"
    window = profile_window(CudaMLPStep(), steps=3, warmup=2, label="baseline", device=torch.device("cuda"), trace_path=trace)
    assert window.device == "cuda" and set(window.breakdown_ms) == set(CATEGORIES)
    assert 0 < window.device_busy_fraction <= 1
    assert window.breakdown_ms["gemm"] > 0 and window.breakdown_ms["loss"] > 0 and window.breakdown_ms["optimizer"] > 0
    assert window.peak_memory_bytes and window.peak_memory_bytes > 0
    assert window.trace == str(trace)
    assert sum(window.breakdown_ms.values()) <= window.step_ms * 1.1


@pytest.mark.gpu
def test_a_cuda_window_leaves_the_launches_after_it_as_fast_as_before(monkeypatch):
    """Left attached after a CUDA profile, CUPTI slowed every launch after it (+32% a launch, 1.26x a launch-bound step on an H100):
    the trials' comparisons after the diagnosis and the fit paid it. Checked in a fresh process, where
    CUPTI has never been attached before the window."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import subprocess
    import sys

    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "bench" / "cupti_residue.py"), "--child", "profile_detached", "eager"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    # the host's cost per launch, not the step's time: a step measured twice in one process drifts by ±10%
    assert got["launch_us_after"] / got["launch_us_before"] < 1.1, got


@pytest.mark.gpu
def test_cuda_item_is_named_as_one_host_sync():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    step = CudaMLPStep(read_loss=True)
    step()  # the optimizer's state exists: the step checked is a steady one
    torch.cuda.synchronize()
    syncs = find_host_syncs(step, torch.device("cuda"))
    line = next(
        number
        for number, text in enumerate(open(__file__).read().splitlines(), 1)
        if "the sync find_host_syncs must name" in text and "loss.item()" in text
    )
    ours = [sync for sync in syncs if f"test_profile_window.py:{line}" in sync["where"]]
    assert len(ours) == 1 and ours[0]["count"] == 1 and "loss.item()" in ours[0]["code"]


def test_a_sync_in_an_installed_package_is_named_from_its_package_folder():
    from speedkit.profile.syncs import short_path

    where = "/opt/venv/lib/python3.12/site-packages/torch/nn/modules/transformer.py:1252 in _detect_is_causal_mask"
    assert short_path(where) == "torch/nn/modules/transformer.py:1252 in _detect_is_causal_mask"
    assert short_path("/work/train.py:10 in step") == "/work/train.py:10 in step"
