"""The global server process: gRPC server, ticker, run summary.

``create_server(address, servicer)`` binds (port 0 picks a free port) and returns
``(server, port)``. ``serve(config, ...)`` runs the whole process until the job has finished and
every node has left (or been dropped), or the job was stopped and every node has been told.
SIGTERM before the job's end stops the job (the nodes are told, as when node 0 stops it); a
second SIGTERM stops the server at once. In node 0's process group, SIGINT (Ctrl-C) is left to
node 0, which stops the job.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from ..config import JobConfig
from ..files import private_dir, write_atomic
from ..lograte import log_format
from ..proto import lsgd_pb2_grpc as pb_grpc
from ..security import Security, is_loopback
from ..status.http import start_status_page
from ..wire import GRPC_OPTIONS
from .admission import Admission, Limits
from .aio_session import SessionServer
from .bulk import BulkServer
from .coordinator import Coordinator, Schedule
from .journal import Journal
from .buffers import CENTER
from .params import ParamStore
from .probes import add_probes
from .saves import norm
from .servicer import GlobalServicer

log = logging.getLogger(__name__)

SERVER_OPTIONS = GRPC_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),  # accept the clients' keepalive
    ("grpc.so_reuseport", 0),  # a second server on the same port fails instead of sharing it
]


def stop_linger(config: JobConfig) -> float:
    """Seconds the server serves on after a job stop so that every node hears of it: three
    heartbeat intervals of the nodes (``LocalServer``: every ``min(1, node_timeout/5)`` s; a
    beat may be skipped once after the node loop's own call was answered) and a margin. It
    ends sooner once every live node has been told."""
    return 3 * min(1.0, config.node_timeout / 5) + 1.0


def build_servicer(config: JobConfig) -> GlobalServicer:
    """The servicer of a job described by ``config``."""
    rule = config.make_rule()
    schedule = Schedule.for_job(num_groups=config.num_groups, workers=config.workers,
                                l_comm=config.l_comm, g_comm=config.g_comm,
                                local_rounds=rule.has_local_rounds(config.num_groups),
                                max_iterations=config.iterations, rounds=rule.synchronous)
    now = time.monotonic()
    coord = Coordinator(job_id=config.job_id, algorithm=config.rule_spec,
                        num_groups=config.num_groups, workers=config.workers, schedule=schedule,
                        max_seconds=config.minutes * 60 if config.minutes else None,
                        node_timeout=config.node_timeout, round_timeout=config.round_timeout,
                        join_timeout=config.join_timeout, now=now, eval_every=config.eval_every,
                        checkpoint_every=config.checkpoint_every)
    servicer = GlobalServicer(coord, ParamStore(rule), config.round_timeout)
    servicer.drop_grace = config.reconnect_timeout + 10.0
    servicer.routes.fanout = config.plane_fanout
    return servicer


class GlobalServers:
    """The global server's servers: the synchronous gRPC one (every call) and, where asked, the
    session port's (``aio_session.py``) and the bulk port
    (``bulk.py``). ``stop`` stops them all; anything else is the synchronous server's."""

    def __init__(self, server: grpc.Server, sessions: SessionServer | None,
                 bulk: BulkServer | None = None) -> None:
        self.server, self.sessions, self.bulk = server, sessions, bulk

    def stop(self, grace: float | None) -> threading.Event:
        if self.sessions is not None:
            self.sessions.stop(grace or 0.0)
        if self.bulk is not None:
            self.bulk.stop()
        return self.server.stop(grace)

    def __getattr__(self, name: str) -> object:
        return getattr(self.server, name)


def create_server(address: str, servicer: GlobalServicer, security: Security | None = None,
                  limits: Limits | None = None,
                  session_address: str | None = None,
                  bulk_address: str | None = None) -> tuple[GlobalServers, int]:
    """Create and start a gRPC server on ``address`` ("host:port"); returns (server, port).

    With ``security``, calls must be signed with its secret (and, under mutual TLS, come from
    the node their certificate names), and the port speaks TLS when it has a certificate.
    ``limits`` caps parameter streams and long-polls (default: sized from the servicer's job,
    ``Limits.for_job``); the thread pool has ``limits.threads`` threads, of which parameter
    streams never take more than ``limits.streams``. The call counts are in
    ``servicer.calls.counts``, refusals and cancellations in ``servicer.admission``, failed
    calls in ``servicer.stats``. The server also answers gRPC health checks (SERVING until the
    job is over, ``servicer.health``) and server reflection (``probes.py``).

    With ``session_address``, the nodes' session streams get a plain-socket server there too
    (``aio_session.py``); Join answers tell the nodes its port (``servicer.session_port``).
    With ``bulk_address``, parameter uploads and downloads also have a bulk port there
    (``bulk.py``; ``servicer.bulk_port``). Neither under TLS: their connections are not
    encrypted.
    """
    security = security or Security()
    limits = limits or Limits.for_job(servicer.coord.num_groups, servicer.round_timeout)
    servicer.admission = Admission(limits)
    checks = security.server_interceptors()
    sessions = bulk = None
    if bulk_address is not None and (security.ca is not None or security.cert is not None):
        log.info("no bulk port under TLS (its connections are not encrypted): parameter "
                 "vectors move on gRPC streams on PORT")
    elif bulk_address is not None:
        bulk = BulkServer(servicer, security.secret, limits)
        try:
            servicer.bulk_port = bulk.start(bulk_address)
        except OSError as exc:
            raise OSError(f"{exc} (BULK_PORT, the nodes' parameter transfers; empty: PORT+3); "
                          "set BULK_PORT to a free port, or 0 to move them on PORT") from None
    tls = security.ca is not None or security.cert is not None
    if session_address is not None and tls:
        log.info("no session port under TLS (its connections are not encrypted): the nodes' "
                 "session streams go to PORT")
    elif session_address is not None:  # first: a port it cannot have leaves nothing bound
        sessions = SessionServer(servicer, limits, security.secret, checks[0].verifier)
        try:
            servicer.session_port = sessions.start(session_address)
        except OSError as exc:
            sessions.stop(0)
            if bulk is not None:
                bulk.stop()
                servicer.bulk_port = 0
            raise OSError(f"{exc} (SESSION_PORT, the nodes' session streams; empty: PORT+2); "
                          "set SESSION_PORT to a free port, or 0 to serve them on PORT") from None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=limits.threads,
                                                    thread_name_prefix="lsgd-global"),
                         options=SERVER_OPTIONS,
                         interceptors=[servicer.stats.interceptor, *checks, servicer.calls,
                                       servicer.admission])
    pb_grpc.add_GlobalServerServicer_to_server(servicer, server)
    coord = servicer.coord
    servicer.health = add_probes(server, serving=not (coord.finished or coord.stopped is not None),
                                 node_health=servicer.node_health)
    creds = security.server_credentials()
    try:
        try:
            port = (server.add_secure_port(address, creds) if creds
                    else server.add_insecure_port(address))
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address}: {exc}") from exc
        if port == 0:
            raise OSError(f"cannot listen on {address} (address in use or not local)")
    except OSError:
        if sessions is not None:
            sessions.stop(0)
            servicer.session_port = 0
        if bulk is not None:
            bulk.stop()
            servicer.bulk_port = 0
        raise
    server.start()
    servicer.bulk_server = bulk  # its counts for /metrics and the summary (None: off)
    return GlobalServers(server, sessions, bulk), port


