"""The run's figures, derived in one place: :func:`~speedkit.figures.account.account` turns a report's
record (its baseline, its ledger of decisions with their paired comparisons, the final configuration)
into every number the report, the console and the decision cache print; :mod:`~speedkit.figures.attribution`
adds what each kept rung moved in the profile. Plain dicts in, plain dicts out: nothing here measures,
decides or imports the engine.
"""
