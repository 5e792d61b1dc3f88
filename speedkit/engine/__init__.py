"""The engine that decides: ``ladder`` climbs the rungs (trials in interleaved windows, parity,
keep or revert, second looks, the user's switches as a floor, the final check), its policy; its
mechanisms are ``stack`` (the kept rungs switched on and off), ``parity`` (trajectories and their
calibrated envelope), ``timing`` (windows and A/B comparisons) and ``budget`` (the trials' time),
its later phases the verbs of ``closing_check``, ``second_look``, ``switches`` and ``profile_run``;
``sweep`` the batch-size sweep; ``attribution`` each kept rung's share of the gain. Lightning-free: the
callbacks in :mod:`speedkit.lightning` and the command line in :mod:`speedkit.frontend` drive it.
"""
