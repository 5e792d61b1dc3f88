"""What a user calls: ``cli`` the ``speedkit`` command (optimize, fit, sweep, validate, report,
compare); ``recipe`` recipes read and validated; ``runner`` the Trainer a recipe describes, run with the
callbacks; ``api`` :func:`speedkit.apply` for plain PyTorch loops; ``progress`` progress bars.
"""
