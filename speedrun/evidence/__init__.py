"""Evidence: parse run logs, judge them statistically, write records folders, check the node.

Modules: ``logparse`` (our and upstream logs -> :class:`RunSummary`), ``stats`` (t-tests and
tables, scipy.stats), ``records`` (:func:`write_records`: logs, results.json, README.md, plots),
``plots`` (matplotlib PNGs), ``fingerprint`` (node description and measured matmul/copy ceilings),
``doctor`` (preflight checks).  Importing any of them touches no GPU and no plotting backend.
"""
