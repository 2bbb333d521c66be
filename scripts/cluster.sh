#!/usr/bin/env bash
# The project's local two-node Slurm 22.05 cluster, for the demo and for CI (docs/cluster.md).
#
#   scripts/cluster.sh up       start munged, MariaDB, slurmdbd, slurmctld, slurmd node1 + node2
#                               (idempotent: what already runs is kept) and wait until both nodes are
#                               up (idle after a fresh start)
#   scripts/cluster.sh down     cancel every job, stop every daemon, leave no process behind
#   scripts/cluster.sh status   one line per daemon, then sinfo; exit 0 only when all run
#   scripts/cluster.sh purge    down, then delete the cluster folder (configs, accounting database, logs)
#   scripts/cluster.sh plugstack  (re)write plugstack.conf: Pyxis when installed (scripts/install-enroot-pyxis.sh)
#
# Everything (configs, state, logs, pid files, sockets, the munge key, the MariaDB data) lives in one
# folder, $MDPP_CLUSTER_DIR (default: .cluster/ in the repository). Users and tests `source` its `env`.
# Daemons run as root with SlurmUser=root: this is a throwaway single-host test cluster and CI runs as
# root; a service account would only add set-up steps (docs/cluster.md says more).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=$(realpath -m "${MDPP_CLUSTER_DIR:-$REPO/.cluster}")
TEMPLATES=$REPO/scripts/cluster
READY_TIMEOUT=${MDPP_CLUSTER_TIMEOUT:-60}   # seconds each daemon gets to become ready
NODES=(node1 node2)
CONF=$DIR/etc/slurm.conf

# Ports are derived from the folder's path so that two clusters on one host (a developer's and a
# CI clone's, or a test's throw-away one) do not collide; MDPP_CLUSTER_PORT_BASE overrides. The
# range 12000-19999 stays below Linux's ephemeral ports (32768+, where an outgoing connection could
# hold ours) and below the MASTER_PORTs that workflows.nodes derives from job ids (20000-29999).
path_hash=$(printf %s "$DIR" | cksum | cut -d' ' -f1)
PORT_BASE=${MDPP_CLUSTER_PORT_BASE:-$((12000 + (path_hash % 800) * 10))}
MARIADB_PORT=$PORT_BASE
SLURMDBD_PORT=$((PORT_BASE + 1))
SLURMCTLD_PORT=$((PORT_BASE + 2))
SLURMD_PORTS=($((PORT_BASE + 3)) $((PORT_BASE + 4)))
# Job ids start at a place derived from the same hash: workflows.nodes makes MASTER_PORT 20000 + job id
# (mod 10000), so two clusters that both numbered their jobs from 1 gave two concurrent jobs one port.
# 20 starts 500 apart; MDPP_CLUSTER_FIRST_JOB_ID overrides.
FIRST_JOB_ID=${MDPP_CLUSTER_FIRST_JOB_ID:-$((1 + (path_hash / 800 % 20) * 500))}

MUNGE_SOCKET=$DIR/munge/munged.socket
MARIADB_SOCKET=$DIR/mariadb/mariadb.sock

