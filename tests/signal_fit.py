"""A fit with SpeedLadder and a 2-worker loader, run as its own process by tests/test_signals.py, which
signals its process group. Prints what the tests read: each event, ``STOP SEEN`` lines where a rung
began after the signal came, whether the model and optimizer state at the fit's end are those before
the trials, and how ``trainer.fit`` ended.

Usage: python tests/signal_fit.py REPORT_DIR [--no-speedkit]
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import lightning.pytorch as pl  # noqa: E402
from test_lightning import QUICK, UserModel, _trainer  # noqa: E402

from speedkit.lightning import SpeedLadder  # noqa: E402

RUNG_BEGINS = re.compile(r"^\[\d+/\d+\] \S+$")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class BeforeTrials(pl.Callback):
    """Its on_train_start runs before SpeedLadder's: the state the trials must leave as they found it."""

    def __init__(self) -> None:
        self.model = self.optimizer = None
        self.steps = 0

    def on_train_start(self, trainer, pl_module):
        self.model = copy.deepcopy(pl_module.state_dict())
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.steps += 1
        if self.steps == 3:
            print("FIT STEP 3", flush=True)

    def on_exception(self, trainer, pl_module, exception):
        if self.steps == 0 and self.model is not None:  # stopped in the trials: nothing of them stays
            same = _same(self.model, pl_module.state_dict()) and _same(self.optimizer, trainer.optimizers[0].state_dict())
            print("STATE SAME" if same else "STATE CHANGED", flush=True)
        print(f"ON EXCEPTION {type(exception).__name__}", flush=True)


def main() -> None:
    report_dir = sys.argv[1]
    model = UserModel(n=4096, workers=2)
    before = BeforeTrials()
    callbacks: list[pl.Callback] = [before]
    if "--no-speedkit" not in sys.argv:
        ladder = SpeedLadder(trials="always", measure={**QUICK, "budget_s": 60.0}, report_dir=report_dir, cache=False)

        def on_event(line: str) -> None:  # the signal is sent once a line is read: look before printing it
            if RUNG_BEGINS.match(line) and ladder._ladder is not None and ladder._ladder.stop.received:
                print(f"STOP SEEN: a rung began after {ladder._ladder.stop.received}: {line}", flush=True)
            print(line, flush=True)

        ladder.on_event = on_event
        callbacks.append(ladder)
    trainer = _trainer(callbacks, max_steps=2000)
    try:
        trainer.fit(model)
    except BaseException as exc:
        print(f"FIT RAISED {type(exc).__name__}", flush=True)
        raise
    print("FIT RETURNED", flush=True)


if __name__ == "__main__":
    main()
