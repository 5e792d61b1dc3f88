"""speedkit: climb the quick-win ladder on your PyTorch training loop, and prove every step.

Plain PyTorch (no Lightning needed)::

    import speedkit
    sk = speedkit.apply(model, optimizer, loader, rungs=["tf32", "autocast", "fused_optimizer", "compile"])
    for epoch in range(3):
        for i, batch in enumerate(sk.batches()):  # one epoch of the loader; or your own loop: sk.autocast(), ...
            loss = sk.step(batch, i)
    sk.undo()                                     # everything back as it was

With Lightning: ``Trainer(callbacks=[speedkit.lightning.SpeedLadder(rungs=[...])])``.
To measure which rungs pay off on your model: ``speedkit optimize recipe.yaml``.
"""

from __future__ import annotations

from speedkit.errors import ConfigError, SpeedkitError, UnsupportedError
from speedkit.frontend.api import Applied, apply

__version__ = "0.1.0"

__all__ = ["Applied", "ConfigError", "SpeedkitError", "UnsupportedError", "__version__", "apply"]
