"""``python -m lsgd`` is the ``lsgd`` command."""

import signal
import sys

# A node started in the background (a non-interactive shell's ``&``, many CI runners and job
# launchers) inherits SIGINT as ignored. lsgd handles Ctrl-C (kill -INT) from here on, so that
# one arriving while it still imports its parts is not lost: the node would train on (the
# node's own handler, cli._Signals, is installed once those imports are done).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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
