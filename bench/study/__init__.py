"""The algorithm study (issue 14): ``python -m bench.study [--quick]``; see ``__main__.py``."""
