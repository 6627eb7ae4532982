"""What a worker does at a round: publish its model, check it, pull, or run an asynchronous
rule's exchange (a mixin of ``Worker``, ``client.py``).

At a synchronous round the worker copies its model into its slot, checks the slot (finite, and
changed since lsgd last read or wrote it), reports to the local server and waits; the answer
names the pulls, which run in the slot on the CPU or, for a GPU model, on the model
(``_apply_pulls``). An asynchronous rule's exchange publishes the same way and takes back what
the local server left in the slot.
"""

from __future__ import annotations

import logging

import numpy as np

from ..local_server import messages as m
from ..rules import ops

log = logging.getLogger("lsgd.worker.client")  # as before the split: one logger for the worker


class NotTraining(RuntimeError):
    """The registered parameters are not the ones the training loop updates."""


IN_PLACE = ("update the registered parameters in place (numpy: `W -= lr * g`, not "
            "`W = W - lr * g`; PyTorch: do not replace the model's parameter tensors)")


class RoundsMixin:
    """The round-time methods of ``Worker`` (its state lives there)."""

    def _round(self, call: m.RoundCall) -> bool:
        """Publish, wait for instructions, pull. Returns False when the job ends."""
        assert self._store is not None and self._params is not None
        slot = self._store.slot(self.local_index)
        self._check_replaced()
        self._params.read_into(slot)
        estimate, finite = self._window.read()
        finite_slot, read = ops.finite_fingerprint(slot)  # each worker checks itself, in parallel
        self._check_trained(read)
        healthy = finite and finite_slot
        scalars = self._given.read(stepped=self.iterations > self._touched_at)
        self._touched, self._touched_at = read, self.iterations
        self._send(m.Join(self.local_index, call.round_id, estimate, self._take_unreported(),
                          self.iterations, healthy, scalars=scalars))
        while True:
            msg = self._get()
            if isinstance(msg, m.Pull) and msg.reset:  # diverged: start again from a good model
                (name, _), = msg.pulls
                ops.copy_(slot, self._store.buffer(name))
                self._params.write_from(slot)
                self._wrote(slot)
                self._window.reset()
                self._given.reset()
                log.warning("non-finite loss or parameters: reset to the %s", name)
                self._send(m.Done(self.local_index, msg.round_id, {}))
                return True
            if isinstance(msg, m.Pull):
                distances = self._apply_pulls(slot, msg)
                if msg.reset_window:  # every candidate of the next round starts afresh
                    self._window.reset()
                if msg.checkpoint and self._state is not None:
                    self._state.save(msg.round_id)
                self._send(m.Done(self.local_index, msg.round_id, distances))
                return True
            if isinstance(msg, m.Evaluate):
                self._send(m.EvalResult(self.local_index, msg.round_id, msg.iteration,
                                        self._run_evaluation({n: self._store.buffer(n) for n in msg.buffers})))
                continue
            if isinstance(msg, m.Stop):
                return False
            raise RuntimeError(f"unexpected message in round {call.round_id}: {msg!r}")

    def _apply_pulls(self, slot: np.ndarray, msg: m.Pull) -> dict[str, float]:
        """The round's pulls, in order; the distance to each target before its pull. They run
        in the slot, on the CPU, and the slot goes into the model; or, for a GPU model whose
        adapter can (``torch_params.pull_toward``), on the model, and the model goes into the
        slot. Either way the model and the slot end as the pulled model with the round's
        statistics."""
        assert self._store is not None and self._params is not None
        pulled = any(s > 0 for _, s in msg.pulls)
        n = self._pulled
        targets = [(name, self._store.buffer(name), s) for name, s in msg.pulls]
        can = getattr(self._params, "can_pull", None)
        if can is not None and all(can(t) for _, t, _ in targets):
            if msg.stats_averaged:  # the node set the slot's statistics: into the model first
                self._params.write_from(slot)  # (its parameters are the model's, read this round)
            distances = {name: self._params.pull_toward(t, s, n) for name, t, s in targets}
            if pulled:
                self._params.read_into(slot)
        else:
            distances = {name: ops.pull_toward_(slot[:n], t[:n], s) for name, t, s in targets}
            if pulled or msg.stats_averaged:
                self._params.write_from(slot)
        if pulled or msg.stats_averaged:
            self._wrote(slot)
        return distances

    def _exchange(self, action: int) -> bool:
        """An asynchronous rule's exchange: publish, let the local server run it, take the
        result. Returns False when the job ends."""
        assert self._store is not None and self._params is not None
        slot = self._store.slot(self.local_index)
        self._check_replaced()
        self._params.read_into(slot)
        estimate, finite = self._window.read()
        finite_slot, read = ops.finite_fingerprint(slot)
        self._check_trained(read)
        self._touched, self._touched_at = read, self.iterations
        self._send(m.Exchange(self.local_index, action, estimate, self._take_unreported(),
                              self.iterations, finite and finite_slot))
        msg = self._get()
        if isinstance(msg, m.Stop):
            return False
        if not isinstance(msg, m.Exchanged):
            raise RuntimeError(f"expected Exchanged from the local server, got {msg!r}")
        if msg.changed:
            self._params.write_from(slot)
            self._wrote(slot)
        if msg.reset:  # diverged: it starts again from the center
            self._window.reset()
            self._given.reset()
            log.warning("non-finite loss or parameters: reset to the center")
        return True

    def _check_replaced(self) -> None:
        """PyTorch: the module's parameters must still be the tensors registered."""
        replaced = getattr(self._params, "replaced", None)
        if replaced is not None and (what := replaced()) is not None:
            self._stopped = True  # a loop that swallows the error ends at its next step
            raise NotTraining(f"{what}; {IN_PLACE}")

    def _wrote(self, slot: np.ndarray) -> None:
        """A round wrote the slot into the model."""
        if self._full_checks:  # one more pass over the slot; later rounds compare with the read
            self._touched = ops.fingerprint(slot)

    def _check_trained(self, read: int) -> None:
        """The model, read at a round, must have changed since lsgd last read it or wrote it if
        steps were taken since. A loop that trains other arrays shows at its first round; to
        also cover what a pull wrote costs one more pass over the slot, done in the first
        ``FULL_CHECKS`` rounds of a process only: later, a round compares with the last read
        (which costs nothing more: ``finite_fingerprint``). Per-step proximal pulls write the
        model at every step: not checked."""
        if self._proximal or self.iterations == self._touched_at:
            return
        if read != self._touched:
            self._full_checks = max(0, self._full_checks - 1)
            return
        self._stopped = True
        raise NotTraining(
            f"the registered parameters did not change in {self.iterations - self._touched_at} "
            f"steps: the loop trains other arrays, and lsgd would exchange stale ones; {IN_PLACE}")

    def _proximal_step(self) -> None:
        """Reference-code proximal pull after every step (p1/p2 > 0 only; costs two copies)."""
        assert self._store is not None and self._params is not None
        slot = self._store.slot(self.local_index)
        self._params.read_into(slot)
        n = self._pulled
        for name, strength in self._proximal:
            ops.pull_toward_(slot[:n], self._store.buffer(name)[:n], strength)
        self._params.write_from(slot)
