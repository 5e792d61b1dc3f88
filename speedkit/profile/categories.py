"""The categories a training step's time is split into, and the one table that puts a kernel or op in one.

:data:`CATEGORIES` lists them in report order: two host-side ones (``data_wait``: the step waiting
for its batch; ``host_idle``: the GPU idle while the host issues work) and the device-side ones
that :func:`categorize` picks from a name. A name is either a GPU kernel's (``ampere_sgemm_128x64_tn``,
``void at::native::vectorized_elementwise_kernel<...>``, Inductor's ``triton_poi_fused_add_0``),
a copy's (``Memcpy HtoD (Pageable -> Device)``) or a CPU op's (``aten::addmm``): one table serves all.

Conventions (the table's rows say them too):

* **convolutions count as GEMM** (cuDNN runs them as implicit GEMMs; a convnet's "GEMM" share is its
  convolutions);
* reductions (``reduce_kernel``, ``aten::sum``), softmax outside attention, dropout, embeddings
  and indexing count as **elementwise**: memory-bound kernels that fusion (``torch.compile``) shrinks;
* **log-softmax counts as loss** (it is cross-entropy's first half), also where a model calls it itself;
* anything the table does not know is **other**.

Rows are tried in order and the first match wins, so specific rows come before generic ones: an
Inductor ``triton_red_fused_native_layer_norm_0`` is normalization, not elementwise;
``fmha_cutlassF_...`` is attention, not a cutlass GEMM; ``fused_linear_cross_entropy`` is loss.
"""

from __future__ import annotations

import re
from functools import lru_cache

CATEGORIES: tuple[str, ...] = (
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

CATEGORY_LABELS: dict[str, str] = {
    "data_wait": "data wait",
    "host_idle": "host-bound idle GPU",
    "gemm": "GEMM",
    "attention": "attention",
    "normalization": "normalization",
    "elementwise": "elementwise",
    "loss": "loss",
    "optimizer": "optimizer",
    "memcpy": "memcpy",
    "communication": "communication",
    "other": "other",
}

#: CPU ops that are elementwise, reductions or indexing (``aten::NAME``, ``aten::NAME_``,
#: ``aten::NAME_backward``, ``aten::_NAME``)
_ELEMENTWISE_ATEN = (
    "add|sub|rsub|mul|div|neg|abs|sign|pow|sqrt|rsqrt|exp|exp2|log|log2|log1p|reciprocal|erf|sin|cos|"
    "relu|gelu|silu|tanh|sigmoid|mish|elu|leaky_relu|hardswish|hardsigmoid|hardtanh|softplus|threshold|glu|"
    "softmax|dropout|native_dropout|fused_dropout|bernoulli|uniform|normal|random|"
    "embedding|embedding_dense|embedding_bag|index|index_select|index_add|index_put|index_copy|gather|scatter|"
    "scatter_add|masked_fill|masked_scatter|where|fill|zero|clamp|clamp_min|clamp_max|minimum|maximum|lerp|"
    "addcmul|addcdiv|sum|mean|var|std|var_mean|prod|max|min|amax|amin|argmax|argmin|cumsum|logsumexp|norm|"
    "linalg_vector_norm|cat|stack|eq|ne|lt|le|gt|ge|logical_not|logical_and|logical_or|isnan|isinf|isfinite|"
    "sort|topk|max_pool2d|max_pool2d_with_indices|avg_pool2d|adaptive_avg_pool2d|upsample_nearest2d|"
    "upsample_bilinear2d|pad|constant_pad_nd|roll|flip|tril|triu|outer|square|trunc|floor|ceil|round"
)

#: (category, pattern) — tried in order on the lower-cased name; the first match wins
_RULES: tuple[tuple[str, str], ...] = (
    # collectives: NCCL kernels and c10d/gloo/nccl host ops
    ("communication", r"nccl|gloo|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all"),
    # copies and sets between or within memories; on CPU the copy ops themselves
    ("memcpy", r"^memcpy|^memset|\bmemcpy\b|^aten::(copy_|to|_to_copy|_copy_from|_copy_from_and_resize|contiguous|clone)$"),
    # attention: flash / memory-efficient / cuDNN SDPA kernels, Inductor's flex attention, the SDPA ops
    (
        "attention",
        r"flash_(fwd|bwd|attn|attention)|flash::|fmha|sdpa|scaled_dot_product|efficient_attention|"
        r"flex_attention|flash_attention|attention_(forward|backward)",
    ),
    # optimizer: foreach/fused multi-tensor kernels, Inductor's foreach (combo) kernels, the ops
    (
        "optimizer",
        r"multi_tensor_apply|fused_?adam|fused_?sgd|fused_?lamb|lamb(?!da)|_foreach_|^triton_for_|"
        r"^optimizer\.(step|zero_grad)|^triton_\w*(addcdiv\w*sqrt|sqrt\w*addcdiv)",
    ),
    # loss: (log-)softmax + NLL, cross-entropy kernels (Liger, speedkit's _ce_*), the other losses
    (
        "loss",
        r"nll_?loss|cross_?entropy|log_?softmax|^_?ce_(fwd|bwd|grad)_kernel|mse_loss|l1_loss|huber_loss|"
        r"kl_div|ctc_loss|margin_ranking|soft_margin|cosine_embedding_loss|poisson_nll",
    ),
    # normalization: layer/batch/group/instance/RMS norm kernels and ops; Inductor's fused norms
    (
        "normalization",
        r"layer_?norm|batch_?norm|group_?norm|instance_?norm|rms_?norm|gammabetabackward|"
        r"rowwisemoments|computefusedparams|bn_fw|bn_bw|^_norm_(fwd|bwd)|^_sum_partials_kernel|"
        r"^triton_\w*(rsqrt\w*(mean|var_mean)|(mean|var_mean)\w*rsqrt)",
    ),
    # GEMM: cuBLAS(Lt)/CUTLASS/nvjet kernels, Inductor templates, convolutions (implicit GEMMs), the ops
    (
        "gemm",
        r"gemm|gemv|xmma|cublas|cutlass|nvjet|splitkreduce|matmul|^triton_tem_|extern_kernels\.|"
        r"convol|dgrad|wgrad|fprop|winograd|cudnn|"
        r"^aten::_?(mm|addmm|bmm|baddbmm|addbmm|addmv|mv|dot|linear|matmul|_addmm_activation|scaled_mm|int_mm|"
        r"convolution|convolution_backward|_convolution|mkldnn_convolution|conv\d?d|cudnn_convolution|"
        r"mkldnn_linear)$",
    ),
    # elementwise: pointwise, reduction and indexing kernels and ops, softmax outside attention, dropout
    (
        "elementwise",
        r"elementwise|reduce_kernel|^triton_(poi|red|per)_|softmax|dropout|index|embedding|"
        r"catarray|scatter|gather|distribution_|fill|pointwise|"
        rf"^aten::_?({_ELEMENTWISE_ATEN})(_backward(_data)?|_)?$",
    ),
)

_COMPILED: tuple[tuple[str, re.Pattern[str]], ...] = tuple((category, re.compile(pattern)) for category, pattern in _RULES)


@lru_cache(maxsize=8192)
def categorize(name: str) -> str:
    """The device category of a GPU kernel's, copy's or CPU op's ``name`` (one of :data:`CATEGORIES`
    but ``data_wait``/``host_idle``; ``"other"`` for names the table does not know)."""
    lowered = name.lower()
    for category, pattern in _COMPILED:
        if pattern.search(lowered):
            return category
    return "other"
