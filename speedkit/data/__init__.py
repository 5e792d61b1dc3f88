"""The data seam: where the training step's batches come from (see :mod:`speedkit.data.source`)."""

from speedkit.data.source import (
    BatchSource,
    LoaderSource,
    count_items,
    host_copy,
    move_to_device,
)

__all__ = ["BatchSource", "LoaderSource", "count_items", "host_copy", "move_to_device"]
