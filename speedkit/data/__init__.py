"""The data seam: where the training step's batches come from (see :mod:`speedkit.data.source`)."""

from speedkit.data.source import BatchSource, count_items, host_copy, move_to_device

__all__ = ["BatchSource", "count_items", "host_copy", "move_to_device"]
