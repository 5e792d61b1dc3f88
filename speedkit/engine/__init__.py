"""The engine that decides: ``ladder`` climbs the rungs (trials in interleaved windows, parity,
keep or revert, second looks, the user's switches as a floor, the final check); ``sweep`` the
batch-size sweep; ``attribution`` each kept rung's share of the gain. Lightning-free: the callbacks in
:mod:`speedkit.lightning` and the command line in :mod:`speedkit.frontend` drive it.
"""
