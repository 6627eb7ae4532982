"""The job configuration: one frozen dataclass, validated in one place.

``train.sh`` turns its knobs (environment variables) into ``lsgd train`` flags; the flags are
generated from the fields below, so a knob, its flag and its check cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from .rules import EASGD, RULES, Rule
from .rules.base import RuleError
from .rules.loader import check_rule, load_rule, parse_args


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and how to fix it."""


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class JobConfig:
    """Everything a node needs to take part in a job. Identical on every node but node_index."""

    node_index: int = _f(0, "index of this node, 0 .. num_groups-1 (node 0 hosts the global server)")
    ip_addr: str = _f("127.0.0.1", "address of node 0, where the global server listens")
    port: int = _f(50051, "global server port (0: any free port, written to RUN_DIR/global.port)")
    session_port: int | None = _f(None, "the global server's port for the nodes' session streams "
                                  "(their credit and round calls and small vectors, on plain "
                                  "connections): empty = PORT+2 (any free port when PORT is "
                                  "0), 0 = off (on PORT); off under TLS")
    bulk_port: int | None = _f(None, "the global server's port for the nodes' parameter "
                               "uploads and downloads (plain data connections, at a socket's "
                               "speed; off under TLS): empty = PORT+3 (any free port when PORT "
                               "is 0), 0 = off (gRPC streams on PORT)")
    num_groups: int = _f(1, "number of nodes in the job")
    workers: int = _f(2, "worker processes per node")
    algorithm: str = _f("lsgd", "training rule: lsgd | easgd | average | diloco | grawa | "
                        "easgd-async | downpour, or "
                        "your own: path/to/rule.py:Class "
                        "or package.module:Class (docs/rules.md)")
    rule_args: str = _f("", "the rule's own arguments, name=value,name=value (see its docs)")
    c1: float = _f(0.1, "LSGD pulling strength toward the local (node) leader, in [0, 1]")
    c2: float = _f(0.1, "LSGD pulling strength toward the global leader (GRAWA: toward its "
                   "center), in [0, 1]")
    p1: float = _f(0.0, "LSGD per-step proximal pull toward the last local leader (reference code, not the paper)")
    p2: float = _f(0.0, "LSGD per-step proximal pull toward the last global leader (reference code, not the paper)")
    alpha: float = _f(0.1, "EASGD moving rate of the workers toward the center, in [0, 1]")
    beta: float | None = _f(None, "EASGD moving rate of the center (default alpha * participants)")
    outer_lr: float = _f(0.7, "DiLoCo outer learning rate (Nesterov SGD on the server)")
    outer_momentum: float = _f(0.9, "DiLoCo outer momentum, in [0, 1)")
    l_comm: int = _f(16, "local round period, in iterations per worker")
    g_comm: int = _f(64, "global round period, in iterations per worker (a multiple of l_comm)")
    sync_every: float = _f(0.05, "asynchronous rules: the least seconds between two of a node's "
                           "exchanges with the global server (send its deltas, fetch the center)")
    avg_size: int | None = _f(None, "losses averaged for leader election: a worker's last avg_size "
                              "since its last round, all of them when fewer (default l_comm // 2)")
    lr: float = _f(0.05, "learning rate of the local optimizer")
    momentum: float = _f(0.9, "Nesterov momentum of the local optimizer")
    batch_size: int = _f(32, "minibatch size")
    iterations: int | None = _f(6000, "iteration budget: total SGD steps summed over all workers of all nodes")
    minutes: float | None = _f(None, "wall-clock budget on the global server's clock")
    seed: int = _f(0, "random seed (model init is shared; data order differs per worker)")
    run_dir: str = _f("runs/lsgd", "output directory; each node writes RUN_DIR/node<i>/")
    job_id: str = _f("lsgd", "job name; every node must use the same one")
    entry: str = _f("lsgd.jobs.digits_mlp:main", "the user's training code: package.module:function, "
                    "or path/to/script.py followed by its arguments")
    shard: str = _f("permutation", "data each worker gets from worker.shard(): permutation (all "
                    "samples, an order of its own) | disjoint (1/workers of them)")
    eval_every: int = _f(0, "evaluate leader, worker average and center at the first global round "
                         "after every this many iterations of the job (0: at the end only)")
    wire: str = _f("float32", "parameter encoding between nodes and the global server: float32 | "
                   "bfloat16 (half the bytes, ~3 significant digits; needs lsgd[bf16])")
    plane: str = _f("star", "how a global round's parameters move: star (every node "
                    "downloads the leader from, or uploads its sum to, the global server) | "
                    "chain (node to node, each forwarding as it receives: LSGD's leader goes down "
                    "a chain, the center rules' sums add up along one toward node 0)")
    plane_fanout: int = _f(1, "PLANE=chain: chains a global round's broadcast (the leader) is cut "
                           "into, 1..64, each fed by its source: 1 is one chain, the fastest while "
                           "the route is short; more trade the source's bandwidth (1/fanout "
                           "each) for a shallower route, for hundreds of nodes. Sums always "
                           "add up along one chain")
    data_host: str | None = _f(None, "PLANE=chain: the IP address other nodes reach this node's "
                               "data listener at (default: the one it reaches node 0 from)")
    data_port: int = _f(0, "PLANE=chain: the TCP port of this node's data listener (0: any "
                        "free port; set one to open it in a firewall)")
    devices: str | None = _f(None, "GPUs of this node's worker processes: local worker i sees "
                             "entry i mod n of this comma-separated list as its one GPU "
                             "(CUDA_VISIBLE_DEVICES), e.g. 0,1, an index counting the GPUs "
                             "the node sees; empty: the node's CUDA_VISIBLE_DEVICES, else "
                             "every GPU of the machine; all: every worker sees every GPU")
    secret_file: str | None = _f(None, "file holding the job secret (or set LSGD_SECRET); needed "
                                 "when node 0 listens beyond loopback")
    tls_ca: str | None = _f(None, "CA certificate that signed node 0's certificate: TLS on every node")
    tls_cert: str | None = _f(None, "this node's certificate (node 0 serves it; with mtls every node "
                              "presents its own)")
    tls_key: str | None = _f(None, "private key of tls_cert")
    mtls: bool = _f(False, "mutual TLS: node 0 accepts only clients with a certificate from tls_ca")
    allow_insecure: bool = _f(False, "let node 0 listen beyond loopback without a secret (trusted "
                              "networks only)")
    checkpoint_every: int = _f(0, "checkpoint the whole job at the first global round after "
                               "every this many iterations (0: never); RESUME=1 goes on from it")
    resume: bool = _f(False, "start from the job's last checkpoint in RUN_DIR (every node)")
    state_every: float = _f(1.0, "seconds between saves of the global server's state (counter, "
                            "membership, leader, center) that a restarted server goes on from")
    reconnect_timeout: float = _f(120.0, "seconds a node trains on while the global server is "
                                  "unreachable before it gives up")
    respawn: int = _f(2, "times a worker process that dies (killed, crashed) is started again, "
                      "from the leader or the center; 0: the node goes on without it")
    round_timeout: float = _f(30.0, "seconds a round waits for late workers or nodes")
    node_timeout: float = _f(5.0, "seconds of silence after which the global server drops a node")
    join_timeout: float = _f(60.0, "seconds the job waits for all nodes to join before it starts")
    connect_timeout: float = _f(20.0, "seconds a node retries to reach the global server")
    status_port: int | None = _f(None, "node 0's status page, /status.json and /metrics (HTTP): "
                                 "empty = PORT+1 (any free port when PORT is 0), 0 = off")
    progress_every: float = _f(10.0, "seconds between progress lines when the output is not a "
                               "terminal (a terminal gets a live line); 0: no progress")
    tensorboard: bool = _f(False, "write TensorBoard event files under RUN_DIR/tensorboard "
                           "(needs lsgd[tensorboard])")

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the first wrong key and its valid range."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.num_groups >= 1, f"num_groups must be >= 1, got {self.num_groups}")
        need(0 <= self.node_index < self.num_groups,
             f"node index {self.node_index} is out of range for num_groups={self.num_groups}; "
             f"use 0 .. {self.num_groups - 1}")
        need(self.workers >= 1, f"workers must be >= 1, got {self.workers}")
        need(0 <= self.port <= 65535, f"port must be in 0..65535, got {self.port}")
        need(self.session_port is None or 0 <= self.session_port <= 65535,
             f"session_port must be in 0..65535 (0: the session streams on PORT), got "
             f"{self.session_port}")
        clash = ("PORT" if self.session_address == self.port else "STATUS_PORT"
                 + (" (PORT+1 by default)" if self.status_port is None else ""))
        need(not self.session_address or self.session_address not in (self.port,
                                                                       self.status_address),
             f"SESSION_PORT {self.session_address} is also {clash}; give each its own port, or "
             "SESSION_PORT=0 to serve the nodes' session streams on PORT"
             if self.session_port is not None else
             f"STATUS_PORT {self.status_address} is PORT+2, the default SESSION_PORT (the nodes' "
             "session streams); set SESSION_PORT to another port, or 0 to serve them on PORT")
        need(self.bulk_port is None or 0 <= self.bulk_port <= 65535,
             f"bulk_port must be in 0..65535 (0: parameter transfers on PORT), got "
             f"{self.bulk_port}")
        need(self.session_port is None or not self.session_port or self.tls_ca is None,
             "SESSION_PORT's connections are authenticated by the job secret but not "
             "encrypted: with TLS_CA set, leave SESSION_PORT empty or 0 (the session streams "
             "stay on TLS, on PORT)")
        need(self.bulk_port is None or not self.bulk_port or self.tls_ca is None,
             "BULK_PORT's connections are authenticated by the job secret but not encrypted: "
             "with TLS_CA set, leave BULK_PORT empty or 0 (the transfers stay on TLS)")
        if self.bulk_address:
            others = self._server_ports()
            others.pop(next(k for k in others if k.startswith("BULK_PORT")))
            same = [name for name, port in others.items() if port == self.bulk_address]
            need(not same, f"BULK_PORT {self.bulk_address}"
                 + (" (PORT+3 by default)" if self.bulk_port is None else "")
                 + f" is also {same[0] if same else ''}; give each its own port, or BULK_PORT=0 "
                 "to move the parameters on PORT")
        need(not (self.port and self.status_address == self.port),
             f"STATUS_PORT {self.port} is also PORT (the global server's); give the status page "
             "its own port, leave STATUS_PORT empty for PORT+1, or set 0 to turn it off")
        need(self.status_port is None or 0 <= self.status_port <= 65535,
             f"status_port must be in 0..65535 (0: off), got {self.status_port}")
        need(self.progress_every >= 0 and math.isfinite(self.progress_every),
             f"progress_every must be >= 0 seconds (0: off), got {self.progress_every}")
        need(self.port != 0 or self.node_index == 0,
             "port 0 (any free port) is only valid on node 0; give other nodes the real port")
        for name in ("c1", "c2", "p1", "p2", "alpha"):
            v = getattr(self, name)
            need(0.0 <= v <= 1.0, f"{name} (pulling strength) must be in [0, 1], got {v}")
        if self.beta is not None:
            need(0.0 <= self.beta <= 1.0, f"beta must be in [0, 1], got {self.beta}")
        elif self.algorithm == EASGD.name:
            most = self.alpha * self.num_groups * self.workers
            need(most <= 1.0, f"alpha * workers in the job = {most:g} > 1 makes the EASGD center "
                 f"diverge; lower alpha or set beta in [0, 1]")
        need(self.l_comm >= 1, f"l_comm must be >= 1, got {self.l_comm}")
        need(self.g_comm >= 1 and self.g_comm % self.l_comm == 0,
             f"g_comm ({self.g_comm}) must be a positive multiple of l_comm ({self.l_comm})")
        need(self.avg_size is None or self.avg_size >= 1, f"avg_size must be >= 1, got {self.avg_size}")
        need(self.lr > 0 and math.isfinite(self.lr), f"lr must be > 0, got {self.lr}")
        need(0.0 <= self.momentum < 1.0, f"momentum must be in [0, 1), got {self.momentum}")
        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(self.iterations is not None or self.minutes is not None,
             "set an iteration budget (ITERATIONS) or a time budget (MINUTES), or both")
        need(self.iterations is None or self.iterations >= 1,
             f"iterations must be >= 1, got {self.iterations}")
        need(self.minutes is None or self.minutes > 0, f"minutes must be > 0, got {self.minutes}")
        need(re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.job_id) is not None,
             f"job_id '{self.job_id}' must be 1-64 letters, digits, '_', '.' or '-'")
        if is_script(self.entry):
            try:
                script = shlex.split(self.entry)[0]
            except ValueError as exc:
                raise ConfigError(f"entry '{self.entry}': {exc}") from None
            need(os.path.isfile(script), f"entry script '{script}' not found (relative paths "
                 f"start in the directory train.sh runs in: {os.getcwd()})")
        else:
            need(re.fullmatch(r"[\w.]+:\w+", self.entry) is not None,
                 f"entry '{self.entry}' must be package.module:function or path/to/script.py")
        need(self.shard in ("permutation", "disjoint"),
             f"shard '{self.shard}' is unknown; choose permutation or disjoint")
        for name in ("eval_every", "checkpoint_every", "respawn"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.wire in ("float32", "bfloat16"),
             f"wire '{self.wire}' is unknown; choose float32 or bfloat16")
        if self.wire == "bfloat16":
            try:
                import ml_dtypes  # noqa: F401
            except ImportError:
                raise ConfigError("wire bfloat16 needs the ml_dtypes package: "
                                  "pip install 'lsgd[bf16]'") from None
        self._validate_plane(need)
        from .local_server.gpus import check as check_devices

        wrong = check_devices(self.devices or "")
        need(wrong is None, str(wrong))
        if self.tensorboard and importlib.util.find_spec("tensorboardX") is None:
            raise ConfigError("tensorboard (TENSORBOARD=1) needs the tensorboardX package: "
                              "pip install 'lsgd[tensorboard]'")
        self._validate_security(need)
        try:  # last: the knobs' own messages come first
            check_rule(self.make_rule(), self.num_groups, self.workers)
        except RuleError as exc:
            raise ConfigError(str(exc)) from None
        except Exception as exc:  # a rule's own check of its arguments
            raise ConfigError(f"algorithm '{self.algorithm}' with rule_args '{self.rule_args}': "
                              f"{type(exc).__name__}: {exc}") from None
        need(0 <= self.sync_every <= 60 and math.isfinite(self.sync_every),
             f"sync_every must be in [0, 60] seconds, got {self.sync_every}")
        if not self.make_rule().synchronous:
            for name in ("eval_every", "checkpoint_every"):
                need(not getattr(self, name), f"{name} needs the rounds of a synchronous rule; "
                     f"{self.algorithm} has none (set {name.upper()}=0: the center is "
                     "evaluated at the end)")
            # nothing to resume from: such a job makes no checkpoint, and a synchronous rule's
            # checkpoint in this RUN_DIR holds a node memory of another layout
            need(not self.resume, f"resume needs the checkpoints of a synchronous rule; "
                 f"{self.algorithm} makes none (set RESUME=0: the job starts afresh)")
        for name in ("round_timeout", "node_timeout", "join_timeout", "connect_timeout",
                     "state_every", "reconnect_timeout"):
            v = getattr(self, name)
            need(v > 0, f"{name} must be > 0 seconds, got {v}")

    def _validate_plane(self, need: Any) -> None:
        need(self.plane in ("star", "chain"),
             f"plane '{self.plane}' is unknown; choose star or chain")
        need(0 <= self.data_port <= 65535, f"data_port must be in 0..65535, got {self.data_port}")
        need(1 <= self.plane_fanout <= 64, f"plane_fanout must be in 1..64, got {self.plane_fanout}")
        need(self.plane_fanout == 1 or self.plane == "chain", "plane_fanout cuts a PLANE=chain "
             f"broadcast into chains; with plane {self.plane} it does nothing: set PLANE=chain, "
             "or leave PLANE_FANOUT at 1")
        if self.plane != "chain":
            return
        need(self.wire == "float32", "PLANE=chain forwards float32 only for now; set WIRE=float32")
        need(self.tls_ca is None, "PLANE=chain's node-to-node connections are authenticated by "
             "the job secret but not encrypted: with TLS_CA set, use PLANE=star")
        try:
            rounds = self.make_rule().synchronous
        except Exception:  # noqa: BLE001 - the rule's own check reports it below
            rounds = True
        need(rounds, f"PLANE=chain carries a round's leader or sums from node to node; "
             f"algorithm '{self.algorithm}' has no rounds: set PLANE=star")
        if self.node_index == 0 and self.data_port:  # node 0 hosts the global server's ports
            theirs = self._server_ports()
            clash = [name for name, port in theirs.items() if port == self.data_port]
            need(not clash, f"DATA_PORT {self.data_port} is also node 0's {clash[0] if clash else ''}, "
                 "a port of the global server; give the data listener its own port, or "
                 "DATA_PORT=0 for any free one")
        if self.data_host is not None:
            import ipaddress

            try:
                ipaddress.ip_address(self.data_host)
            except ValueError:
                raise ConfigError(f"data_host '{self.data_host}' is not an IP address") from None

    def _validate_security(self, need: Any) -> None:
        from .security import SecurityError, is_loopback, read_secret

        for name in ("secret_file", "tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            need(path is None or os.path.isfile(path), f"{name} '{path}' not found")
        need((self.tls_cert is None) == (self.tls_key is None),
             "tls_cert and tls_key go together: set both or neither")
        need(not self.mtls or (self.tls_ca and self.tls_cert),
             "mtls needs tls_ca and this node's tls_cert and tls_key")
        need(self.tls_ca is None or self.node_index != 0 or self.tls_cert is not None,
             "node 0 serves TLS when tls_ca is set: give it tls_cert and tls_key (lsgd certs "
             "creates them)")
        need(":" not in self.ip_addr, f"ip_addr {self.ip_addr} is an IPv6 address; node 0's "
             "servers listen on IPv4 only: give node 0's IPv4 address or a host name")
        try:
            secret = read_secret(self.secret_file)
        except SecurityError as exc:
            raise ConfigError(str(exc)) from None
        need(secret is not None or is_loopback(self.ip_addr) or self.allow_insecure,
             f"ip_addr {self.ip_addr} is not a loopback address: the job needs a secret "
             "(SECRET_FILE or LSGD_SECRET; `lsgd certs` writes one, with TLS certificates), or "
             "ALLOW_INSECURE=1 on a network you trust")

    # ------------------------------------------------------------------ derived values
    @property
    def window(self) -> int:
        """Losses averaged for leader election."""
        return self.avg_size if self.avg_size is not None else max(1, self.l_comm // 2)

    @property
    def rule_spec(self) -> str:
        """The rule as every node must run it: ``algorithm``, with its ``rule_args`` if any
        (compared by the global server when a node joins)."""
        args = ",".join(sorted(p.strip() for p in self.rule_args.split(",") if p.strip()))
        return f"{self.algorithm} ({args})" if args else self.algorithm

    @property
    def session_address(self) -> int | None:
        """The port of the nodes' session streams (a plain socket, ``aio_session.py``): None
        when off (the nodes use ``port``; always under TLS), 0 for any free port."""
        if self.session_port == 0 or self.tls_ca is not None:
            return None
        if self.session_port is None:
            return 0 if self.port == 0 else (self.port + 2 if self.port < 65534 else 0)
        return self.session_port

    def _server_ports(self) -> dict[str, int | None]:
        """Node 0's global-server ports by name (the default ones say so)."""
        def named(name: str, given: int | None, default: str) -> str:
            return name + (f" ({default} by default)" if given is None else "")

        return {"PORT": self.port,
                named("STATUS_PORT", self.status_port, "PORT+1"): self.status_address,
                named("SESSION_PORT", self.session_port, "PORT+2"): self.session_address,
                named("BULK_PORT", self.bulk_port, "PORT+3"): self.bulk_address}

    @property
    def bulk_address(self) -> int | None:
        """The port of the nodes' parameter transfers (``global_server/bulk.py``): None when
        off (gRPC streams on ``port``; always under TLS), 0 for any free port."""
        if self.bulk_port == 0 or self.tls_ca is not None:
            return None
        if self.bulk_port is None:
            return 0 if self.port == 0 else (self.port + 3 if self.port < 65533 else 0)
        return self.bulk_port

    @property
    def status_address(self) -> int | None:
        """The status page's port: None when off, 0 for any free port."""
        if self.status_port == 0:
            return None
        if self.status_port is None:
            return 0 if self.port == 0 else (self.port + 1 if self.port < 65535 else 0)
        return self.status_port

    def data_listen_host(self) -> str:
        """PLANE=chain: the address this node's data listener binds and announces:
        ``data_host``, else the local address that reaches node 0 (loopback for a local job)."""
        if self.data_host:
            return self.data_host
        from .security import is_loopback

        if is_loopback(self.ip_addr):
            return "127.0.0.1"
        import socket

        try:
            family, _, _, _, addr = socket.getaddrinfo(self.ip_addr, self.port or 9,
                                                       type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)  # no packet is sent: this only picks the route
                return s.getsockname()[0]
        except OSError as exc:
            raise ConfigError(f"cannot tell which address of this host reaches node 0 at "
                              f"{self.ip_addr} ({exc}); set DATA_HOST") from None

    @property
    def total_workers(self) -> int:
        return self.num_groups * self.workers

    def worker_id(self, local_index: int) -> int:
        """Global id of this node's worker ``local_index``."""
        return self.node_index * self.workers + local_index

    def make_rule(self) -> Rule:
        """Instantiate the configured training rule (``algorithm`` and ``rule_args``)."""
        cls = load_rule(self.algorithm, RULES)
        return cls.from_config(self, **parse_args(cls, self.rule_args))

    def replace(self, **changes: Any) -> "JobConfig":
        return dataclasses.replace(self, **changes)


def is_script(entry: str) -> bool:
    """True when ``entry`` names a script (``*.py``, optionally followed by its arguments)."""
    first = entry.strip().split(maxsplit=1)
    return bool(first) and first[0].strip("'\"").endswith(".py")


def fields() -> list[dataclasses.Field]:
    """The config fields, in declaration order (used to build the CLI)."""
    return list(dataclasses.fields(JobConfig))
