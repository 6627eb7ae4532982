#!/usr/bin/env bash
# Run one node of an lsgd job.
#
#   bash train.sh <node-index>
#   srun --ntasks-per-node=1 bash train.sh    # under Slurm (or a Kubernetes Indexed Job)
#
# Node 0 also starts the global server. With the defaults below the whole job runs on this
# machine. For several machines, set ip_addr to node 0's address and num_groups to the number of
# nodes, then run `bash train.sh <i>` on node i (0 .. num_groups-1). Every knob can be overridden
# from the environment by its upper-case name, e.g.
#
#   NUM_GROUPS=2 bash train.sh 0 &  NUM_GROUPS=2 bash train.sh 1      # two nodes, one machine
#   ALGORITHM=easgd ALPHA=0.1 bash train.sh 0                         # EASGD instead of LSGD
#   C1=0.2 C2=0.05 bash train.sh 0                                    # other LSGD pull strengths
set -euo pipefail
PYTHON="${PYTHON:-python3}"

# --- a cluster launcher places the node when no node index is given (docs/cluster.md):
# Slurm (srun, one task per node: index SLURM_PROCID, NUM_GROUPS SLURM_NTASKS, IP_ADDR the
# first host of SLURM_JOB_NODELIST) or a Kubernetes Indexed Job (index JOB_COMPLETION_INDEX)
if [ $# -eq 0 ]; then
    placed="$("$PYTHON" -m lsgd place)" || exit 2   # a misfit: one line said which and why
    if [ -n "$placed" ]; then
        read -r node_index NUM_GROUPS IP_ADDR launcher <<< "$placed"
        echo "lsgd: node $node_index of $NUM_GROUPS, placed by $launcher; node 0 at $IP_ADDR" >&2
        set -- "$node_index"
    fi
fi

# --- where the job runs -------------------------------------------------------------------
ip_addr="${IP_ADDR:-127.0.0.1}"     # address of node 0 (global server)
port="${PORT:-50051}"               # global server port (0 on node 0: any free port)
session_port="${SESSION_PORT:-}"   # the nodes' session streams (empty: PORT+2; 0: on PORT)
bulk_port="${BULK_PORT:-}"         # the nodes' parameter transfers (empty: PORT+3; 0: on PORT)
num_groups="${NUM_GROUPS:-1}"       # number of nodes
workers="${WORKERS:-2}"             # worker processes per node
# --- the rule ------------------------------------------------------------------------------
algorithm="${ALGORITHM:-lsgd}"      # lsgd | easgd | average | diloco | grawa, or path/to/rule.py:Class
rule_args="${RULE_ARGS:-}"          # your rule's own arguments: name=value,name=value
c1="${C1:-0.1}"                     # LSGD pull toward the local (node) leader, in [0, 1]
c2="${C2:-0.1}"                     # LSGD pull toward the global leader, in [0, 1]
p1="${P1:-0}"                       # LSGD per-step proximal pulls (reference code, not the
p2="${P2:-0}"                       #   paper; off by default)
alpha="${ALPHA:-0.1}"               # EASGD moving rate toward the center, in [0, 1]
beta="${BETA:-}"                    # EASGD center moving rate (empty: alpha * participants)
outer_lr="${OUTER_LR:-0.7}"         # DiLoCo outer learning rate (Nesterov SGD on the server)
outer_momentum="${OUTER_MOMENTUM:-0.9}"  # DiLoCo outer momentum
l_comm="${L_COMM:-16}"              # local round every l_comm iterations per worker
g_comm="${G_COMM:-64}"              # global round every g_comm iterations per worker
sync_every="${SYNC_EVERY:-0.05}"      # asynchronous rules: least seconds between a node's syncs
avg_size="${AVG_SIZE:-}"            # losses averaged to elect leaders (empty: l_comm / 2)
# --- the training job ----------------------------------------------------------------------
entry="${ENTRY:-lsgd.jobs.digits_mlp:main}"   # your code: module:function, or script.py [args]
shard="${SHARD:-permutation}"       # worker.shard(): permutation (own order) | disjoint (own part)
eval_every="${EVAL_EVERY:-0}"       # evaluate leader/average/center every N iterations (0: at the end)
lr="${LR:-0.05}"                    # learning rate
momentum="${MOMENTUM:-0.9}"         # Nesterov momentum
batch_size="${BATCH_SIZE:-32}"      # minibatch size
iterations="${ITERATIONS-6000}"     # total SGD steps over all workers (set empty: no limit)
minutes="${MINUTES:-}"              # wall-clock budget (empty: no limit)
seed="${SEED:-0}"                   # random seed
run_dir="${RUN_DIR:-runs/lsgd}"     # outputs: RUN_DIR/node<i>/{metrics.csv,summary.json}
job_id="${JOB_ID:-lsgd}"            # job name, the same on every node
wire="${WIRE:-float32}"              # parameter encoding between nodes: float32 | bfloat16
plane="${PLANE:-star}"              # leader/sums between nodes: star (via node 0) | chain (node to node)
plane_fanout="${PLANE_FANOUT:-1}"   # PLANE=chain: chains a leader broadcast is cut into (1: one)
data_host="${DATA_HOST:-}"          # PLANE=chain: this node's address for the others (empty: auto)
data_port="${DATA_PORT:-0}"         # PLANE=chain: this node's data port (0: any free port)
devices="${DEVICES:-}"              # GPUs: local worker i on GPU i mod n of this list, e.g. 0,1
                                    #   (empty: the GPUs the node sees; all: no mapping)
# --- security (see README "Security"; `python -m lsgd certs` creates the files) ------------
secret_file="${SECRET_FILE:-}"      # job secret (or set LSGD_SECRET); needed beyond loopback
tls_ca="${TLS_CA:-}"                # CA certificate: TLS on every channel
tls_cert="${TLS_CERT:-}"            # this node's certificate (node 0 serves it)
tls_key="${TLS_KEY:-}"              # its private key
mtls="${MTLS:-0}"                   # 1: node 0 accepts only clients with a certificate from TLS_CA
allow_insecure="${ALLOW_INSECURE:-0}"  # 1: no secret beyond loopback (trusted network only)
# --- fault handling ------------------------------------------------------------------------
checkpoint_every="${CHECKPOINT_EVERY:-0}"  # checkpoint every N iterations (0: never)
resume="${RESUME:-0}"                    # 1: go on from the last checkpoint in RUN_DIR
respawn="${RESPAWN:-2}"                  # restarts of a dead worker (from the leader/center)
state_every="${STATE_EVERY:-1}"          # seconds between saves of the global server's state
reconnect_timeout="${RECONNECT_TIMEOUT:-120}"  # seconds a node trains on without the server
round_timeout="${ROUND_TIMEOUT:-30}"     # seconds a round waits for a late worker or node
node_timeout="${NODE_TIMEOUT:-5}"        # seconds of silence before a node is dropped
join_timeout="${JOIN_TIMEOUT:-60}"       # seconds to wait for every node to join
connect_timeout="${CONNECT_TIMEOUT:-20}" # seconds a node retries to reach the global server
# --- watching the job (docs/observability.md) ---------------------------------------------
status_port="${STATUS_PORT:-}"           # node 0's status page + /metrics (empty: PORT+1; 0: off)
progress_every="${PROGRESS_EVERY:-10}"   # seconds between progress lines in a log (0: none)
tensorboard="${TENSORBOARD:-0}"          # 1: TensorBoard events in RUN_DIR/tensorboard
log_level="${LOG_LEVEL:-INFO}"           # WARNING: no progress, only problems

if [ $# -ne 1 ]; then
    echo "usage: bash train.sh <node-index>   (0 .. num_groups-1; node 0 hosts the global server;" \
         "under srun or a Kubernetes Indexed Job it may be left out)" >&2
    exit 2
fi

exec "$PYTHON" -m lsgd train \
    --node-index "$1" --ip-addr "$ip_addr" --port "$port" --num-groups "$num_groups" \
    --workers "$workers" --algorithm "$algorithm" --rule-args "$rule_args" \
    --c1 "$c1" --c2 "$c2" --p1 "$p1" --p2 "$p2" --alpha "$alpha" --beta "$beta" \
    --outer-lr "$outer_lr" --outer-momentum "$outer_momentum" --l-comm "$l_comm" --g-comm "$g_comm" --sync-every "$sync_every" --avg-size "$avg_size" \
    --entry "$entry" --eval-every "$eval_every" --shard "$shard" \
    --lr "$lr" --momentum "$momentum" --batch-size "$batch_size" \
    --iterations "$iterations" --minutes "$minutes" --seed "$seed" --run-dir "$run_dir" \
    --job-id "$job_id" --checkpoint-every "$checkpoint_every" --resume "$resume" \
    --respawn "$respawn" --state-every "$state_every" \
    --reconnect-timeout "$reconnect_timeout" --round-timeout "$round_timeout" --node-timeout "$node_timeout" \
    --join-timeout "$join_timeout" --connect-timeout "$connect_timeout" --wire "$wire" \
    --plane "$plane" --plane-fanout "$plane_fanout" --data-host "$data_host" --data-port "$data_port" \
    --devices "$devices" \
    --secret-file "$secret_file" --tls-ca "$tls_ca" --tls-cert "$tls_cert" --tls-key "$tls_key" \
    --mtls "$mtls" --allow-insecure "$allow_insecure" --status-port "$status_port" \
    --session-port "$session_port" --bulk-port "$bulk_port" \
    --progress-every "$progress_every" --tensorboard "$tensorboard" --log-level "$log_level"
