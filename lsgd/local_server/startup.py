"""How a node starts: it waits for the global server, starts its workers, learns their model's
size, creates its shared memory, joins the job and sets every worker up (a mixin of
``LocalServer``, ``server.py``). Every wait is bounded: ``CONNECT_TIMEOUT`` for the global server,
``START_TIMEOUT`` for the workers."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
from typing import Callable

import grpc

from ..global_server.membership import FINISHING
from ..rules import ops
from ..rules.base import CENTER, Exchange
from ..worker.client import WorkerContext
from ..worker.process import worker_main
from . import gpus
from . import messages as m
from .async_node import AsyncNode, buffer_names
from .evaluation import Evaluator
from .global_client import GlobalUnreachable, stop_reason_of
from .heartbeat import Heartbeat
from .liveness import stale_after
from .procs import start_process
from .round_runner import SAVE_LIMIT
from .state import JoinedTooLate, JoinRefused, NodeError, WorkerState
from .store import NodeStore, StoreLayout, reclaim_semaphores, reclaim_stale, remember_semaphores

log = logging.getLogger("lsgd.local_server.server")

START_TIMEOUT = 300.0  # seconds for workers to build their models and say hello


class StartupMixin:
    """From start to training (methods of ``LocalServer``)."""

    def _wait_for_global(self) -> None:
        self.view.wait(f"waiting for the global server at {self.address}", "CONNECT_TIMEOUT",
                       self.cfg.connect_timeout)
        end = time.monotonic() + self.cfg.connect_timeout
        self._wait_for_name(end)
        try:
            grpc.channel_ready_future(self.client._channel).result(
                timeout=max(0.1, end - time.monotonic()))
        except grpc.FutureTimeoutError:
            raise GlobalUnreachable(
                f"global server at {self.address} unreachable for {self.cfg.connect_timeout:g} s "
                "(is node 0 running? check IP_ADDR and PORT)") from None

    def _wait_for_name(self, end: float) -> None:
        """Node 0's name may not resolve yet (a Kubernetes pod's Service name before the pod
        is up): say so once, and retry until ``end``."""
        host, said = self.cfg.ip_addr, False
        while True:
            try:
                socket.getaddrinfo(host, self.cfg.port, type=socket.SOCK_STREAM)
                return
            except socket.gaierror as exc:
                if time.monotonic() >= end:
                    raise GlobalUnreachable(
                        f"node 0's address {host} (IP_ADDR) did not resolve within "
                        f"{self.cfg.connect_timeout:g} s (CONNECT_TIMEOUT): {exc.strerror}"
                    ) from None
                if not said:
                    said = True
                    log.warning("node 0's address %s (IP_ADDR) does not resolve yet (%s); "
                                "retrying for up to %g s (CONNECT_TIMEOUT)", host, exc.strerror,
                                self.cfg.connect_timeout)
                time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    def _start_workers(self) -> None:
        reclaim_semaphores(self.dir)  # of a run of this node killed outright, before ours exist
        self.gpus = gpus.node_gpus(self.cfg.devices or "")
        if (line := gpus.describe(self.gpus, self.cfg.workers, self.cfg.devices or "")) is not None:
            log.info("node %d: %s", self.cfg.node_index, line)
        if (why := gpus.unseen(self.cfg.devices or "")) is not None:
            log.warning("node %d: %s", self.cfg.node_index, why)
        for i in range(self.cfg.workers):
            proc, replies = self._spawn(i, evaluator=False, name=f"worker-{self.cfg.worker_id(i)}", restarts=0)
            self.workers.append(WorkerState(i, self.cfg.worker_id(i), proc, replies, time.monotonic()))
        if self.cfg.eval_every and self.cfg.node_index == 0:
            self.evaluator = Evaluator(*self._spawn(m.EVALUATOR, evaluator=True, name="evaluator"))

    def _spawn(self, local: int, evaluator: bool, name: str,
               restarts: int = 0) -> tuple[mp.process.BaseProcess, object]:
        replies = self.mp.Queue()
        remember_semaphores(self.dir, replies)
        sender = self.inbox.open()
        ctx = WorkerContext(self.cfg, local, sender, replies, os.getpid(), self.beat, evaluator,
                            restarts, gpus.for_worker(self.gpus, local))
        proc = start_process(self.mp, worker_main, (ctx, self.log_level), f"lsgd-{name}")
        self.inbox.bind(sender, proc.pid)
        return proc, replies

    def _hear_from_workers(self, kind: type, end: float, key: str, doing: str, late: str,
                           other: "Callable[[object], None] | None" = None) -> dict[int, object]:
        """Every live worker's ``kind`` message (by local index), waited for until ``end``
        (then NodeError: the workers did not ``late`` in time); ``other`` takes any other
        message meanwhile (else it is dropped)."""
        got: dict[int, object] = {}
        while len(got) < len(self._live()):
            if time.monotonic() > end:
                raise NodeError(f"workers did not {late} within {START_TIMEOUT:g} s")
            self.view.wait(f"{doing} {len(self._live())} workers: {len(got)} ready", key=key)
            msg = self._recv()
            if isinstance(msg, kind):
                got[msg.local] = msg
            elif msg is not None and other is not None:
                other(msg)
        return got

    def _handshake(self) -> None:
        end = time.monotonic() + START_TIMEOUT
        hellos = self._hear_from_workers(m.Hello, end, "start", "starting", "start")
        counts = {local: (h.param_count, h.stats_count, h.average_stats)
                  for local, h in hellos.items()}
        sizes = set(counts.values())
        if len(sizes) != 1:
            raise NodeError(f"workers built models of different sizes {sorted(sizes)} (parameters, "
                            "statistics); every worker must build the same model")
        ((param_count, self.stats_count, self.average_stats),) = sizes
        self.param_count = param_count
        names = (self.rule.node_buffers if self.rule.synchronous
                 else buffer_names(self.rule, self.cfg.workers))
        layout = StoreLayout.new(self.cfg.job_id, self.cfg.node_index, param_count, self.cfg.workers,
                                 names)
        reclaim_stale(self.cfg.job_id, self.cfg.node_index)
        self.store = NodeStore.create(layout)
        self.layout_name = layout.name
        self._start_plane(param_count)
        self.view.wait(f"joining the job at {self.address}", "CONNECT_TIMEOUT",
                       self.cfg.connect_timeout)
        try:
            resp = self.client.join(workers=self.cfg.workers, param_count=param_count,
                                    algorithm=self.cfg.rule_spec, num_groups=self.cfg.num_groups,
                                    connect_timeout=self.cfg.connect_timeout, replaces=self.replaces)
        except grpc.RpcError as exc:
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(FINISHING):
                raise JoinedTooLate("the job was finishing when this node joined: nothing was "
                                    "left for it to do") from None
            if (exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                               grpc.StatusCode.UNAUTHENTICATED)  # (a missing or wrong secret)
                    and stop_reason_of(exc) is None):
                raise JoinRefused(f"the global server refused this node: {details} "
                                  f"({exc.code().name})") from None
            raise
        self._joined(resp.session, resp.counter)
        self.view.on_counter(resp.counter)
        self.heartbeat = Heartbeat(self.client, interval=min(1.0, self.cfg.node_timeout / 5),
                                   give_up=max(2 * self.cfg.node_timeout, 10.0), view=self.view,
                                   loop_silent=lambda: time.monotonic() - self.beat.value,
                                   stale_after=stale_after(self.cfg.round_timeout,
                                                           self.cfg.connect_timeout))
        self.heartbeat.start()
        self.last_round_seen = resp.round_id
        resumed = None
        if self.cfg.resume:
            with self.liveness.blocking(SAVE_LIMIT):  # reading a big checkpoint takes a while
                resumed = self._resume()
        start = self._rejoin_point() if resp.counter > 0 and resumed is None else None
        for w in self._live():
            if start is not None:
                ops.copy_(self.store.slot(w.local), self.store.buffer(start))
            w.set_up_at = w.iterations
            self._send(w, m.Setup(layout, from_slot=start is not None or resumed is not None,
                                  iterations=w.iterations, resume=resumed is not None))
        if self.evaluator is not None and self.evaluator.hello is not None:
            self._from_evaluator(self.evaluator.hello)
        ready = self._hear_from_workers(m.Ready, end, "setup", "setting up",
                                        "publish their parameters", other=self._dispatch)
        first = self.store.slot(min(ready))
        for name in layout.buffers if resumed is None else ():  # all start at the initial model
            ops.copy_(self.store.buffer(name), first)
        if self.rule.exchange == Exchange.CENTER:
            if resp.seed_center:
                try:
                    self.client.push(CENTER, self.store.buffer(CENTER), round_id=0, wire=self.cfg.wire)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                        raise
            if not self._pull(CENTER, CENTER, 0):
                raise NodeError("could not download the initial EASGD center")
        if not self.rule.synchronous:
            self.async_node = AsyncNode(self.rule, self.store, self.client,
                                        moved=param_count - self.stats_count,
                                        sync_every=self.cfg.sync_every, wire=self.cfg.wire,
                                        job_workers=self.cfg.total_workers)
            for w in self._live():
                self.async_node.start_worker(w.local)
            self.async_node.start()
        self.training = True
        self.view.joined()
        log.info("node %d joined job '%s': %d workers, %d parameters", self.cfg.node_index,
                 self.cfg.job_id, len(ready), param_count)
