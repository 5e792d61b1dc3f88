"""The user's training run as speedkit drives it, beneath every rung.

``step`` the training step (:class:`~speedkit.training.step.Step`: forward and loss, backward, optimizer
step; ``PlainStep`` for plain PyTorch, the Lightning one in :mod:`speedkit.lightning.step`); ``state``
what a rung acts on (:class:`~speedkit.training.state.TrainState`); ``snapshot`` the state saved and
restored around trials; ``accumulate`` the out-of-memory fallback (micro-batches); ``saved_optimizer`` checkpoints that hold the user's optimizer flags;
``lagged_scalars`` per-step scalars read without a host sync.
"""
