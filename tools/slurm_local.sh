#!/usr/bin/env bash
# A real Slurm cluster on this one machine, to test examples/slurm/ for real:
# munge, slurmctld and one slurmd per fake node, all on localhost.
#
#   tools/slurm_local.sh install            apt-get install slurmctld slurmd slurm-client munge
#   tools/slurm_local.sh start [NODES]      write slurm.conf, start the daemons (default 4 nodes)
#   tools/slurm_local.sh status             sinfo
#   tools/slurm_local.sh kill-node NAME     a node failure: SIGKILL its slurmd, step daemons, tasks
#   tools/slurm_local.sh revive-node NAME   start that node's slurmd again
#   tools/slurm_local.sh stop               stop every daemon this script started
#
# Needs root (daemons, /etc/slurm) and no systemd. Checked on Debian 12 with
# Slurm 22.05; the configuration and its traps are in docs/slurm.md.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARKER="# written by tools/slurm_local.sh"
SPOOL=/var/spool/slurmd
STATE=/var/spool/slurmctld
LOGS=/var/log/slurm
CTLD_PID=/run/slurmctld.pid
MUNGE_PID=/run/munge/munged.pid
FIRST_PORT=17001
# A lost node turns DOWN after this many seconds without answering pings
# (Slurm's default, 300 s, would make the failure test wait five minutes).
SLURMD_TIMEOUT=${SLURMD_TIMEOUT:-20}

die() { echo "slurm_local.sh: $*" >&2; exit 2; }

need_root() {
    [[ $(id -u) -eq 0 ]] || die "run as root: it starts daemons and writes $CONF"
}

node_pid_file() { echo "/run/slurmd-$1.pid"; }

# The pid in a pid file, if that process is alive.
live_pid() {
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

cmd_install() {
    need_root
    # slurm-wlm-emulator switches the daemons to front-end builds, and
    # slurmctld then dies ("No front end nodes defined").
    if dpkg -s slurm-wlm-emulator >/dev/null 2>&1; then
        die "slurm-wlm-emulator is installed: remove it (apt-get remove slurm-wlm-emulator)"
    fi
    if dpkg -s slurmctld slurmd slurm-client munge >/dev/null 2>&1; then
        echo "slurmctld, slurmd, slurm-client and munge are installed"
        return
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge
}

write_conf() {
    local nodes=$1 last_port=$((FIRST_PORT + $1 - 1))
    if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
        die "$CONF exists and is not ours: move it away first"
    fi
    mkdir -p "$(dirname "$CONF")"
    cat >"$CONF" <<EOF
$MARKER: a test cluster of $nodes fake nodes on localhost
ClusterName=deadpool-local
SlurmctldHost=localhost
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
MpiDefault=none
# No cgroups in a container: track processes by parentage, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Fake nodes announce the CPUs and memory of this file, not the machine's.
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=$SLURMD_TIMEOUT
StateSaveLocation=$STATE
SlurmctldPidFile=$CTLD_PID
SlurmctldLogFile=$LOGS/slurmctld.log
# %n: one spool directory, pid file and log per fake node.
SlurmdSpoolDir=$SPOOL/%n
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdLogFile=$LOGS/slurmd-%n.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=node[1-$nodes] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$FIRST_PORT-$last_port CPUs=4 RealMemory=4000
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    if live_pid "$MUNGE_PID" >/dev/null; then return; fi
    [[ -s /etc/munge/munge.key ]] || die "no /etc/munge/munge.key: run '$0 install'"
    mkdir -p /run/munge && chown munge: /run/munge
    runuser -u munge -- munged
    munge -n | unmunge >/dev/null || die "munge does not work (see /var/log/munge/munged.log)"
}

start_slurmctld() {
    if live_pid "$CTLD_PID" >/dev/null; then return; fi
    mkdir -p "$STATE" "$LOGS"
    # -c: a clean state, so nodes a previous test killed start idle.
    slurmctld -c
    wait_for "slurmctld to answer" 30 scontrol ping
}

start_slurmd() {
    local node=$1
    if live_pid "$(node_pid_file "$node")" >/dev/null; then return; fi
    mkdir -p "$SPOOL/$node" "$LOGS"
    slurmd -N "$node"
}

# wait_for WHAT SECONDS COMMAND...: until COMMAND succeeds.
wait_for() {
    local what=$1 seconds=$2 end
    shift 2
    end=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < end)) || die "timed out after ${seconds} s waiting for $what"
        sleep 1
    done
}

all_idle() {
    local states
    states=$(sinfo -h -N -o '%T' | sort -u)
    [[ $states == idle ]]
}

node_names() {
    sinfo -h -N -o '%N' | sort -u
}

cmd_start() {
    local nodes=${1:-4} node
    [[ $nodes =~ ^[0-9]+$ && $nodes -ge 1 && $nodes -le 64 ]] ||
        die "NODES must be a number from 1 to 64, not '$nodes'"
    need_root
    command -v slurmctld >/dev/null || die "Slurm is not installed: run '$0 install'"
    write_conf "$nodes"
    start_munge
    start_slurmctld
    for ((k = 1; k <= nodes; k++)); do start_slurmd "node$k"; done
    wait_for "$nodes idle nodes (see $LOGS)" 60 all_idle
    sinfo
}

cmd_status() {
    scontrol ping
    sinfo -N
}

# The processes of every job step on a node, and their step daemons.
node_processes() {
    local node=$1 pid parent
    for pid in $(scontrol listpids '*' "$node" 2>/dev/null | awk 'NR > 1 {print $1}'); do
        echo "$pid"
        parent=$(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' ') || continue
        if [[ -n $parent && $(ps -o comm= -p "$parent" 2>/dev/null) == slurmstepd ]]; then
            echo "$parent"
        fi
    done | sort -u
}

cmd_kill_node() {
    local node=${1:-} pids slurmd
    [[ -n $node ]] || die "kill-node needs a node name (e.g. node2)"
    need_root
    slurmd=$(live_pid "$(node_pid_file "$node")") || die "no live slurmd for $node"
    # Listed first: scontrol asks the node's step daemons, which die next.
    pids=$(node_processes "$node")
    # All at once, as a power loss would: nothing on the node reports anything.
    # shellcheck disable=SC2086  # one pid per word
    kill -KILL "$slurmd" $pids 2>/dev/null || true
    echo "killed $node: slurmd $slurmd and $(wc -w <<<"$pids") step processes"
}

cmd_revive_node() {
    local node=${1:-}
    [[ -n $node ]] || die "revive-node needs a node name (e.g. node2)"
    need_root
    start_slurmd "$node"
}

stop_pid_file() {
    local pid end
    pid=$(live_pid "$1") || return 0
    kill -TERM "$pid"
    end=$((SECONDS + 15))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < end)); do sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
}

cmd_stop() {
    local node
    need_root
    if live_pid "$CTLD_PID" >/dev/null; then
        for node in $(node_names); do stop_pid_file "$(node_pid_file "$node")"; done
    fi
    stop_pid_file "$CTLD_PID"
    stop_pid_file "$MUNGE_PID"
}

main() {
    local command=${1:-}
    shift || true
    case $command in
        install) cmd_install ;;
        start) cmd_start "$@" ;;
        status) cmd_status ;;
        kill-node) cmd_kill_node "$@" ;;
        revive-node) cmd_revive_node "$@" ;;
        stop) cmd_stop ;;
        *) die "usage: $0 install | start [NODES] | status | kill-node NAME |" \
            "revive-node NAME | stop" ;;
    esac
}

main "$@"
