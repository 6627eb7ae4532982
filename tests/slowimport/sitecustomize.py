"""Test hook (tests/test_e2e.py): with ``LSGD_TEST_SLOW_IMPORT=<module>`` on this directory's
``PYTHONPATH``, importing that module first writes ``LSGD_TEST_SLOW_MARK`` and waits a few
seconds, so that a test can signal a node at that moment of its start, every time."""

import os
import sys
import time

_SLOW = os.environ.get("LSGD_TEST_SLOW_IMPORT")


class _SlowImport:
    def find_spec(self, name, path=None, target=None):
        if name == _SLOW:
            with open(os.environ["LSGD_TEST_SLOW_MARK"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(float(os.environ.get("LSGD_TEST_SLOW_SECONDS", "5")))
        return None  # the normal finders import it


if _SLOW:
    sys.meta_path.insert(0, _SlowImport())
