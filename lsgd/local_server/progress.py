"""The progress display of a node: a live line on a terminal, a log line now and then otherwise.

Fed by the node's ``NodeView`` from a thread of its own; the node loop never waits for it.

- **Terminal** (stderr is a TTY and this node runs in the terminal's foreground): a live line,
  drawn with tqdm and redrawn ``LIVE_EVERY`` s, starting with the node's index::

      node 0  40%|████▍     | 2400/6000 it, 812 it/s, ETA 4 s, leader w1 (node 0) loss 0.123, ...

  The node's own log records clear the line, print, and draw it again (the root handler's
  stream goes through ``_AroundLine``); the records of its workers and of the global server
  start by clearing the line (``lograte.log_format``), and the next redraw puts it back.
  Closed (erased) before the end-of-job report.
- **Not a terminal**, or a node running as a background job of its terminal (``bash train.sh 0
  & bash train.sh 1``: node 1 draws the live line, node 0 logs): an INFO line every
  ``PROGRESS_EVERY`` s, ``progress: 2400/6000 it (40%), 812 it/s, ETA 4 s, round 37, ...``.
- Waits say what they wait for, at the same cadence (on a terminal: in the live line).
- ``PROGRESS_EVERY=0`` or ``LOG_LEVEL=WARNING`` (or higher): nothing.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from typing import IO, Any

from tqdm import tqdm

from ..config import JobConfig
from .view import NodeView, Snapshot

log = logging.getLogger("lsgd.progress")

LIVE_EVERY = 0.25  # seconds between redraws of the live line
DEFAULT_COLUMNS = 120  # when the terminal does not say its width
BAR_WIDTH = 10
LOCK_WAIT = 1.0  # seconds a drawing or a log record waits for another one to finish


# ---------------------------------------------------------------------- the text (pure)
def duration(seconds: float) -> str:
    """``4 s``, ``1:02``, ``1:02:03``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s} s"
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def budget_text(s: Snapshot) -> str:
    """``2400/6000 it (40%)``; with MINUTES ``1:02/5:00``; with both, both."""
    parts = []
    if s.budget_iterations:
        parts.append(f"{s.counter}/{s.budget_iterations} it ({percent(s):.0f}%)")
    else:
        parts.append(f"{s.counter} it")
    if s.budget_seconds:
        parts.append(f"time {duration(s.elapsed)}/{duration(s.budget_seconds)}")
    return ", ".join(parts)


def percent(s: Snapshot) -> float:
    """How far the job is, by the budget that ends it first."""
    done = []
    if s.budget_iterations:
        done.append(s.counter / s.budget_iterations)
    if s.budget_seconds:
        done.append(s.elapsed / s.budget_seconds)
    return 100 * min(1.0, max(done)) if done else 0.0


def status_parts(s: Snapshot) -> list[str]:
    """Rate, ETA, leader, nodes, workers, round: most telling first (a narrow terminal cuts
    the end). An asynchronous rule has no rounds and elects no leader until its final round:
    it shows this node's best worker by its newest loss and the exchanges run here."""
    eta = duration(s.eta) if s.eta is not None else "?"
    exchanges = s.rounds.get("exchange", 0)
    leader, stage = (_best(s), f"exchanges {exchanges}") if exchanges else \
        (_leader(s.leader), f"round {s.round_id}")
    alive = "?" if s.nodes_alive is None else str(s.nodes_alive)
    return [f"{_rate(s.rate)} it/s", f"ETA {eta}", leader, f"nodes {alive}/{s.num_groups}",
            f"workers {s.workers_training}/{len(s.workers)} training", stage]


def _leader(lead) -> str:
    if lead is None:
        return "no leader yet"
    node = f" (node {lead.node})" if lead.node is not None else ""
    return f"leader w{lead.worker_id}{node} loss {_num(lead.loss)}"


def _best(s: Snapshot) -> str:
    """This node's worker with the lowest newest loss."""
    best = min((w for w in s.workers if math.isfinite(w.loss)), key=lambda w: w.loss,
               default=None)
    return f"best w{best.worker_id} loss {_num(best.loss)}" if best else "no loss yet"


def progress_line(s: Snapshot) -> str:
    """The plain line: what a wait waits for, else the progress."""
    wait = s.wait_text()
    if wait is not None:
        return wait
    return "progress: " + ", ".join([budget_text(s)] + status_parts(s))


def _num(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else "n/a"


def _rate(v: float | None) -> str:
    if v is None:
        return "?"
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}"


# ---------------------------------------------------------------------- the display
def choose_mode(cfg: JobConfig, stream: IO[str], logger: logging.Logger = log) -> str:
    """``live`` (a terminal in the foreground), ``lines`` (a log, or a background job of a
    terminal) or ``off`` (PROGRESS_EVERY=0, LOG_LEVEL above INFO)."""
    if cfg.progress_every <= 0 or not logger.isEnabledFor(logging.INFO):
        return "off"
    return "live" if is_tty(stream) and _foreground(stream) else "lines"


def is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _foreground(stream: IO[str]) -> bool:
    """False when this process is a background job of the terminal (another node started in
    the same terminal then owns the live line); True when it cannot tell."""
    try:
        return os.tcgetpgrp(stream.fileno()) == os.getpgrp()
    except (OSError, AttributeError, ValueError):
        return True