def serve(config: JobConfig, ready: "object | None" = None, stop_event: threading.Event | None = None,
          security: Security | None = None, restore: bool = False, resume: bool = False) -> int:
    """Run the global server until the job is over. Returns an exit code.

    Args:
        config: the job configuration.
        ready: a connection (multiprocessing Pipe end) that receives ``("ready", port)`` or
            ``("error", message)`` once, when the server is listening or has failed to.
        stop_event: set to stop early (tests); SIGINT/SIGTERM do the same in a process.
        restore: go on from the state an earlier server process of this job saved in
            ``RUN_DIR/global`` (counter, membership, leader, center); it is saved every
            ``state_every`` seconds.
        resume: start a stopped job again from its last checkpoint (``RESUME=1``): counter,
            rounds, leader and center as they were at the checkpoint round; nodes join afresh.
    """
    stop = stop_event or threading.Event()  # stop serving now
    halt = threading.Event()  # stop the job: tell the nodes, then stop serving
    if threading.current_thread() is threading.main_thread():
        def on_signal(*_: object) -> None:
            (stop if halt.is_set() else halt).set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) != signal.SIG_IGN:
                signal.signal(sig, on_signal)
    servicer = build_servicer(config)
    out = Path(config.run_dir) / "global"
    private_dir(out)
    state_file, params_file = out / "state.json", out / "params.npz"
    ckpt_file, ckpt_params = out / "checkpoint.json", out / "checkpoint.npz"
    journal = Journal(out)
    if not restore:
        journal.clear()  # of an earlier run in this RUN_DIR
    if restore or resume:
        try:
            if resume:
                _restore(servicer, ckpt_file, ckpt_params, membership=False)
            else:
                _restore(servicer, state_file, params_file, journal=journal)
        except (OSError, ValueError, KeyError, IndexError) as exc:
            msg = f"cannot restore the global server's state from {out}: {exc}"
            if ready is not None:
                ready.send(("error", msg))
            log.error("%s", msg)
            return 1
    servicer.journal = journal.write
    bind = "127.0.0.1" if is_loopback(config.ip_addr) else "0.0.0.0"
    try:
        session, bulk_at = config.session_address, config.bulk_address
        ports = {"session_address": None if session is None else f"{bind}:{session}",
                 "bulk_address": None if bulk_at is None else f"{bind}:{bulk_at}"}
        while True:
            try:
                server, port = create_server(f"{bind}:{config.port}", servicer,
                                             security=security, **ports)
                break
            except OSError as exc:
                taken = next((k for k, name in (("session_address", "SESSION_PORT"),
                                                ("bulk_address", "BULK_PORT"))
                              if ports[k] is not None and name in str(exc)), None)
                if not restore or taken is None:
                    raise
                # A restart mid-job: the nodes are waiting; what that port carries can go to
                # PORT (every node falls back to it when the port does not answer).
                log.warning("%s; this restarted server goes on without it (the nodes use PORT)",
                            exc)
                ports[taken] = None
    except OSError as exc:
        if ready is not None:
            ready.send(("error", str(exc)))
        log.error("%s", exc)
        return 1
    write_atomic(out.parent / "global.port", f"{port}\n")
    write_atomic(out / "server.pid", f"{os.getpid()}\n")
    log.info("global server listening on %s:%d (job %s)%s%s", bind, port, config.job_id,
             f"; session streams on port {servicer.session_port}" if servicer.session_port else "",
             f"; bulk transfers on port {servicer.bulk_port}" if servicer.bulk_port else "")
    if config.tls_ca is not None:
        log.info("no session port and no bulk port under TLS (their connections are "
                 "authenticated, not encrypted): the nodes' session streams and transfers stay "
                 "on PORT")
    servicer.board.restarts = _count_restarts(out, restore)
    page = start_status_page(config, servicer, security.secret if security else None, out,
                             restore=restore)
    if ready is not None:
        ready.send(("ready", port))
    coord = servicer.coord
    t0 = time.monotonic()
    parent = os.getppid()
    saved_state, next_save = None, t0
    linger, why, halting = stop_linger(config), "stopped", False
    try:
        while not stop.wait(0.1):
            if halt.is_set() and not halting:
                halting = True
                if not servicer.halt("terminated") and coord.stopped is None:
                    why = "stopped by a signal"
                    break  # nothing to stop (finished, or no node): nobody to tell
            servicer.tick()
            if servicer.checkpoint_due is not None:
                _checkpoint(servicer, ckpt_file, ckpt_params, config.round_timeout, params_file)
            if time.monotonic() >= next_save:
                saved_state = _save(servicer, state_file, params_file, saved_state)
                next_save = time.monotonic() + config.state_every
            with servicer.cond:
                if coord.all_gone:
                    why = "every node left"
                    break
                if coord.stop_settled(servicer.clock(), linger):
                    break  # the job was stopped and every node has been told
                if not coord.nodes and time.monotonic() - t0 > config.join_timeout:
                    why = f"no node joined within {config.join_timeout:g} s"
                    log.error("%s", why)
                    break
            if ready is not None and os.getppid() != parent:
                why = "node 0 (which started this server) exited"
                log.error("%s; stopping", why)
                break
    finally:
        servicer.health(False)  # probes see the end before the port closes
        server.stop(grace=1.0).wait(5.0)
        if page is not None:
            page.stop()
        _save(servicer, state_file, params_file, saved_state)
        journal.close()
        _, bytes_in, bytes_out = servicer.stats.copy()
        with servicer.cond:
            # an orderly end: the job finished, or was stopped and its nodes told
            code = 0 if coord.finished or coord.stopped is not None else 1
            summary = coord.snapshot() | {"finished": coord.finished, "pid": os.getpid(),
                                          "parameter_bytes": {"in": bytes_in, "out": bytes_out},
                                          "calls": dict(servicer.calls.counts),
                                          "session_port": servicer.session_port,
                                          "bulk_port": servicer.bulk_port,
                                          "bulk_transfers": None if server.bulk is None
                                          else server.bulk.counts(),
                                          "refused": dict(servicer.admission.refused),
                                          "cancelled": dict(servicer.admission.cancelled),
                                          "rule_failures": servicer.params.rule_failures,
                                          "center_deltas": {
                                              "applied": servicer.params.deltas.applied,
                                              "continued": servicer.params.deltas.retried,
                                              "lost": servicer.params.deltas.lost},
                                          "mail": None if servicer.params.mail is None else {
                                              "posted": servicer.params.mail.posted,
                                              "delivered": servicer.params.mail.delivered,
                                              "weight_held": servicer.params.mail.weights_held()},
                                          "seconds": round(time.monotonic() - t0, 3),
                                          "exit_code": code}
            summary["stop_reason"] = coord.stop_reason or why
        write_atomic(out / "summary.json", json.dumps(summary, indent=2, default=str))
        log.info("global server stopped: counter %d, %d rounds, %s", coord.done,
                 coord.rounds_opened, summary["stop_reason"])
    return code


