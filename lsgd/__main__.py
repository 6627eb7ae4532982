"""``python -m lsgd`` is the ``lsgd`` command."""

import sys

try:
    from .cli import run
except KeyboardInterrupt:  # Ctrl-C while Python was still importing lsgd
    print("lsgd: interrupted", file=sys.stderr)
    sys.exit(130)
except ModuleNotFoundError as exc:  # run by a Python without lsgd's dependencies
    print(f"lsgd: error: {sys.executable} cannot import '{exc.name}', which lsgd needs; run "
          "it with the Python lsgd was installed into (activate its virtualenv, or set "
          "PYTHON for train.sh), or install lsgd there: pip install -e .", file=sys.stderr)
    sys.exit(2)

sys.exit(run())
