"""The toy job (``toyjob.py``) with a SIGKILL at an exact point of a round, for the respawn tests.

KILLJOB="<worker>:<n>:<point>" kills that worker (in its first life) at its n-th round:

- ``ask``: right after an Ask for credits reached the local server (the n-th Ask);
- ``join``: right after its Join of the n-th round reached the local server;
- ``pull``: when the Pull of the n-th round arrives, before applying it (no Done is sent);
- ``send``: in the middle of sending its n-th Ask: a queue shared by all workers would be left
  with its write lock held (taken here, as the queue's feeder thread takes it to write).

KILLJOB_SLOW="<worker>:<n>:<seconds>" holds that worker's n-th Join back that long, so a kill
at the same round is noticed while the round still collects its joins. KILLJOB_RESPAWN_DELAY
(seconds) makes a respawned worker wait that long before it registers (a slow model build). The
time of the kill goes to ``$TOYJOB_COUNT_DIR/<worker>.died``.
"""

import os
import signal
import time

import toyjob


def _spec(name):
    spec = os.environ.get(name, "")
    if not spec:
        return None
    w, n, arg = spec.split(":")
    return int(w), int(n), arg


def _die(q=None):
    if hasattr(q, "join_thread"):  # a queue: make sure what was sent is in the pipe, then die
        q.close()
        q.join_thread()
    count_dir = os.environ.get("TOYJOB_COUNT_DIR")
    if count_dir:
        with open(os.path.join(count_dir, f"{os.environ['KILLJOB_WORKER']}.died"), "w") as f:
            f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


class _Inbox:
    """Wraps the queue to the local server: counts what the worker sends."""

    def __init__(self, q, kill, slow):
        self.q, self.kill, self.slow, self.sent = q, kill, slow, {}

    def put(self, msg):
        kind = type(msg).__name__.lower()
        n = self.sent[kind] = self.sent.get(kind, 0) + 1
        if self.slow and kind == "join" and n == self.slow[0]:
            time.sleep(self.slow[1])
        if self.kill and self.kill == ("send", n) and kind == "ask":
            lock = getattr(self.q, "_wlock", None)  # a shared queue's; a pipe of our own has none
            if lock is not None:
                lock.acquire()
            _die()
        self.q.put(msg)
        if self.kill and self.kill == (kind, n):
            _die(self.q)

    def __getattr__(self, name):
        return getattr(self.q, name)


class _Replies:
    """Wraps the worker's reply queue: dies on the n-th Pull."""

    def __init__(self, q, n):
        self.q, self.n, self.pulls = q, n, 0

    def get(self, *args, **kwargs):
        msg = self.q.get(*args, **kwargs)
        if type(msg).__name__ == "Pull":
            self.pulls += 1
            if self.pulls == self.n:
                _die()
        return msg

    def __getattr__(self, name):
        return getattr(self.q, name)


def main(worker):
    kill, slow = _spec("KILLJOB"), _spec("KILLJOB_SLOW")
    ctx = worker._ctx
    if kill and kill[0] == worker.worker_id and not worker.restarts:
        os.environ["KILLJOB_WORKER"] = str(worker.worker_id)
        if kill[2] == "pull":
            ctx.replies = _Replies(ctx.replies, kill[1])
        else:
            ctx.inbox = _Inbox(ctx.inbox, (kill[2], kill[1]), None)
    if worker.restarts:
        time.sleep(float(os.environ.get("KILLJOB_RESPAWN_DELAY", "0")))
    if slow and slow[0] == worker.worker_id:
        ctx.inbox = _Inbox(ctx.inbox, None, (slow[1], float(slow[2])))
    toyjob.main(worker)