class Progress:
    """Shows a ``NodeView`` (see the module doc). ``start()`` once, ``close()`` once."""

    def __init__(self, view: NodeView, cfg: JobConfig, stream: IO[str] | None = None) -> None:
        self.view, self.cfg = view, cfg
        self.stream = stream if stream is not None else sys.stderr
        self.mode = choose_mode(cfg, self.stream)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Any = None
        # Held while the live line is drawn, or cleared around a log record; every wait for it
        # is bounded (a terminal that blocks writes must not hang the node here).
        self._lock = threading.RLock()
        self._handlers: list[tuple[logging.StreamHandler, IO[str]]] = []

    def start(self) -> None:
        if self.mode == "off" or self._thread is not None:
            return
        if self.mode == "live":
            self._open_line()
        target = self._live if self.mode == "live" else self._lines
        self._thread = threading.Thread(target=target, name="lsgd-progress", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop redrawing; erase the live line, so the end-of-job report starts on a clean line."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self._bar is None:
            return
        bar, self._bar = self._bar, None
        locked = self._lock.acquire(timeout=LOCK_WAIT)
        try:
            for handler, stream in self._handlers:
                handler.setStream(stream)
            self._handlers.clear()
            if locked:  # else a write to the terminal is stuck: leave the line as it is
                bar.close()
        except (OSError, ValueError):  # the terminal went away
            pass
        finally:
            if locked:
                self._lock.release()

    # ------------------------------------------------------------------ log lines
    def _lines(self) -> None:
        while not self._stop.wait(self.cfg.progress_every):
            try:
                log.info("%s", progress_line(self.view.snapshot()))
            except Exception as exc:  # noqa: BLE001 - watching must never stop training
                log.warning("progress display stopped: %s", exc)
                return

    # ------------------------------------------------------------------ live line
    def _open_line(self) -> None:
        self._bar = _Line(total=None, file=self.stream, bar_format="{desc}", leave=False,
                         dynamic_ncols=False, ncols=self._columns(), mininterval=0, miniters=1,
                         desc=f"node {self.cfg.node_index} starting", position=0,
                         nrows=self._rows())  # a terminal of 0x0 (docker exec -t, ssh -tt):
                         # tqdm would take it as no room and draw nothing
        # The node's own log records go around the line: clear it, print, draw it again.
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is self.stream:
                self._handlers.append((handler, self.stream))
                handler.setStream(_AroundLine(self.stream, self._bar, self._lock))

    def _columns(self) -> int:
        try:
            cols = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, AttributeError, ValueError):
            cols = 0
        return max(20, (cols or DEFAULT_COLUMNS) - 1)  # never the last column: no wrap

    def _rows(self) -> int:
        try:
            rows = os.get_terminal_size(self.stream.fileno()).lines
        except (OSError, AttributeError, ValueError):
            rows = 0
        return rows if rows > 0 else 24

    def _live(self) -> None:
        while not self._stop.wait(LIVE_EVERY):
            bar = self._bar
            if bar is None:
                return
            try:
                self._draw(bar, self.view.snapshot())
            except (OSError, ValueError):  # the terminal went away: stop drawing
                return
            except Exception as exc:  # noqa: BLE001 - watching must never stop training
                log.warning("progress display stopped: %s", exc)
                return

    def _draw(self, bar: Any, s: Snapshot) -> None:
        head = f"node {s.node} "
        wait = s.wait_text()
        if not self._lock.acquire(timeout=LOCK_WAIT):
            return
        try:
            if self._stop.is_set():
                return
            bar.ncols = self._columns()
            if wait is not None:
                bar.bar_format, bar.total, bar.n = "{desc}", None, 0
                bar.desc = head + wait
            elif s.budget_iterations or s.budget_seconds:
                bar.bar_format = "{desc}{percentage:3.0f}%%|{bar:%d}| {status}" % BAR_WIDTH
                bar.total, bar.n = 1000, int(10 * percent(s))
                bar.desc = head
                bar.status = ", ".join([_budget_short(s)] + status_parts(s))
            else:
                bar.bar_format, bar.total, bar.n = "{desc}", None, 0
                bar.desc = head + ", ".join([_budget_short(s)] + status_parts(s))
            bar.refresh(nolock=True)
        finally:
            self._lock.release()


def _budget_short(s: Snapshot) -> str:
    parts = []
    parts.append(f"{s.counter}/{s.budget_iterations} it" if s.budget_iterations else f"{s.counter} it")
    if s.budget_seconds:
        parts.append(f"{duration(s.elapsed)}/{duration(s.budget_seconds)}")
    return ", ".join(parts)


class _Line(tqdm):
    """tqdm as a line of text: ``{status}`` in its format, no monitor thread (the display
    redraws it itself)."""

    monitor_interval = 0
    status = ""

    @property
    def format_dict(self) -> dict:
        return {**super().format_dict, "status": self.status}


class _AroundLine:
    """A stream for the log handler while the live line is shown: each write clears the line,
    writes, and draws the line again, holding the display's lock (the redraw holds it too)."""

    def __init__(self, real: IO[str], bar: Any, lock: threading.RLock) -> None:
        self.real, self.bar, self.lock = real, bar, lock

    def write(self, text: str) -> int:
        if not self.lock.acquire(timeout=LOCK_WAIT):
            return self.real.write(text)  # the record goes out, around the line or not
        try:
            self.bar.clear(nolock=True)
            n = self.real.write(text)
            self.real.flush()
            self.bar.refresh(nolock=True)
        finally:
            self.lock.release()
        return n

    def flush(self) -> None:
        self.real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)
