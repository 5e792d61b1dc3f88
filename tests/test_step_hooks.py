"""Every hook the engine and the rungs call on a step is declared on :class:`Step`, and a wrapper
forwards it to the step it wraps."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from speedkit.cudagraph.graphed_step import GraphedStep
from speedkit.training.step import PlainStep, Step, StepWrapper

PACKAGE = Path(__file__).resolve().parent.parent / "speedkit"


def _called_on_steps() -> dict[str, str]:
    """Each attribute speedkit reads on ``state.step``, with one place that reads it."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in re.findall(r"\bstate\.step\.([A-Za-z_]\w*)", path.read_text()):
            found.setdefault(name, str(path.relative_to(PACKAGE.parent)))
    return found


def test_every_hook_called_on_a_step_is_declared_on_step():
    called = _called_on_steps()
    assert "memory_outside_peak" in called and "trainer" in called  # the scan sees the engine's and the rungs' calls
    declared = set(dir(Step)) | set(Step.__annotations__)
    assert {name: where for name, where in called.items() if name not in declared} == {}


def test_no_hook_is_looked_up_with_getattr_on_a_step():
    pattern = re.compile(r"(getattr|hasattr)\([\w.]*\bstep\b\s*,")
    found = [str(p.relative_to(PACKAGE.parent)) for p in sorted(PACKAGE.rglob("*.py")) if pattern.search(p.read_text())]
    assert found == []


def _plain() -> PlainStep:
    model = torch.nn.Linear(2, 1)
    return PlainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu")


def test_neutral_defaults_and_explicit_forwarding():
    plain = _plain()
    wrapped = StepWrapper(plain)
    assert plain.memory_outside_peak() == 0 and wrapped.memory_outside_peak() == 0
    assert plain.trainer is None and wrapped.trainer is None
    assert wrapped.loss_fn is plain.loss_fn is not None  # declared on Step (None), forwarded by the wrapper
    plain.scaler = scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert wrapped.scaler is scaler  # the wrapper's declared default does not shadow the wrapped step's
    calls = []
    plain.optimizer_step = lambda: calls.append("stepped")  # type: ignore[method-assign]
    wrapped.optimizer_step()
    assert calls == ["stepped"]


def test_a_wrapper_around_a_graphed_step_reports_the_graphs_memory():
    graphed = GraphedStep(_plain())
    graphed.graph, graphed.graph_bytes = object(), 12345  # a captured graph's pool, as capture leaves it
    assert graphed.memory_outside_peak() == 12345
    assert StepWrapper(graphed).memory_outside_peak() == 12345
    graphed.graph = None
    assert StepWrapper(graphed).memory_outside_peak() == 0
