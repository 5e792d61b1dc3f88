"""What the source-rewriting rungs decide and rewrite on a fixed set of models, as plain JSON.

:func:`capture` runs each rewrite rung's ``check`` and ``apply`` (then undo) on the zoo's tiny models,
the shipped recipes' models, and the test suite's attention and batched-GEMM models, and records:
every rung's ``check`` outcome on each model (the applicability decisions), and for each rewrite rung
that applies, its report lines, its site counts, and the names the rewritten forwards reach; the
CPU's bf16 instructions are pinned to "none" meanwhile (tf32's and autocast's checks read them). The
golden copy (``fixtures/rewrite_reports.json``) was written before the rewrite rungs were rebuilt over
one pipeline; ``test_rewrite_reports`` asserts the rebuilt rungs still produce it.

Regenerate only on purpose: ``python tests/rewrite_reports.py --write``.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "fixtures" / "rewrite_reports.json"
REWRITE_RUNGS = ("sdpa", "batched", "triton_layers")
#: every rung's check is recorded (its applicability decision); rewrite rungs are also applied
CHECKED_RUNGS = (
    "tf32",
    "autocast",
    "fused_optimizer",
    "sdpa",
    "batched",
    "triton_layers",
    "channels_last",
    "cudnn_benchmark",
    "explicit_mask",
    "aligned_linear",
    "compile",
    "cuda_graph",
)


def _models() -> list[tuple[str, nn.Module, Any]]:
    """(label, model, optimizer) triples, each built fresh after ``torch.manual_seed(0)``."""
    sys.path.insert(0, str(HERE))
    import attention_models

    from speedkit.demos import batched as batched_demos
    from speedkit.demos.zoo import ZOO
    from speedkit.frontend.recipe import load_recipe

    out: list[tuple[str, nn.Module, Any]] = []
    for name in sorted(ZOO):
        module, _ = ZOO[name].build("tiny")
        out.append((f"zoo:{name}", module, None))
    for path in sorted((HERE.parent / "recipes").glob("*.yaml")):
        torch.manual_seed(0)
        recipe = load_recipe(path)
        out.append((f"recipe:{path.stem}", recipe.build_model(), None))
    for name, cls in sorted(vars(attention_models).items()):
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == attention_models.__name__:
            try:
                torch.manual_seed(0)
                out.append((f"attention:{name}", cls(), None))
            except TypeError:  # needs arguments: built by its tests only
                continue
    for name in ("LoopOfGEMMs", "SiblingProjections", "HeadsList", "Ensemble"):
        cls = getattr(batched_demos, name)
        try:
            torch.manual_seed(0)
            out.append((f"batched:{name}", cls(), None))
        except TypeError:
            continue
    return out


def _names_reached(fn: Any) -> list[str]:
    """The global and attribute names a compiled function's code (and its nested code) refers to (the
    rewritten method's, inside a library's pass-through wrapper)."""
    fn = getattr(fn, "__func__", fn)
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return sorted(names)


def _rebound(model: nn.Module) -> dict[str, list[str]]:
    """Per submodule path, the instance-bound methods (rewritten forwards) and the names they reach."""
    out: dict[str, list[str]] = {}
    for path, m in model.named_modules():
        for attr in ("forward", "_attn", "mlp_forward"):
            bound = vars(m).get(attr)
            if bound is not None:
                out[f"{path or '<root>'}.{attr}"] = _names_reached(bound)
        for attr, value in vars(m).items():
            if (
                attr not in ("forward", "_attn", "mlp_forward")
                and isinstance(value, types.MethodType)
                and getattr(value, "__self__", None) is m
            ):
                out[f"{path or '<root>'}.{attr}"] = _names_reached(value)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def _site_report(handle: Any) -> Any:
    """The rung's site counts, whatever object carries them (a dict before the rebuild, a typed report after)."""
    report = getattr(handle, "rewrite", None)
    if report is not None and hasattr(report, "as_dict"):
        return _jsonable(report.as_dict())
    return _jsonable(getattr(handle, "sites", None))


def capture() -> dict[str, Any]:
    from speedkit import compat

    # tf32's and autocast's checks on the CPU answer whether it has bf16 instructions, which differs
    # between the machines CI gets (an AMD without them, a Xeon with AMX); the golden copy holds what
    # does not depend on the host, so the capability is pinned to "none", as on the machine that wrote it
    with mock.patch.object(compat, "cpu_has_bf16", lambda: False):
        return _capture()


def _capture() -> dict[str, Any]:
    from speedkit import rungs
    from speedkit.training.state import TrainState

    out: dict[str, Any] = {}
    for label, model, optimizer in _models():
        entry: dict[str, Any] = {"checks": {}, "rewrites": {}}
        state = TrainState(model=model, optimizer=optimizer, device=torch.device("cpu"), precision="fp32")
        for name in CHECKED_RUNGS:
            rung = rungs.make(name)
            try:
                entry["checks"][name] = rung.check(state)
            except Exception as exc:  # recorded: a check that raises must keep raising the same way
                entry["checks"][name] = f"raised {type(exc).__name__}: {exc}"
        for name in REWRITE_RUNGS:
            if entry["checks"][name] is not None:
                continue
            rung = rungs.make(name)
            handle = rung.apply(state)
            entry["rewrites"][name] = {"changes": list(handle.changes), "sites": _site_report(handle), "rebound": _rebound(model)}
            handle.undo()
            assert not _rebound(model), f"{label}: {name}'s undo left bound methods"
        out[label] = entry
    # paths in the reasons name this checkout: written relative to it, so any clone compares equal
    return json.loads(json.dumps(out).replace(str(HERE.parent) + "/", "<repo>/"))


if __name__ == "__main__":
    result = capture()
    text = json.dumps(result, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    if "--write" in sys.argv:
        GOLDEN.write_text(text)
        print(f"wrote {GOLDEN} ({len(result)} models)")
    else:
        print(text)
