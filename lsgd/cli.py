"""Command line: ``lsgd train`` runs one node of a job (``train.sh`` calls it).

Examples::

    lsgd train --node-index 0                                  # whole job on this machine
    lsgd train --node-index 0 --num-groups 2 --ip-addr 10.0.0.1  # on node 0 (hosts the server)
    lsgd train --node-index 1 --num-groups 2 --ip-addr 10.0.0.1  # on node 1
    lsgd status --watch          # a running job's progress, from node 0's status page
    lsgd plot runs/lsgd          # its loss, leaders, distances and evaluations: runs/lsgd/plots.png
    lsgd ray --nodes 2 -- WORKERS=2 ITERATIONS=6000   # one node per Ray node (lsgd/ray_launch.py)

Every flag has an environment variable in ``train.sh``; ``lsgd train --help`` lists them all.

Exit status (``lsgd/exitcodes.py``; the last lines say what happened)::

    0    the job finished
    1    this node failed (global server lost for good, no worker left, an internal error)
    2    bad configuration or input (one line names it)
    3    the job finished, but with problems: a worker failed and was not restarted, every
         loss was non-finite, (LSGD) no leader was ever elected, or (a rule without a barrier)
         the node's last deltas never reached the global server
    4    the job was stopped on node 0 (interrupted, or failed); this node stopped cleanly
    130  SIGINT (Ctrl-C) on this node; on node 0 it stops the whole job
    143  SIGTERM on this node; on node 0 it stops the whole job
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import typing
from pathlib import Path

from . import exitcodes, placement, probe, ray_launch
from . import plot as plot_command
from .config import ConfigError, JobConfig, fields
from .files import private_dir, write_atomic
from .lograte import LIVE_LINE_ENV, log_format
from .security import Security, SecurityError, is_loopback
from .status import client as status_command
from .worker.process import check_entry

log = logging.getLogger("lsgd")

READY_TIMEOUT = 30.0  # seconds for the global server process to start listening


class _Parser(argparse.ArgumentParser):
    """Bad arguments end with one line saying what is wrong, not the whole usage text."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lsgd", description="LSGD / EASGD parameter server")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="run one node of a job", formatter_class=_HelpFormatter,
                           epilog=_exit_status())
    hints = typing.get_type_hints(JobConfig)
    for f in fields():
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        optional = type(None) in typing.get_args(kind)

        def convert(text: str, base=base, optional=optional, name=f.name):
            if optional and text.strip().lower() in ("", "none"):
                return None
            if base is bool:
                flag = text.strip().lower()
                if flag in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
                    return flag in ("1", "true", "yes", "on")
                raise argparse.ArgumentTypeError(f"{name} must be 0 or 1, got '{text}'")
            try:
                return base(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name} must be {base.__name__}, got '{text}'")

        train.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=convert,
                           default=f.default, help=f.metadata.get("help"))
    train.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    certs = sub.add_parser("certs", help="create a job CA, one TLS certificate per node and a secret")
    certs.add_argument("--out", required=True, help="directory to write into (created mode 0700)")
    certs.add_argument("--hosts", required=True,
                       help="the nodes' addresses, node 0 first, comma-separated (10.0.0.1,10.0.0.2)")
    certs.add_argument("--days", type=int, default=365, help="validity of the certificates")
    status_command.add_parser(sub)
    plot_command.add_parser(sub)
    sub.add_parser("place", help="this node's place from Slurm's or a Kubernetes Indexed Job's "
                   "environment (train.sh calls it when no node index is given)")
    probe_cmd = sub.add_parser("probe", help="exit 0 when the job's global server answers "
                               "SERVING through gRPC health (a Kubernetes readiness probe; knobs "
                               "from the environment)")
    probe_cmd.add_argument("--live", action="store_true",
                           help="liveness instead: fail only when the global server dropped "
                           "this node (its loop or process is stuck) or, on node 0, its own "
                           "server does not answer")
    ray = sub.add_parser("ray", help="run a job on a Ray cluster, one lsgd node per Ray node "
                         "(lsgd[ray]); exits with the worst node's code")
    ray.add_argument("--nodes", type=int, required=True, help="lsgd nodes, one per Ray node")
    ray.add_argument("--timeout", type=float, default=None,
                     help="seconds for the whole job, then every node is stopped")
    ray.add_argument("--address", default="auto", help="the Ray cluster (auto: this machine's)")
    ray.add_argument("--cpus-per-node", type=float, default=1, help="CPUs each node reserves")
    ray.add_argument("--gpus-per-node", type=float, default=0, help="GPUs each node reserves")
    ray.add_argument("knobs", nargs="*", metavar="KNOB=value",
                     help="train.sh's knobs and the job's environment, after --")
    return parser


