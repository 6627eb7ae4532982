"""The end of a node's job in a few lines: why it stopped, what it did, where to look.

``where_to_look(cfg, since)`` goes into the node's ``summary.json`` (key ``files``);
``final_lines(summary, code)`` are the last lines ``lsgd train`` prints (``cli._print_summary``)::

    lsgd: node 0 finished in 12.3 s (iteration budget reached); global counter 6000; ...
    lsgd: rounds on this node: 30 local, 9 global, 1 final; the global leader changed 4 times ...
    (an asynchronous rule: ``lsgd: exchanges on this node: 2500 without a barrier (410 center
    deltas sent), then 1 final round``)
    lsgd: test accuracy: final leader (worker 1) 0.9712, worker average 0.9650
    lsgd: plots: python -m lsgd plot runs/lsgd
    lsgd: metrics: runs/lsgd/node0/metrics.csv
    lsgd: status page (while the job ran): http://127.0.0.1:50052/
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from .. import exitcodes
from ..config import JobConfig
from ..security import SecurityError, is_loopback, read_secret

STATUS_PORT_FILE = "status.port"  # in RUN_DIR/global, written by the status server


def where_to_look(cfg: JobConfig, since: float = 0.0) -> dict:
    """Paths and commands to look at the run with (JSON-able). ``since`` (unix time): a
    status-port file older than that belongs to an earlier run and is ignored."""
    run = Path(cfg.run_dir)
    out = {"run_dir": str(run), "plot": f"python -m lsgd plot {shlex.quote(str(run))}",
           "metrics": str(run / f"node{cfg.node_index}" / "metrics.csv")}
    if cfg.tensorboard:
        out["tensorboard"] = f"tensorboard --logdir {shlex.quote(str(run / 'tensorboard'))}"
    page = status_page(cfg, since) if cfg.node_index == 0 else None
    if page is not None:
        out["status_page"] = page
    return out


def status_page(cfg: JobConfig, since: float = 0.0) -> str | None:
    """The address of node 0's status page, from ``RUN_DIR/global/status.port`` (None when
    the page is off or the file is missing, bad or older than ``since``)."""
    if cfg.status_address is None:
        return None
    path = Path(cfg.run_dir) / "global" / STATUS_PORT_FILE
    try:
        if path.stat().st_mtime < since - 1.0:
            return None
        port = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    if not 0 < port < 65536:
        return None
    try:
        secret = read_secret(cfg.secret_file) is not None
    except SecurityError:
        secret = False
    # Without a secret it listens on loopback only; with one, where the gRPC port does.
    host = cfg.ip_addr if secret and not is_loopback(cfg.ip_addr) else "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if cfg.tls_cert else 'http'}://{host}:{port}/"


def budget_reason(cfg: JobConfig, counter: object) -> str | None:
    """Which budget ended a job that finished with ``counter`` iterations."""
    if cfg.iterations and isinstance(counter, int) and counter >= cfg.iterations:
        return "iteration budget reached"
    if cfg.minutes:
        return "time budget reached"
    return None


def final_lines(summary: dict, code: int) -> list[str]:
    """The last lines of a node (see the module doc)."""
    node = summary.get("node")
    reason = summary.get("stop_reason", "")
    lines = []
    if code == exitcodes.STOPPED:
        lines.append(f"lsgd: node {node}: {reason}")
    elif code in (exitcodes.INTERRUPTED, exitcodes.TERMINATED):
        also = "; the job was stopped on every node" if summary.get("stopped_job") else ""
        lines.append(f"lsgd: node {node}: {reason}{also}")
    elif code not in (exitcodes.OK, exitcodes.DEGRADED):
        if summary.get("stopped_job"):  # the error itself was logged as it happened
            lines.append(f"lsgd: node {node}: the job was stopped on every node")
    else:
        lines += _finished(summary, code)
    return lines + _files(summary.get("files") or {})


def _finished(summary: dict, code: int) -> list[str]:
    node = summary.get("node")
    why = f" ({summary['job_stop_reason']})" if summary.get("job_stop_reason") else ""
    lines = [f"lsgd: node {node} finished in {summary.get('seconds', 0):.1f} s{why}; "
             f"global counter {summary.get('counter')}; this node's workers did "
             f"{sum(summary.get('workers', {}).values())} iterations"]
    rounds = dict(summary.get("rounds") or {})
    exchanges = rounds.pop("exchange", 0)
    if exchanges or summary.get("async"):
        lines.append(_exchanges(exchanges, rounds, summary.get("async") or {}))
    elif rounds:
        text = ", ".join(f"{n} {kind}" for kind, n in rounds.items())
        changes = summary.get("leader_changes", 0)
        lines.append(f"lsgd: rounds on this node: {text}; the global leader changed {changes} "
                     f"time{'' if changes == 1 else 's'}{_last_leader(summary)}")
    ev = summary.get("evaluation") or {}
    leader = summary.get("final_leader", {})
    parts = []
    for name, label in (("leader", f"final leader (worker {leader.get('worker_id')})"),
                        ("average", "worker average"), ("center", "center")):
        if name in ev and "accuracy" in ev[name]:
            parts.append(f"{label} {ev[name]['accuracy']:.4f}")
    if parts:
        lines.append("lsgd: test accuracy: " + ", ".join(parts))
    if code == exitcodes.DEGRADED:
        lines.append(f"lsgd: node {node} finished with problems: "
                     + "; ".join(summary.get("problems", [])) + f" (exit code {code})")
    return lines


def _exchanges(exchanges: int, rounds: dict, stats: dict) -> str:
    """An asynchronous rule: its exchanges, what reached the global server, the final round."""
    final = rounds.get("final", 0)
    sent = (f"{stats['deltas_sent']} center deltas sent" if "deltas_sent" in stats else
            f"mail {stats.get('mail_sent', 0)} sent, {stats.get('mail_received', 0)} received")
    refused = stats.get("deltas_refused") or stats.get("mail_refused")
    if refused:  # deltas dropped; mail kept on the node
        sent += f" ({refused} refused by the global server)"
    failed = stats.get("sync_failures", 0)
    also = (f", {failed} sync{'' if failed == 1 else 's'} with the global server failed and "
            "went again" if failed else "")
    return (f"lsgd: exchanges on this node: {exchanges} without a barrier ({sent}{also}), "
            f"then {final} final round{'' if final == 1 else 's'}")


def _last_leader(summary: dict) -> str:
    last = summary.get("last_leader") or summary.get("final_leader")
    if not last:
        return ""
    where = f" on node {last['node']}" if last.get("node") is not None else ""
    loss = last.get("loss")
    loss_text = f", loss {loss:.4g}" if isinstance(loss, float) and math.isfinite(loss) else ""
    return f" (last: worker {last.get('worker_id')}{where}{loss_text})"


def _files(files: dict) -> list[str]:
    lines = []
    for key, label in (("plot", "plots"), ("metrics", "metrics"), ("tensorboard", "tensorboard"),
                       ("status_page", "status page (while the job ran)")):
        if files.get(key):
            lines.append(f"lsgd: {label}: {files[key]}")
    return lines
