"""fsdp_mixed_precision: FSDP2 gathers the parameters in bf16 and reduces the gradients in fp32 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``).

Speeds up: a model sharded with ``fully_shard``: its all-gathers move half the bytes, the forward and
backward compute on bf16 parameters (GEMMs on tensor cores, no autocast casts of every weight every
step), and the gathered parameters and their gradients take half the memory. torchtitan trains every
model this way.
Does not help: a step whose collectives already hide behind its compute and whose GEMMs already run in
bf16 under autocast (what is left to save is the casts).
Needs: the model sharded with FSDP2's ``fully_shard`` (Lightning's ``ModelParallelStrategy``) without a
``param_dtype`` of the user's policy; fp32 parameters; a device with bf16 (CUDA compute capability
>= 8.0; a CPU with bf16 instructions); not under fp16 precision (``16-mixed``).
Numerics: bf16. The forward and backward run on bf16 copies of the parameters (the embedding's output and
the residual stream too, where the model does not cast them itself); gradients are reduced in fp32 and
the optimizer steps the fp32 shards.

FSDP2 fixes its policy when ``fully_shard`` runs (the user's ``configure_model``); the rung sets it on
every sharded module afterwards, between steps, as ``fully_shard`` would have (``compat.fsdp2_set_policies``:
the next all-gather makes the unsharded parameters anew in bf16); undo puts the user's policies back.
It keeps the policy's other fields (``output_dtype``, ``cast_forward_inputs``) as the user set them.
"""

from __future__ import annotations

import torch
from torch import nn

from speedkit import compat
from speedkit.config import loosest
from speedkit.rungs.autocast import pick_autocast_dtype
from speedkit.rungs.base import Handle, set_attr
from speedkit.rungs.fsdp_knob import FSDP2Rung
from speedkit.training.state import TrainState


class FSDPMixedPrecisionRung(FSDP2Rung):
    name = "fsdp_mixed_precision"
    # the all-gathers (half the bytes), bf16 arithmetic on the gathered weights, half their memory
    targets = ("communication", "gemm", "attention", "elementwise", "normalization", "memory")
    precision = "bf16"
    acts_through_numerics = True
    recompiles = True  # a compiled forward meets bf16 parameters: it compiles anew
    needs_ranks = False  # on one process too, the step computes on bf16 parameters

    def why_not(self, modules: list[nn.Module], state: TrainState) -> str | None:
        for policy in compat.fsdp2_policies(state.model):
            if policy.param_dtype is not None:
                return f"the model's fully_shard already sets MixedPrecisionPolicy(param_dtype={policy.param_dtype})"
        dtypes = {p.dtype for p in state.model.parameters() if p.is_floating_point()}
        if torch.float32 not in dtypes:
            return f"the parameters are {', '.join(sorted(str(d) for d in dtypes)) or 'not floating point'}, not fp32: nothing to gather in bf16"
        if state.precision == "fp16":
            return "the step runs fp16 with loss scaling: bf16 parameters would mix two half precisions"
        reason = pick_autocast_dtype(state.device, "bf16")[1]
        if reason is not None:
            return reason
        return compat.fsdp2_policy_settable(state.model)

    def apply(self, state: TrainState) -> Handle:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        model = state.model
        before = compat.fsdp2_policies(model)
        after = [
            MixedPrecisionPolicy(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.float32,
                output_dtype=p.output_dtype,
                cast_forward_inputs=p.cast_forward_inputs,
            )
            for p in before
        ]
        handle = Handle(self.name)
        compat.fsdp2_set_policies(model, after)
        handle.record(
            f"{len(after)} sharded modules: parameters gathered in bf16, gradients reduced in fp32",
            lambda: compat.fsdp2_set_policies(model, before),
            lambda: compat.fsdp2_set_policies(model, after),
        )
        set_attr(handle, state, "precision", loosest(state.precision, "bf16"), "numerics: bf16")
        return handle