def _exit_status() -> str:
    """The exit-status table of this module's docstring, for ``--help``."""
    if not __doc__ or "Exit status" not in __doc__:  # python -OO strips docstrings
        return "exit status: see lsgd/exitcodes.py"
    return "exit status:" + __doc__.split("Exit status", 1)[1].split("::", 1)[1]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the flags' help; the exit-status table kept as written."""


class _Signals:
    """SIGINT/SIGTERM: the first one interrupts the node (``KeyboardInterrupt(signum)``); any
    later one, or one that arrives while the node is already shutting down, is only noted, so
    that the shutdown (stopping workers, removing shared memory, the summary) always finishes."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.server: object | None = None  # the LocalServer, once it exists
        self._told = False

    def handle(self, signum: int, frame: object) -> None:
        if self.first is None and not getattr(self.server, "closing", False):
            self.first = signum
            raise KeyboardInterrupt(signum)
        if not self._told:
            self._told = True
            print("lsgd: already stopping; please wait a few seconds", file=sys.stderr, flush=True)


_signals = _Signals()


def _start_global(config: JobConfig, level: int, security: Security,
                  restore: bool = False) -> tuple[mp.process.BaseProcess, object]:
    """Start the global server process; returns it and the pipe it reports readiness on."""
    from .global_server.server import process_main
    from .local_server.procs import children_ignore_sigint

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    # daemon: multiprocessing terminates it if this process exits by any path
    proc = ctx.Process(target=process_main, args=(config, child, level, security, restore),
                       name="lsgd-global",
                       daemon=True)
    with children_ignore_sigint():  # node 0 decides how its server stops
        proc.start()
    child.close()
    return proc, parent


def _await_global(proc: mp.process.BaseProcess, parent: object) -> int:
    """Wait until the global server listens; returns its port."""
    if not parent.poll(READY_TIMEOUT):
        proc.terminate()
        raise RuntimeError(f"the global server did not start within {READY_TIMEOUT:g} s")
    try:
        status, value = parent.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"the global server exited during start (code {proc.exitcode})") from None
    if status != "ready":
        proc.join(5)
        raise RuntimeError(f"the global server could not start: {value}")
    return value


def _stop_global(proc: mp.process.BaseProcess, wait: float) -> None:
    """Let the global server finish on its own for ``wait`` s (0: ask it to stop now)."""
    if wait <= 0:
        proc.terminate()  # SIGTERM: it stops serving and writes its summary
        wait = 5.0
    proc.join(wait)
    if proc.is_alive():
        log.warning("global server still running after %g s; terminating it", wait)
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class _Supervisor(threading.Thread):
    """Node 0 restarts a global server process that exited unexpectedly (killed by a signal,
    crashed on an error) on the same port, from its saved state (at most ``MAX_RESTARTS``
    times); the nodes reattach. A server that ended on its own decision (the job is over, it
    was stopped, it could not start or restore) tells so on its pipe and is not restarted.
    ``fate()`` says why the server is gone for good (None while it runs or is restarted)."""

    MAX_RESTARTS = 5

    def __init__(self, config: JobConfig, level: int, security: Security,
                 proc: mp.process.BaseProcess, pipe: object = None) -> None:
        super().__init__(name="lsgd-supervisor", daemon=True)
        self.config, self.level, self.security, self.proc = config, level, security, proc
        self.pipe = pipe  # what the server process says about its end
        self.restarts = 0
        self._gone: str | None = None
        self._stop_event = threading.Event()

    def stop(self) -> mp.process.BaseProcess:
        self._stop_event.set()
        self.join(READY_TIMEOUT + 5)
        return self.proc

    def fate(self) -> str | None:
        return self._gone

    def _last_word(self) -> tuple | None:
        """The process's own account of its end, if it gave one."""
        try:
            while self.pipe is not None and self.pipe.poll(0):
                word = self.pipe.recv()
                if word and word[0] in ("ended", "crashed"):
                    return word
        except (EOFError, OSError):
            pass
        return None

    def run(self) -> None:
        while not self._stop_event.wait(0.2):
            code = self.proc.exitcode
            if code is None or self._gone is not None:
                continue
            word = self._last_word()
            if word is not None and word[0] == "ended":
                if code != 0:
                    self._gone = (f"the global server this node started ended with exit code "
                                  f"{code}; see its log lines above")
                return
            why = f"killed by {_signal_name(-code)}" if code < 0 else (
                f"its last error: {word[1]}" if word is not None else "no error reported")
            if self.restarts >= self.MAX_RESTARTS:
                self._gone = (f"the global server this node started died {self.restarts + 1} "
                              f"times (last: exit code {code}, {why}); not restarting it again")
                log.error("%s", self._gone)
                continue
            self.restarts += 1
            log.warning("global server died (exit code %s); restarting it from its saved state "
                        "(%d of at most %d); %s", code, self.restarts, self.MAX_RESTARTS, why)
            proc, ready = _start_global(self.config, self.level, self.security, restore=True)
            self.proc, self.pipe = proc, ready
            try:
                _await_global(proc, ready)
            except RuntimeError as exc:
                log.error("%s", exc)


