"""The model libraries' own attention switches, flipped reversibly by the ``sdpa`` rung.

A library that routes attention through a switch is changed through that switch, never by
rewriting its code: Hugging Face models through ``set_attn_implementation`` (their attention
registry; ``eager`` → ``sdpa``, PyTorch's flash / memory-efficient kernels), timm attention modules
through their ``fused_attn`` flag. Each switch is recorded on a :class:`~speedkit.handle.Handle`
with an undo and a redo; the report names every model switched and how.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from speedkit import compat
from speedkit.handle import Handle


@dataclass
class SwitchPlan:
    """What the libraries' switches will change, and what they leave alone (with the reason)."""

    hf: list[tuple[nn.Module, str]] = field(default_factory=list)  # (model, implementation it runs now)
    timm: list[nn.Module] = field(default_factory=list)  # timm attention with fused_attn off
    timm_fused: list[nn.Module] = field(default_factory=list)  # ... already on SDPA
    left_alone: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.hf or self.timm)


def plan_switches(model: nn.Module, hf_implementation: str = "sdpa") -> SwitchPlan:
    plan = SwitchPlan()
    for hf_model in compat.hf_pretrained_models(model):
        name = type(hf_model).__name__
        current = compat.hf_attn_implementation(hf_model)
        if current == hf_implementation:
            plan.left_alone.append(f"Hugging Face {name} already runs attn_implementation={current!r}")
            continue
        if current not in (None, "eager"):
            plan.left_alone.append(f"Hugging Face {name} runs attn_implementation={current!r}, chosen by the user; left as is")
            continue
        why_not = compat.hf_attention_switchable(hf_model)
        if why_not:
            plan.left_alone.append(f"Hugging Face {name}: {why_not}")
            continue
        plan.hf.append((hf_model, current or "eager"))
    timm_attention = compat.timm_attention_modules(model)
    plan.timm = [m for m in timm_attention if not m.fused_attn]
    plan.timm_fused = [m for m in timm_attention if m.fused_attn]
    if plan.timm_fused:
        classes = ", ".join(sorted({type(m).__name__ for m in plan.timm_fused}))
        plan.left_alone.append(
            f"timm {classes}: {len(plan.timm_fused)} module(s) already run F.scaled_dot_product_attention (fused_attn=True)"
        )
    return plan


def apply_switches(handle: Handle, plan: SwitchPlan, hf_implementation: str = "sdpa") -> None:
    for hf_model, previous in plan.hf:
        hf_model.set_attn_implementation(hf_implementation)
        handle.record(
            f"Hugging Face {type(hf_model).__name__}: attn_implementation {previous!r} -> {hf_implementation!r} "
            "(set_attn_implementation, the library's attention registry)",
            lambda m=hf_model, p=previous: m.set_attn_implementation(p),
            lambda m=hf_model: m.set_attn_implementation(hf_implementation),
        )
    for module in plan.timm:
        module.fused_attn = True
        handle.record("", lambda m=module: setattr(m, "fused_attn", False), lambda m=module: setattr(m, "fused_attn", True))
    if plan.timm:
        classes = sorted({type(m).__name__ for m in plan.timm})
        handle.record(
            f"timm {', '.join(classes)}: fused_attn False -> True in {len(plan.timm)} module(s) "
            "(timm's own switch to F.scaled_dot_product_attention)"
        )
