"""The user's optimizer as its checkpoints see it while rungs change it.

Rungs switch flags on the user's own optimizer object (``fused_optimizer``: fused/foreach;
``cuda_graph``: capturable) and move its step counters to the device. A checkpoint written
meanwhile (Lightning's ``ModelCheckpoint``, or the user's own ``optimizer.state_dict()``) must be
the one the user's own configuration writes: loaded later into the user's optimizer without
speedkit, it must not turn that optimizer fused or capturable or leave its step counters on the
device.

:class:`SavedAsUser` does that through the optimizer's public state-dict hooks, while a rung's
change is on: ``state_dict()`` writes the user's values of the flags the rung switched (the live
optimizer is not touched), and ``load_state_dict()`` (resuming a fit with the rung applied) is
followed by the rung's change made again on the loaded state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from speedkit import compat

#: a saved param group (its "params" are indices) and its position -> the user's values of what the rung changed
UserValues = Callable[[int, dict[str, Any]], dict[str, Any]]


class SavedAsUser:
    """While on, ``optimizer.state_dict()`` holds ``user_values(i, group)`` in each param group ``i``;
    in the groups where the rung moved the step counters to the device (``moved_steps(i)``), they are
    saved on the CPU unless the saved flags keep them on the device, as the rung's undo puts them.
    After ``optimizer.load_state_dict()``, ``again()`` runs (the rung's change made on the loaded
    state). ``on``/``off`` register and remove the hooks."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        user_values: UserValues,
        moved_steps: Callable[[int], bool],
        again: Callable[[], None],
    ) -> None:
        self.optimizer = optimizer
        self.user_values = user_values
        self.moved_steps = moved_steps
        self.again = again
        self._hooks: list[Any] = []

    def on(self) -> None:
        if not self._hooks:
            self._hooks = [
                self.optimizer.register_state_dict_post_hook(self._as_user),
                self.optimizer.register_load_state_dict_post_hook(self._loaded),
            ]

    def off(self) -> None:
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()

    def _as_user(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state = state_dict["state"]
        for i, group in enumerate(state_dict["param_groups"]):  # the saved groups are copies; their values are not
            group.update(self.user_values(i, group))
            if self.moved_steps(i):
                steps_where_saved_flags_keep_them(state, group)
        return state_dict

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self.again()


def steps_where_saved_flags_keep_them(state: dict[Any, dict[str, Any]], group: dict[str, Any]) -> None:
    """The saved step counters of ``group``'s parameters (indices) moved where its saved flags keep them
    (:func:`speedkit.compat.step_counter_device`); the per-parameter entries changed are copies (the live
    ones are the optimizer's own)."""
    for index in group["params"]:
        entry = state.get(index)
        step = entry.get("step") if entry is not None else None
        if isinstance(step, torch.Tensor):
            device = compat.step_counter_device(group, step)
            if step.device != device:
                state[index] = {**entry, "step": step.to(device)}