def _port_taken(config: JobConfig) -> str | None:
    """Node 0: a line saying that ``PORT``, ``SESSION_PORT`` or ``BULK_PORT`` is taken on the address the
    global server binds (the race with another program that takes it after this check ends
    as before, exit 1)."""
    if config.node_index != 0:
        return None
    bind = "127.0.0.1" if is_loopback(config.ip_addr) else "0.0.0.0"
    if config.port and _taken(bind, config.port):
        return (f"PORT {config.port} is taken on {bind} (another lsgd job or another "
                f"program listens there); pick another with PORT=<n> on every node, or "
                f"PORT=0 on a single machine for any free port")
    session = config.session_address
    if session and _taken(bind, session):
        return (f"SESSION_PORT {session} is taken on {bind} (another lsgd job or another "
                f"program listens there{'; empty SESSION_PORT means PORT+2' if config.session_port is None else ''}); "
                "set SESSION_PORT=<n> to a free port, or SESSION_PORT=0 to serve the nodes' "
                "session streams on PORT")
    bulk = config.bulk_address
    if bulk and _taken(bind, bulk):
        return (f"BULK_PORT {bulk} is taken on {bind} (another lsgd job or another program "
                f"listens there{'; empty BULK_PORT means PORT+3' if config.bulk_port is None else ''}); "
                "set BULK_PORT=<n> to a free port, or BULK_PORT=0 to move the parameters on PORT")
    return None


def _taken(bind: str, port: int) -> bool:
    """Whether ``port`` is in use on ``bind`` (anything else the server reports itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            probe.bind((bind, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _data_port_taken(config: JobConfig) -> str | None:
    """PLANE=chain: a line saying that this node cannot listen on ``DATA_HOST:DATA_PORT``
    (taken, or not an address of this machine), before anything starts. A race with another
    program still ends the node later, with the same line."""
    if config.plane != "chain":
        return None
    try:
        host = config.data_listen_host()
    except ConfigError as exc:
        return str(exc)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listener binds
        try:
            probe.bind((host, config.data_port))
        except OSError as exc:
            why = ("is taken" if exc.errno == errno.EADDRINUSE else
                   "is not an address of this machine" if exc.errno == errno.EADDRNOTAVAIL
                   else f"cannot be bound ({exc.strerror})")
            return (f"PLANE=chain: {host}:{config.data_port} {why}; set DATA_PORT to a free port "
                    "(0: any) or DATA_HOST to an address of this machine")
    return None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def train(config: JobConfig, level: int, security: Security) -> int:
    """Run this node (and, on node 0, the global server). Returns the exit code."""
    # One BLAS thread per worker process: workers already use every core.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    global_proc, supervisor, server = None, None, None
    code = exitcodes.FAILED
    try:
        from .local_server.server import LocalServer

        port = config.port
        if config.node_index == 0:
            global_proc, ready = _start_global(config, level, security)
            port = _await_global(global_proc, ready)
            supervisor = _Supervisor(config.replace(port=port), level, security, global_proc,
                                     ready)
            supervisor.start()
        server = LocalServer(config, f"{config.ip_addr}:{port}", level, security)
        if supervisor is not None:
            server.global_fate = supervisor.fate
        _signals.server = server
        code = server.run()
        _print_summary(server.summary, code)
    except KeyboardInterrupt as exc:  # before the node ran: no workers yet
        code = exitcodes.TERMINATED if exc.args == (signal.SIGTERM,) else exitcodes.INTERRUPTED
        reason = "terminated" if code == exitcodes.TERMINATED else "interrupted"
        _early_summary(config, code, reason)
        print(f"lsgd: node {config.node_index}: {reason} while starting", file=sys.stderr,
              flush=True)
    except RuntimeError as exc:
        log.error("%s", exc)
        code = exitcodes.FAILED
        _early_summary(config, code, str(exc))
    finally:
        if supervisor is not None:
            global_proc = supervisor.stop()
        if global_proc is not None:
            finished = code in (exitcodes.OK, exitcodes.DEGRADED)
            # not finished: SIGTERM, and the server tells the nodes that are left (a few s)
            _stop_global(global_proc, wait=config.node_timeout + 5 if finished else 0)
            if finished and global_proc.exitcode not in (0, None):
                log.error("global server exited with code %s", global_proc.exitcode)
                code = exitcodes.FAILED
    return code


def _early_summary(config: JobConfig, code: int, reason: str) -> None:
    """The node's summary when it ended before its local server ran (or could write one)."""
    path = Path(config.run_dir) / f"node{config.node_index}" / "summary.json"
    try:
        write_atomic(path, json.dumps({"node": config.node_index, "stop_reason": reason,
                                       "exit_code": code}, indent=2))
    except OSError as exc:
        log.warning("cannot write %s: %s", path, exc)


