"""The engine that decides: ``ladder`` orders the phases (diagnose, plan, decide, confirm), each a verb of
its own module: ``baseline`` (the baseline, its diagnosis and the plan), ``cache_check`` (a cached
decision re-checked), ``switches`` (the user's switches as the floor), ``remedy``, ``climb`` and ``trial``
(the rungs tried one by one), ``comparison`` (a decision timed, judged and recorded in the ledger),
``closing_check`` and ``second_look``, ``confirm`` (the bottom line) and ``profile_run``; its mechanisms
are ``stack`` (the kept rungs switched on and off), ``parity`` (trajectories and their calibrated
envelope), ``timing`` (windows and A/B comparisons) and ``budget`` (the trials' one time budget);
``sweep`` the batch-size sweep. The figures are derived from the ledger in :mod:`speedkit.figures`.
Lightning-free: the callbacks in :mod:`speedkit.lightning` and the command line in
:mod:`speedkit.frontend` drive it.
"""
