"""Benchmarks of lsgd's performance targets (issue 3): ``python -m bench [--quick]``.

Every benchmark measures a baseline in the same run and reports the ratio; results go to
``bench/results.json`` and the results block of ``docs/benchmarks.md``.
"""
