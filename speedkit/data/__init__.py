"""The data path: where the training step's batches come from and how they get there.

:mod:`~speedkit.data.source` the ``BatchSource`` seam; :mod:`~speedkit.data.batch` the one walker over a
batch's structure; :mod:`~speedkit.data.rng` the one random-state type; :mod:`~speedkit.data.settings` a
loader's settings and its rebuilt copy; :mod:`~speedkit.data.workers` whether samples depend on their
worker; :mod:`~speedkit.data.topology` the host's CPUs; :mod:`~speedkit.data.choose` settings chosen by
measurement; :mod:`~speedkit.data.prefetch`, :mod:`~speedkit.data.ring` and :mod:`~speedkit.data.static`
the copy to the device. Nothing here knows Lightning (its binding: :mod:`speedkit.lightning.data`).
"""

from speedkit.data.batch import count_items, host_copy, move_to_device
from speedkit.data.source import BatchSource

__all__ = ["BatchSource", "count_items", "host_copy", "move_to_device"]