def _count_restarts(out: Path, restore: bool) -> int:
    """How many times this job's global server was started again (restores), kept in
    ``out/restarts``."""
    path, count = out / "restarts", 0
    if restore:
        try:
            count = int(path.read_text().strip()) + 1
        except (OSError, ValueError):
            count = 1
    write_atomic(path, f"{count}\n")
    return count


def _save(servicer: GlobalServicer, state_file: Path, params_file: Path, last: dict | None) -> dict:
    """Save the coordinator's state (if it changed) and the leader/center (if they changed)."""
    with servicer.cond:
        state = servicer.state_dump()
    comparable = state | {"elapsed": None, "dump": None}
    if comparable != last:
        write_atomic(state_file, json.dumps(state))
    servicer.params.save(params_file)
    return comparable


def _checkpoint(servicer: GlobalServicer, state_file: Path, params_file: Path,
                round_timeout: float, fallback: Path | None = None) -> None:
    """The server's part of a checkpoint: its state at the checkpoint round, and the leader and
    center once that round's exchange has settled (the nodes save theirs after it too). Called
    by the server loop until it is done (or the round is long past)."""
    with servicer.cond:
        rid, state = servicer.checkpoint_due
        ex = servicer.params.exchange
        settled = ex is not None and (ex.round_id > rid or (ex.round_id == rid and ex.settled))
        late = servicer.clock() - servicer.checkpoint_since > round_timeout + 5
    if not settled and not late:
        return  # next pass of the loop
    if servicer.params.writing and not late:
        return  # an upload is in flight: the round's values may still be whole a moment later
    # a vector still being written when the round is long past comes from the newest state save
    servicer.params.save(params_file, force=True, fallback=fallback)
    write_atomic(state_file, json.dumps(state | {"round": rid}))
    with servicer.cond:
        servicer.checkpoint_due = None
    log.info("checkpoint at round %d (counter %d)", rid, state["done"])