def _is_tty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return False


def _print_summary(summary: dict, code: int) -> None:
    """The node's last lines: how it ended, what it did, where to look (local_server/summary.py)."""
    from .local_server.summary import final_lines

    lines = final_lines(summary, code)
    if lines:
        print("\n".join(lines), flush=True)


def _certs(args: argparse.Namespace) -> int:
    from .security import make_certs

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        written = make_certs(args.out, hosts, days=args.days)
    except (SecurityError, OSError) as exc:
        print(f"lsgd: error: {exc}", file=sys.stderr)
        return 2
    print(f"lsgd: wrote {', '.join(p.name for p in written)} to {args.out}")
    print("copy ca.pem, secret, node<i>.pem and node<i>-key.pem to node i (keep ca-key.pem "
          "off the nodes); on node i set TLS_CA, TLS_CERT, TLS_KEY and SECRET_FILE to them")
    return 0


def run() -> int:
    """The ``lsgd`` command (``python -m lsgd`` too): ``main``, and a signal that came before
    the node could handle it itself ends it with that signal's code and one line."""
    try:
        return main()
    except KeyboardInterrupt as exc:
        # lsgd's handler raises it for SIGTERM too (_Signals), with the signal's number
        terminated = exc.args == (signal.SIGTERM,)
        print(f"lsgd: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return exitcodes.TERMINATED if terminated else exitcodes.INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "certs":
        return _certs(args)
    if args.command == "status":
        return status_command.main(args)
    if args.command == "plot":
        return plot_command.main(args)
    if args.command == "place":
        return placement.main()
    if args.command == "probe":
        return probe.main(live=args.live)
    if args.command == "ray":
        return ray_launch.main(args)
    level = getattr(logging, args.log_level)
    if (args.progress_every or 0) > 0 and level <= logging.INFO and _is_tty(sys.stderr):
        os.environ[LIVE_LINE_ENV] = "1"  # every process's log records clear the live line
    logging.basicConfig(level=level, format=log_format(f"node {args.node_index}"))
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(JobConfig)}
    try:
        config = JobConfig(**values)
        security = Security.from_config(config)
    except (ConfigError, SecurityError) as exc:
        print(f"lsgd: error: {exc}", file=sys.stderr)
        return 2
    try:
        private_dir(Path(config.run_dir) / f"node{config.node_index}")  # RUN_DIR too, if new
    except OSError as exc:
        print(f"lsgd: error: cannot create run directory {config.run_dir}: {exc.strerror}",
              file=sys.stderr)
        return 2
    # Explicit handlers: a node started in the background may inherit SIGINT as ignored.
    signal.signal(signal.SIGTERM, _signals.handle)
    signal.signal(signal.SIGINT, _signals.handle)
    if config.resume:
        wanted = [Path(config.run_dir) / f"node{config.node_index}" / "checkpoint.json"]
        if config.node_index == 0:
            wanted.append(Path(config.run_dir) / "global" / "checkpoint.json")
        missing = [str(p) for p in wanted if not p.exists()]
        if missing:
            print(f"lsgd: error: RESUME=1 but {missing[0]} does not exist (no checkpoint in "
                  f"RUN_DIR {config.run_dir}; set CHECKPOINT_EVERY to make them)", file=sys.stderr)
            return 2
    problem = _port_taken(config) or _data_port_taken(config) or check_entry(config.entry)
    if problem:
        print(f"lsgd: error: {problem}", file=sys.stderr)
        return 2
    if not is_loopback(config.ip_addr):
        if security.secret is None:
            log.warning("no job secret (ALLOW_INSECURE=1): anyone who reaches port %d can join "
                        "or disturb this job", config.port)
        elif security.ca is None:
            log.warning("no TLS (TLS_CA/TLS_CERT/TLS_KEY): the parameters cross the network in "
                        "clear text (calls are signed; the secret itself never travels)")
    return train(config, level, security)


if __name__ == "__main__":
    sys.exit(main())
