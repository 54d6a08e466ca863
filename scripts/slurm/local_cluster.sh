#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests of the sbatch scripts (root, Debian/Ubuntu).
#
#   bash scripts/slurm/local_cluster.sh start    # install slurm-wlm if needed, start the daemons
#   bash scripts/slurm/local_cluster.sh status   # sinfo
#   bash scripts/slurm/local_cluster.sh stop     # stop the daemons this script started
#
# After `start`, client commands need `export SLURM_CONF=$METP_SLURM_DIR/slurm.conf` (printed).
# Everything lives in METP_SLURM_DIR (default /tmp/metp-slurm); nothing is written to /etc.
#
# Why this configuration: slurmctld and slurmd run in the foreground (-D) under nohup, so no
# systemd or cgroups are needed; ProctrackType=proctrack/linuxproc, TaskPlugin=task/none and
# JobAcctGatherType=jobacct_gather/none avoid cgroup plugins; AuthType=auth/none with
# CredType=cred/none avoids munge (fine for a single-user test node, never for a real cluster);
# NodeName is the short hostname (slurmd looks itself up by it) and NodeAddr=127.0.0.1 avoids DNS.
set -euo pipefail

DIR=${METP_SLURM_DIR:-/tmp/metp-slurm}
CONF=$DIR/slurm.conf
CTLD_PORT=${METP_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${METP_SLURMD_PORT:-6818}

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
        return
    fi
    [ "$(id -u)" = 0 ] || die "slurm-wlm is not installed and installing it needs root"
    command -v apt-get >/dev/null || die "slurm-wlm is not installed and there is no apt-get"
    echo "installing slurm-wlm ..."
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null
}

write_conf() {
    mkdir -p "$DIR/state" "$DIR/spool"
    local host node
    host=$(hostname -s)
    # slurmd -C prints this node's hardware line: "NodeName=h CPUs=.. Boards=.. ... RealMemory=..".
    node=$(slurmd -C | head -n1 | sed "s/^NodeName=[^ ]*/NodeName=$host/")
    cat >"$CONF" <<EOF
ClusterName=metplocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    install
    export SLURM_CONF=$CONF
    if alive "$DIR/ctld.launch.pid" && alive "$DIR/slurmd.launch.pid"; then
        echo "already running"; status; return
    fi
    write_conf
    nohup slurmctld -D -f "$CONF" >"$DIR/slurmctld.out" 2>&1 &
    echo $! >"$DIR/ctld.launch.pid"
    nohup slurmd -D -f "$CONF" >"$DIR/slurmd.out" 2>&1 &
    echo $! >"$DIR/slurmd.launch.pid"
    for _ in $(seq 1 60); do
        if sinfo -h -o %t 2>/dev/null | grep -Eq '^(idle|mix|alloc)'; then
            echo "SLURM is up: export SLURM_CONF=$CONF"
            status
            return
        fi
        sleep 0.5
    done
    tail -n 20 "$DIR/slurmctld.out" "$DIR/slurmd.out" >&2 || true
    die "the node did not become idle within 30 s (logs above, and $DIR/*.log)"
}

status() { SLURM_CONF=$CONF sinfo; }

stop() {
    local f
    for f in "$DIR/slurmd.launch.pid" "$DIR/ctld.launch.pid"; do
        if alive "$f"; then kill "$(cat "$f")"; fi
        rm -f "$f"
    done
    echo "stopped"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) die "usage: $0 [start|stop|status]" ;;
esac