def _restore(servicer: GlobalServicer, state_file: Path, params_file: Path,
             membership: bool = True, journal: Journal | None = None) -> None:
    state = json.loads(state_file.read_text())
    if journal is not None:
        state = journal.load(state)  # newer rounds or members written since that save
    with servicer.cond:
        servicer.dumps = int(state.get("dump", 0))
        servicer.coord.restore(state, servicer.clock(), membership=membership)
    center = "no center"
    if params_file.exists():
        servicer.params.load(params_file)
        if servicer.params.center_ready:  # a fingerprint: which center came back
            center = f"center norm {norm(servicer.params.buffers[CENTER]):.6g}"
    log.warning("restored: counter %d, %d rounds, nodes %s, %s; waiting for them to reattach",
                servicer.coord.done, servicer.coord.rounds_opened, sorted(servicer.coord.nodes),
                center)


def process_main(config: JobConfig, conn: object, log_level: int,
                 security: Security | None = None, restore: bool = False) -> None:
    """Entry point of the global server process started by node 0 (spawn context)."""
    import sys

    logging.basicConfig(level=log_level, format=log_format("global"))
    # Ctrl-C reaches node 0's whole process group: node 0 decides (it stops the job, and then
    # this server); SIGTERM stops the job from here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a restart during a resumed job goes on from the newest state, not the checkpoint again
    try:
        code = serve(config, ready=conn, security=security, restore=restore,
                     resume=config.resume and not restore)
    except Exception as exc:  # a bug or a full disk: node 0's supervisor restarts the server
        log.exception("global server failed")
        _tell(conn, ("crashed", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    _tell(conn, ("ended", code))  # its own decision (job over, stopped): not restarted
    sys.exit(code)


def _tell(conn: object, message: tuple) -> None:
    """Tell node 0 (the ready pipe) how this process ends; it may be gone already."""
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass
