#!/usr/bin/env bash
# A real single-node SLURM (munge + slurmctld + slurmd from Debian's packages) for the tests of the SLURM path,
# with a fake `gres gpu:8` (device files are symlinks to /dev/null: Slurm binds and exports CUDA_VISIBLE_DEVICES,
# nothing opens a GPU). No accounting daemon: profiles must poll with `slurm-status-command: squeue`.
#   bash scripts/slurm.sh start SCRATCH_DIR    # install what is missing, start the daemons, wait for `idle`
#   bash scripts/slurm.sh stop SCRATCH_DIR     # stop them by PID file (never by process name)
# Needs root (apt-get, /etc/slurm). The config lives in SCRATCH_DIR/etc, linked from /etc/slurm, because the
# jobstep plugin strips SLURM_CONF from jobs.
set -euo pipefail
cmd=${1:?start|stop}
S=$(mkdir -p "${2:?scratch dir}" && cd "$2" && pwd)

stop_pid() {
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

if [ "$cmd" = stop ]; then
  stop_pid "$S/run/slurmd.pid"
  stop_pid "$S/run/slurmctld.pid"
  [ -f "$S/run/munged.started" ] && stop_pid /run/munge/munged.pid && rm -f "$S/run/munged.started"
  echo "slurm.sh: stopped"
  exit 0
fi
[ "$cmd" = start ] || { echo "usage: slurm.sh start|stop DIR" >&2; exit 2; }

missing=()
for pkg in slurmctld slurmd slurm-client munge; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

for f in "$S/run/slurmctld.pid" "$S/run/slurmd.pid"; do
  if [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; then echo "slurm.sh: already running ($f)" >&2; exit 1; fi
done
rm -rf "$S/state"
mkdir -p "$S/etc" "$S/state/ctld" "$S/state/d" "$S/log" "$S/run" "$S/dev"
for i in 0 1 2 3 4 5 6 7; do ln -sfn /dev/null "$S/dev/nvidia$i"; done
cpus=$(nproc)
mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 9 / 10)}' /proc/meminfo)
cat > "$S/etc/slurm.conf" <<CONF
ClusterName=draftpipe
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$S/state/ctld
SlurmdSpoolDir=$S/state/d
SlurmctldPidFile=$S/run/slurmctld.pid
SlurmdPidFile=$S/run/slurmd.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$S/log/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MinJobAge=3600
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
cat > "$S/etc/gres.conf" <<CONF
AutoDetect=off
NodeName=localhost Name=gpu File=$S/dev/nvidia[0-7]
CONF
mkdir -p /etc/slurm
ln -sfn "$S/etc/slurm.conf" /etc/slurm/slurm.conf
ln -sfn "$S/etc/gres.conf" /etc/slurm/gres.conf
unset SLURM_CONF

if ! munge -n >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  touch "$S/run/munged.started"
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
fi
/usr/sbin/slurmctld
/usr/sbin/slurmd -N localhost
for _ in $(seq 150); do
  state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
  if [ "$state" = idle ]; then echo "slurm.sh: localhost idle, gres gpu:8, $cpus CPUs, ${mem_mb} MB"; exit 0; fi
  sleep 0.2
done
echo "slurm.sh: node did not become idle (state '$state')" >&2
scontrol show node localhost >&2 || true
tail -n 20 "$S/log/slurmctld.log" "$S/log/slurmd.log" >&2 || true
exit 1
