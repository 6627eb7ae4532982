#!/usr/bin/env bash
# A one-machine Slurm cluster for lsgd's real-daemon test (tests/test_slurm.py), from Debian's
# packages: munged, slurmctld and two slurmd (nodes n1 and n2, both this machine, on ports
# 17001 and 17002), so that `srun -N 2 -n 2 --ntasks-per-node=1` runs a 2-node job here.
#
#   sudo bash deploy/slurm/local-cluster.sh          # install if missing, start, wait until idle
#   export SLURM_CONF=/var/tmp/lsgd-slurm/slurm.conf # (the test finds it there by itself)
#   sinfo; srun -N 2 -n 2 --ntasks-per-node=1 hostname
#   sudo bash deploy/slurm/local-cluster.sh stop     # stop the daemons it started
#
# Root; idempotent (a second start finds the daemons running and only waits for the nodes).
# Everything lives in LSGD_SLURM_DIR (default /var/tmp/lsgd-slurm): slurm.conf, a munge key
# and socket of its own, state, spool, pid and log files; nothing is written to /etc, no system
# service is started or changed. Only loopback: slurmctld on 127.0.0.1:16817, slurmd on
# 127.0.0.1:17001-17002. Node names n1/n2 are not host names: NodeAddr is 127.0.0.1, which
# lsgd reads back with `scontrol show node` (docs/cluster.md).
#
# Needs a Slurm built with --enable-multiple-slurmd (Debian 12's 22.05 is: `slurmd -N n1`).
set -euo pipefail

DIR="${LSGD_SLURM_DIR:-/var/tmp/lsgd-slurm}"
CTLD_PORT="${LSGD_SLURM_CTLD_PORT:-16817}"
NODE_PORTS=(17001 17002)   # n1, n2
WAIT_S="${LSGD_SLURM_WAIT:-60}"   # bound on the wait for the nodes to be idle
export SLURM_CONF="$DIR/slurm.conf"

say() { echo "local-cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

pid_of() {  # a live pid from a pid file, or nothing
    local f="$1" pid
    [ -s "$f" ] || return 0
    pid="$(cat "$f")"
    if kill -0 "$pid" 2>/dev/null; then echo "$pid"; fi
}

stop() {
    local f pid name
    for name in slurmd-n1 slurmd-n2 slurmctld munged; do
        f="$DIR/run/$name.pid"
        pid="$(pid_of "$f")"
        if [ -n "$pid" ]; then
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            if kill -0 "$pid" 2>/dev/null; then say "$name ($pid) ignored SIGTERM: SIGKILL"; kill -9 "$pid"; fi
            say "stopped $name ($pid)"
        fi
        rm -f "$f"
    done
}

install() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v srun >/dev/null || missing+=(slurm-client)
    [ ${#missing[@]} -eq 0 ] && return 0
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install them"
    say "installing ${missing[*]} (Debian's packages; their system services are not started)"
    # policy-rc.d 101: the packages' postinst must not start the system-wide daemons
    local policy=/usr/sbin/policy-rc.d made=0
    if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; made=1; fi
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; } >"$DIR/apt.log" 2>&1 \
        || { [ $made = 1 ] && rm -f "$policy"; die "apt-get failed: see $DIR/apt.log"; }
    [ $made = 1 ] && rm -f "$policy"
    return 0
}

write_config() {
    mkdir -p "$DIR/run" "$DIR/state" "$DIR/log" "$DIR/spool/n1" "$DIR/spool/n2"
    local munge="$DIR/munge"
    mkdir -p "$munge"
    if [ ! -s "$munge/munge.key" ]; then  # a key of its own, never the system's
        dd if=/dev/urandom of="$munge/munge.key" bs=1024 count=1 status=none
    fi
    chown -R munge:munge "$munge"
    chmod 0700 "$munge"; chmod 0400 "$munge/munge.key"
    mkdir -p "$DIR/munge-socket"; chown munge:munge "$DIR/munge-socket"; chmod 0755 "$DIR/munge-socket"
    local cpus host
    cpus="$(nproc)"; host="$(hostname -s)"
    cat > "$SLURM_CONF" <<CONF
# written by deploy/slurm/local-cluster.sh: a one-machine cluster for lsgd's tests
ClusterName=lsgd-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge-socket/munge.socket.2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# no cgroups here (containers, gVisor): plain process tracking, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=30
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORTS[0]} CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORTS[1]} CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=30 State=UP OverSubscribe=YES
CONF
}

start() {
    [ "$(id -u)" = 0 ] || die "run as root (it starts slurmd and munged)"
    mkdir -p "$DIR"
    install
    write_config
    if [ -z "$(pid_of "$DIR/run/munged.pid")" ]; then
        runuser -u munge -- munged --socket="$DIR/munge-socket/munge.socket.2" \
            --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge-socket/munged.pid" \
            --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
            || die "munged did not start: see $DIR/munge/munged.log"
        for _ in $(seq 50); do [ -s "$DIR/munge-socket/munged.pid" ] && break; sleep 0.1; done
        cp "$DIR/munge-socket/munged.pid" "$DIR/run/munged.pid"
        say "started munged ($(cat "$DIR/run/munged.pid"))"
    fi
    if [ -z "$(pid_of "$DIR/run/slurmctld.pid")" ]; then
        slurmctld -f "$SLURM_CONF" || die "slurmctld did not start: see $DIR/log/slurmctld.log"
        say "started slurmctld"
    fi
    local n
    for n in n1 n2; do
        if [ -z "$(pid_of "$DIR/run/slurmd-$n.pid")" ]; then
            slurmd -f "$SLURM_CONF" -N "$n" || die "slurmd -N $n did not start: see $DIR/log/slurmd-$n.log"
            say "started slurmd -N $n"
        fi
    done
    local end=$((SECONDS + WAIT_S)) states=""
    while [ $SECONDS -lt $end ]; do
        states="$(timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ' || true)"
        [[ "$states" == *"n1 idle"*"n2 idle"* ]] && break
        sleep 1
    done
    [[ "$states" == *"n1 idle"*"n2 idle"* ]] \
        || die "nodes not idle after ${WAIT_S}s (sinfo: ${states:-no answer}); logs in $DIR/log"
    say "ready: $states; export SLURM_CONF=$SLURM_CONF"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: bash deploy/slurm/local-cluster.sh [start|stop]" >&2; exit 2 ;;
esac
