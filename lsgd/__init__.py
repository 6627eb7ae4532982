"""lsgd: a hierarchical parameter server for Leader SGD (LSGD) and Elastic Averaging SGD (EASGD).

Workers train locally; per-node local servers relay their requests to one gRPC global server
that owns the iteration counter, the leaders, the EASGD center and the stop decision. Parameters
move through node shared memory. See ``docs/architecture.md``.
"""

__version__ = "0.1.0"


def _child_ignores_ctrl_c() -> None:
    """In a process lsgd starts (the global server, a worker), imported while multiprocessing
    still sets the process up (unpickling its target imports lsgd first): ignore SIGINT from
    here on. Ctrl-C reaches the node's whole process group; the node decides how its children
    stop. The child started with SIGINT blocked (``local_server.procs.children_ignore_sigint``),
    so a Ctrl-C that came during its start-up is pending: ignoring it drops it, and only then is
    it unblocked. (Both kinds of child ignore SIGINT anyway once they run.)"""
    import sys

    mp = sys.modules.get("multiprocessing")  # a spawned child has it already; nobody else
    if mp is not None and getattr(mp.current_process(), "_inheriting", False):  # needs it here
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


_child_ignores_ctrl_c()


def connect(params=None, evaluate=None, *, buffers="local", grad_norm=None):
    """This process's lsgd worker (see ``lsgd.worker.client.connect``).

    Under ``train.sh`` it is the worker the local server set up; in a plain ``python script.py``
    it is a stand-in that lets the script train alone. Registers ``params`` when given.
    """
    from .worker.client import connect as _connect

    return _connect(params, evaluate, buffers=buffers, grad_norm=grad_norm)


__all__ = ["connect", "__version__"]