log() { echo "cluster: $*" >&2; }
die() { echo "cluster: error: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
# Process bookkeeping: one pid file per daemon under $DIR/run, written by us at launch.

pid_file() { echo "$DIR/run/$1.pid"; }

# Prints the daemon's pid when it runs. A pid is only trusted when that process carries our
# SLURM_CONF in its environment (start_daemon puts it there): after a reboot or a crash the number
# may belong to an unrelated process.
running_pid() {
    local pid_path pid
    pid_path=$(pid_file "$1")
    [[ -s $pid_path ]] || return 1
    pid=$(<"$pid_path")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    is_ours "$pid" || return 1
    echo "$pid"
}

is_ours() { tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF"; }

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# start_daemon NAME PORT-or-"" COMMAND...: launch in the foreground mode of the daemon, in its own
# session (so a Ctrl-C in the caller's terminal or a test runner's process group does not reach it).
start_daemon() {
    local name=$1 port=$2
    shift 2
    if pid=$(running_pid "$name"); then
        log "$name already running (pid $pid)"
        return 0
    fi
    if [[ -n $port ]] && port_in_use "$port"; then
        die "$name: port $port on 127.0.0.1 is taken by another program (set MDPP_CLUSTER_PORT_BASE)"
    fi
    # Exported so that every process the daemon starts (slurmstepd, job steps) carries it: `down`
    # recognises leftover step daemons of this cluster by it.
    SLURM_CONF=$CONF setsid "$@" >>"$DIR/log/$name.out" 2>&1 </dev/null &
    echo $! >"$(pid_file "$name")"
}

# tail_logs NAME: the daemon's own log and its captured stdout/stderr, whichever exist; prints
# where the logs are, or that it wrote none.
tail_logs() {
    local f shown=0
    for f in "$DIR/log/$1.log" "$DIR/log/$1.out"; do
        [[ -s $f ]] || continue
        echo "---- last lines of $f" >&2
        tail -n 20 "$f" >&2
        shown=1
    done
    if ((shown)); then echo "logs above"; else echo "it wrote nothing to $DIR/log/$1.log or $1.out"; fi
}

# wait_ready NAME PROBE...: poll PROBE until it succeeds; fail naming the daemon when it exits or
# does not become ready within READY_TIMEOUT seconds.
wait_ready() {
    local name=$1 deadline=$((SECONDS + READY_TIMEOUT))
    shift
    local pid status where
    pid=$(<"$(pid_file "$name")")
    until "$@" >/dev/null 2>&1; do
        # Plain existence, not running_pid: until exec the new child still has our old environment.
        if ! kill -0 "$pid" 2>/dev/null; then
            status=0
            wait "$pid" 2>/dev/null || status=$?  # our child: its exit status (128+N: killed by signal N)
            where=$(tail_logs "$name")
            ((status == 127)) && status="unknown"  # not our child after all
            die "$name exited during start-up (exit status $status; $where)"
        fi
        if ((SECONDS >= deadline)); then
            where=$(tail_logs "$name")
            die "$name did not become ready within ${READY_TIMEOUT}s ($where)"
        fi
        sleep 0.3
    done
}

# stop_daemons NAME...: SIGTERM to all of them at once, up to 15 s grace, then SIGKILL.
stop_daemons() {
    local name pid i t0=$SECONDS
    local -A pids=()
    for name in "$@"; do
        if pid=$(running_pid "$name"); then
            pids[$name]=$pid
            kill -TERM "$pid" 2>/dev/null || true
        fi
        rm -f "$(pid_file "$name")"
    done
    for ((i = 0; i < 150; i++)); do
        for name in "${!pids[@]}"; do
            kill -0 "${pids[$name]}" 2>/dev/null || unset "pids[$name]"
        done
        ((${#pids[@]})) || break
        sleep 0.1
    done
    for name in "${!pids[@]}"; do
        log "$name (pid ${pids[$name]}) ignored SIGTERM for 15 s: killing it"
        kill -KILL "${pids[$name]}" 2>/dev/null || true
    done
    log "stopped $* in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------------------------------------
# Configuration

render() { # render TEMPLATE OUTPUT MODE: replace @NAME@ placeholders; the file appears atomically
    local text
    text=$(<"$1")
    text=${text//@DIR@/$DIR}
    text=${text//@HOSTNAME@/$(hostname -s)}
    text=${text//@SLURMCTLD_PORT@/$SLURMCTLD_PORT}
    text=${text//@SLURMDBD_PORT@/$SLURMDBD_PORT}
    text=${text//@MARIADB_PORT@/$MARIADB_PORT}
    text=${text//@SLURMD1_PORT@/${SLURMD_PORTS[0]}}
    text=${text//@SLURMD2_PORT@/${SLURMD_PORTS[1]}}
    text=${text//@FIRST_JOB_ID@/$FIRST_JOB_ID}
    text=${text//@REAL_MEMORY_MB@/$REAL_MEMORY_MB}
    text=${text//@DB_PASSWORD@/$DB_PASSWORD}
    [[ $text != *@[A-Z_]*@* ]] || die "unfilled placeholder left in $1: $(grep -o '@[A-Z_0-9]*@' <<<"$text" | head -1)"
    (umask 077; printf '%s\n' "$text" >"$2.tmp")
    chmod "$3" "$2.tmp"
    mv -f "$2.tmp" "$2"
}

write_configs() {
    mkdir -p "$DIR"/{etc,run,log,munge,mariadb/tmp,state/slurmctld}
    # Clients of any user must read slurm.conf and env and reach munge's socket; only the munge
    # key (0400) and the database password (slurmdbd.conf, etc/db-password, 0600) are private.
    chmod 755 "$DIR" "$DIR/etc" "$DIR/munge"
    local n
    for n in "${NODES[@]}"; do mkdir -p "$DIR/state/slurmd-$n"; done
    # Unix socket paths are limited to 108 bytes; fail here rather than with a cryptic bind error.
    ((${#MUNGE_SOCKET} < 100 && ${#MARIADB_SOCKET} < 100)) \
        || die "cluster folder path too long for unix sockets: $DIR (set MDPP_CLUSTER_DIR to a shorter path)"
    [[ -s $DIR/etc/db-password ]] \
        || (umask 077; od -An -tx1 -N16 /dev/urandom | tr -d ' \n' >"$DIR/etc/db-password")
    DB_PASSWORD=$(<"$DIR/etc/db-password")
    # Half the host's memory per node: memory is not a consumable resource here (CR_Core), so
    # this only bounds what a job may request with --mem.
    REAL_MEMORY_MB=$(awk '/^MemTotal:/ {print int($2 / 1024 / 2)}' /proc/meminfo)
    render "$TEMPLATES/slurm.conf.in" "$CONF" 644
    render "$TEMPLATES/slurmdbd.conf.in" "$DIR/etc/slurmdbd.conf" 600
    cat >"$DIR/env.tmp" <<EOF
# Written by scripts/cluster.sh: \`source $DIR/env\` points Slurm's commands at the local cluster.
export SLURM_CONF=$CONF
case ":\$PATH:" in *:/usr/sbin:*) ;; *) export PATH="\$PATH:/usr/sbin" ;; esac
EOF
    mv -f "$DIR/env.tmp" "$DIR/env"
    write_plugstack
}

# Pyxis (scripts/install-enroot-pyxis.sh builds it): Slurm reads plugstack.conf beside slurm.conf,
# srun when it parses its options and slurmstepd when a step starts, so a running cluster picks a
# change up with the next srun. Without the plugin there is no plugstack.conf at all: an srun with
# --container-image then fails as an unknown option instead of running on the host.
# use_squashfuse: a .sqsh image is mounted where it lies for each step instead of being unpacked
# into a named container: both "nodes" of this cluster share one host and would unpack the same
# container name into one folder.
PYXIS_PLUGIN=${PYXIS_PLUGIN:-/usr/local/lib/slurm/spank_pyxis.so}
write_plugstack() {
    mkdir -p "$DIR/etc"
    if [[ -f $PYXIS_PLUGIN ]]; then
        printf '%s\n' "# Written by scripts/cluster.sh: Pyxis, installed by scripts/install-enroot-pyxis.sh." \
            "required $PYXIS_PLUGIN use_squashfuse=1" >"$DIR/etc/plugstack.conf.tmp"
        chmod 644 "$DIR/etc/plugstack.conf.tmp"
        mv -f "$DIR/etc/plugstack.conf.tmp" "$DIR/etc/plugstack.conf"
    else
        rm -f "$DIR/etc/plugstack.conf"
    fi
}

# ---------------------------------------------------------------------------------------------
# Daemons, in start order

munge_probe() { munge --socket="$MUNGE_SOCKET" -n | unmunge --socket="$MUNGE_SOCKET"; }

start_munge() {
    if [[ ! -s $DIR/munge/munge.key ]]; then
        (umask 077; dd if=/dev/urandom of="$DIR/munge/munge.key.tmp" bs=1024 count=1 status=none)
        chmod 400 "$DIR/munge/munge.key.tmp"
        mv "$DIR/munge/munge.key.tmp" "$DIR/munge/munge.key"
    fi
    # --force: munged refuses paths whose parents are group/world-writable (e.g. a CI workspace or
    # /tmp); the key itself stays readable by root alone.
    start_daemon munged "" munged --foreground --force --socket="$MUNGE_SOCKET" \
        --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
        --seed-file="$DIR/munge/munged.seed" --log-file="$DIR/log/munged.log"
    wait_ready munged munge_probe
}

mariadb_sql() { mariadb --no-defaults --socket="$MARIADB_SOCKET" -uroot "$@"; }

start_mariadb() {
    local data=$DIR/mariadb/data
    if [[ ! -d $data/mysql ]]; then
        log "initialising the accounting database in $data"
        rm -rf "$data"
        mariadb-install-db --no-defaults --datadir="$data" --user=root \
            --auth-root-authentication-method=socket --skip-test-db >"$DIR/log/mariadb-install.out" 2>&1 \
            || { tail -n 20 "$DIR/log/mariadb-install.out" >&2; die "mariadb-install-db failed"; }
    fi
    # Native AIO is off because sandboxes (gVisor) and some CI kernels lack it. slurmdbd logs an
    # "error" that the 64M buffer pool is below its advice; it is plenty for a test cluster's tables.
    start_daemon mariadb "$MARIADB_PORT" mariadbd --no-defaults --user=root --datadir="$data" \
        --socket="$MARIADB_SOCKET" --port="$MARIADB_PORT" --bind-address=127.0.0.1 \
        --pid-file="$DIR/mariadb/mariadb.pid" --log-error="$DIR/log/mariadb.log" \
        --tmpdir="$DIR/mariadb/tmp" --skip-name-resolve --innodb-use-native-aio=0 \
        --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 --skip-log-bin
    wait_ready mariadb mariadb-admin --no-defaults --socket="$MARIADB_SOCKET" -uroot ping
    # Idempotent: ALTER keeps the password in step with etc/db-password.
    mariadb_sql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';
        ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" \
        || die "could not create the slurm database user in MariaDB"
}

start_slurmdbd() {
    start_daemon slurmdbd "$SLURMDBD_PORT" slurmdbd -D
    wait_ready slurmdbd sacctmgr -n show cluster
    # slurmctld would register the cluster itself, but only after its first accounting message;
    # adding it first means sacct works for the very first job.
    if ! sacctmgr -n -P show cluster format=cluster | grep -qx mdpp; then
        sacctmgr -i add cluster mdpp >/dev/null || die "sacctmgr could not add cluster mdpp"
    fi
    # The QOS that preempts (slurm.conf: PreemptType=preempt/qos, PreemptMode=REQUEUE): 'urgent' jobs
    # requeue the 'normal' jobs whose nodes they need.
    if ! sacctmgr -n -P show qos format=name | grep -qx urgent; then
        sacctmgr -i add qos urgent >/dev/null || die "sacctmgr could not add QOS urgent"
    fi
    sacctmgr -i modify qos urgent set Priority=1000 Preempt=normal PreemptMode=requeue >/dev/null \
        || die "sacctmgr could not let QOS urgent preempt QOS normal"
    # A preempted 'normal' job's tasks get TERM at once; the job stays RUNNING for GraceTime, so the
    # ranks save on the signal and the batch shell requeues the job itself. Without a grace time Slurm
    # ends the job at once (TERM to every process, SIGKILL KillWait later): the ranks then have only
    # KillWait to finish their iteration and save. 60 s covers one iteration of the tests' tiny models
    # (up to ~30 s on a loaded 2-core host) plus its save; sites that preempt training set a grace
    # time longer than one iteration plus a save of their model, for the same reason.
    sacctmgr -i modify qos normal set GraceTime=60 >/dev/null || die "sacctmgr could not set QOS normal's GraceTime"
}

ctld_probe() { scontrol ping | grep -q 'is UP'; }

start_slurmctld() {
    start_daemon slurmctld "$SLURMCTLD_PORT" slurmctld -D -f "$CONF"
    wait_ready slurmctld ctld_probe
}

node_state() { sinfo -h -n "$1" -o %T 2>/dev/null | head -1; }
# Ready = registered and responding: idle on a fresh start; busy states when `up` finds the
# cluster already running jobs. A trailing '*' (not responding), down or drain is not ready.
node_ready() { [[ $(node_state "$1") =~ ^(idle|mixed|allocated|completing)$ ]]; }

start_slurmd() {
    local i node state
    for i in "${!NODES[@]}"; do
        start_daemon "slurmd-${NODES[i]}" "${SLURMD_PORTS[i]}" slurmd -D -N "${NODES[i]}" -f "$CONF"
    done
    for node in "${NODES[@]}"; do
        # A node drained or down from an earlier run (e.g. a step that could not be killed)
        # is put back: this cluster's nodes are healthy by construction once slurmd answers.
        state=$(node_state "$node")
        if [[ $state == *drain* || $state == down* ]] && running_pid "slurmd-$node" >/dev/null; then
            scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
        fi
        wait_ready "slurmd-$node" node_ready "$node"
    done
}

# ---------------------------------------------------------------------------------------------
# Commands

DAEMONS=(munged mariadb slurmdbd slurmctld slurmd-node1 slurmd-node2)

cmd_up() {
    local t0=$SECONDS
    for tool in munged munge mariadbd mariadb-install-db mariadb-admin slurmdbd slurmctld slurmd sinfo; do
        command -v "$tool" >/dev/null || die "$tool not found: run scripts/setup.sh first"
    done
    local before
    before=$(cat "$CONF" "$DIR/etc/slurmdbd.conf" 2>/dev/null | cksum || true)  # none on a first start
    write_configs
    if running_pid slurmctld >/dev/null && [[ $(cat "$CONF" "$DIR/etc/slurmdbd.conf" | cksum) != "$before" ]]; then
        log "the configuration changed while the cluster runs: run '$0 down' and '$0 up' to apply it"
    fi
    export SLURM_CONF=$CONF
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmd
    log "up in $((SECONDS - t0)) s: $(sinfo -h -N -o '%N=%T' | tr '\n' ' ')"
    log "use it with: source $DIR/env"
}

# Step daemons (slurmstepd) outlive slurmd; they are ours when they carry our SLURM_CONF.
leftover_step_daemons() {
    local p
    for p in /proc/[0-9]*; do
        [[ $(cat "$p/comm" 2>/dev/null) == slurmstepd ]] || continue
        is_ours "${p#/proc/}" && echo "${p#/proc/}"
    done
    return 0
}

cmd_down() {
    export SLURM_CONF=$CONF
    local jobs pid
    if running_pid slurmctld >/dev/null; then
        jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
        if [[ -n ${jobs// /} ]]; then
            log "cancelling jobs: $jobs"
            # shellcheck disable=SC2086  # one argument per job id
            scancel $jobs 2>/dev/null || true
            # Up to KillWait (slurm.conf) for processes that handle the TERM: the training ranks save
            # a checkpoint first. Stopping slurmd sooner would leave them running without a job.
            local kill_wait
            kill_wait=$(sed -n 's/^KillWait=\([0-9]*\).*/\1/p' "$CONF" | tail -1)
            local left t0=$SECONDS report=$((SECONDS + 10))
            while ((SECONDS - t0 < ${kill_wait:-30} + 15)); do
                left=$(squeue -h -o '%A %T' 2>/dev/null | tr '\n' ' ')
                [[ -z ${left// /} ]] && break
                # Every 10 s, what is still there (a job stuck COMPLETING waits on a step daemon).
                if ((SECONDS >= report)); then
                    log "waiting for jobs to end ($((SECONDS - t0)) s): $left"
                    report=$((SECONDS + 10))
                fi
                sleep 0.5
            done
            [[ -z ${left// /} ]] || log "jobs still listed after $((SECONDS - t0)) s, stopping the daemons anyway: $left"
        fi
    fi
    # Slurm's daemons first (slurmdbd still needs MariaDB and munge to shut down cleanly).
    stop_daemons slurmd-node1 slurmd-node2 slurmctld slurmdbd
    stop_daemons mariadb munged
    for pid in $(leftover_step_daemons); do
        log "killing leftover slurmstepd (pid $pid)"
        kill -KILL "$pid" 2>/dev/null || true
    done
    log "down"
}

cmd_status() {
    local name pid all=0
    for name in "${DAEMONS[@]}"; do
        if pid=$(running_pid "$name"); then
            printf '%-14s running (pid %s)\n' "$name" "$pid"
        else
            printf '%-14s stopped\n' "$name"
            all=1
        fi
    done
    if running_pid slurmctld >/dev/null; then
        SLURM_CONF=$CONF sinfo -N -o '%N %P %T %c %m' || true
    fi
    return $all
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    plugstack)
        write_plugstack
        if [[ -f $DIR/etc/plugstack.conf ]]; then log "Pyxis registered: $DIR/etc/plugstack.conf"
        else log "no Pyxis at $PYXIS_PLUGIN: $DIR/etc/plugstack.conf removed"; fi ;;
    purge) cmd_down; rm -rf "$DIR"; log "removed $DIR" ;;
    *) echo "usage: $0 up|down|status|purge|plugstack   (cluster folder: $DIR)" >&2; exit 2 ;;
esac
