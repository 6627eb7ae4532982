"""Exit codes of ``lsgd train`` / ``train.sh``: one table, used by every node.

| code | name        | meaning                                                                 |
|------|-------------|-------------------------------------------------------------------------|
| 0    | OK          | the job finished and its result can be trusted                          |
| 1    | FAILED      | this node failed: global server lost for good, no worker left, an       |
|      |             | internal error (the last line says what)                                |
| 2    | CONFIG      | bad configuration or input: a knob, a file, ENTRY, a port in use, too   |
|      |             | little shared memory (one line names it and how to fix it)              |
| 3    | DEGRADED    | the job finished, but its result is suspect: a worker failed and was    |
|      |             | not restarted, no leader was ever elected, every loss was non-finite,   |
|      |             | or an asynchronous rule's last deltas never reached the global server   |
| 4    | STOPPED     | the job was stopped on another node (node 0 interrupted or failed);     |
|      |             | this node stopped cleanly                                               |
| 130  | INTERRUPTED | SIGINT (Ctrl-C) on this node                                            |
| 143  | TERMINATED  | SIGTERM on this node                                                    |
"""

OK = 0
FAILED = 1
CONFIG = 2
DEGRADED = 3
STOPPED = 4
INTERRUPTED = 130
TERMINATED = 143

# From least to most serious, for a job's worst node: a cause ranks above its effects (a node
# that FAILED or was misconfigured above the STOPPED nodes it took down with it).
SEVERITY = (OK, DEGRADED, STOPPED, TERMINATED, INTERRUPTED, FAILED, CONFIG)


def worst(codes: list[int]) -> int:
    """The most serious of the nodes' exit codes (an unknown code counts as FAILED; none: OK)."""
    rank = {code: i for i, code in enumerate(SEVERITY)}
    return max(codes, key=lambda c: rank.get(c, rank[FAILED]), default=OK)
