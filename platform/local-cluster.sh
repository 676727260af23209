#!/usr/bin/env bash
# A multi-node Ray cluster on one machine, every server on 127.0.0.1: a head node and worker
# nodes, each its own raylet started with `ray start`. For trying asyncrl's cluster path
# (`--ray-address`, placement, parallel candidates, a node failure) before a real cluster;
# tests/cluster/test_ray_cluster.py runs every command of platform/README.md's walk-through
# through this script.
#
#   platform/local-cluster.sh start DIR [HEAD_CPUS] [WORKER ...]   # WORKER = CPUS:RESOURCES_JSON
#   source DIR/env                                                 # RAY_ADDRESS + the token
#   platform/local-cluster.sh stop DIR
#
# Default workers: '2:{"worker": 2, "train_node": 1, "rollout_node": 1}' and
# '2:{"worker": 2, "rollout_node": 1}'.
#
# DIR receives: env (RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH to export, and
# RAY_DASHBOARD: the head's dashboard and state API, on 127.0.0.1), token (the
# cluster's auth token, mode 600), pids (one `ray start --block` PID per node: head first),
# logs/ (each node's `ray start` output) and raytmp (the path of Ray's session directory, a
# short one under /tmp, removed by `stop`).
#
# Why it looks the way it does (Ray 2.60, measured):
# - A node listens on 127.0.0.1 only when its node address is exactly 127.0.0.1; with any other
#   address its gRPC servers listen on every interface. The head gets it with
#   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray's one-machine mode, which keeps 127.0.0.1).
# - Workers need that switch at 1 (`ray start --address` refuses to add a node otherwise), and
#   with it Ray rewrites the literal 127.0.0.1 (and localhost) in --address into the machine's
#   network address. So workers and drivers join through another name of 127.0.0.1: this
#   machine's host name, or another /etc/hosts alias of 127.0.0.1; their node address is then
#   127.0.0.1 too and they listen on loopback only.
# - Ray 2.60 turns on token authentication for a new cluster; the token is this cluster's own
#   (DIR/token), not ~/.ray/auth_token, and every node and driver reads it from
#   RAY_AUTH_TOKEN_PATH.
# - `ray start --block` stays in the foreground as the parent of its node's processes and stops
#   them when it gets SIGTERM, so `stop` ends each node by the PID recorded here (never
#   `ray stop`, which would stop every Ray on the machine).
set -euo pipefail

RAY=${RAY:-ray}
PYTHON=${PYTHON:-python3}

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

loopback_name() {  # a name of 127.0.0.1 other than the ones Ray rewrites
  local host
  host=$(hostname)
  if [ "$(getent ahostsv4 "$host" 2>/dev/null | awk 'NR==1 {print $1}')" = "127.0.0.1" ]; then
    echo "$host"
    return
  fi
  awk '$1 == "127.0.0.1" {for (i = 2; i <= NF; i++) if ($i != "localhost") {print $i; exit}}' \
    /etc/hosts
}

wait_nodes() {  # until the cluster has $1 live nodes (90 s)
  if ! "$PYTHON" - "$1" <<'EOF' 2>>"$DIR/logs/wait.log"; then
import os, sys, time
import ray
want, deadline = int(sys.argv[1]), time.monotonic() + 90
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
while sum(1 for n in ray.nodes() if n["Alive"]) < want:
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.5)
EOF
    echo "local-cluster: fewer than $1 nodes came up in 90 s; see $DIR/logs" >&2
    stop "$DIR"
    exit 1
  fi
}

node_ports() {  # every port a node listens on, each a free one (several nodes share 127.0.0.1)
  echo "--node-manager-port=$(free_port) --object-manager-port=$(free_port)" \
       "--dashboard-agent-listen-port=$(free_port) --dashboard-agent-grpc-port=$(free_port)" \
       "--metrics-export-port=$(free_port) --runtime-env-agent-port=$(free_port)"
}

start() {
  DIR=$(mkdir -p "$1" && cd "$1" && pwd)
  shift
  local head_cpus=${1:-1}
  [ $# -gt 0 ] && shift
  local workers=("$@")
  [ ${#workers[@]} -gt 0 ] || workers=('2:{"worker": 2, "train_node": 1, "rollout_node": 1}' '2:{"worker": 2, "rollout_node": 1}')
  if [ -s "$DIR/pids" ]; then
    echo "local-cluster: $DIR already holds a cluster (stop it first: $0 stop $DIR)" >&2
    exit 1
  fi
  local name
  name=$(loopback_name)
  if [ -z "$name" ]; then
    echo "local-cluster: no name of 127.0.0.1 but localhost on this machine; add one to" \
         "/etc/hosts (e.g. '127.0.0.1 $(hostname)')" >&2
    exit 1
  fi
  mkdir -p "$DIR/logs"
  # Ray's session directory holds Unix sockets, whose paths must stay under 108 bytes
  mktemp -d /tmp/asyncrl-ray-XXXXXX > "$DIR/raytmp"
  (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$DIR/token")
  local gcs dash
  gcs=$(free_port)
  dash=$(free_port)
  export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$DIR/token"
  cat > "$DIR/env" <<EOF
export RAY_ADDRESS=$name:$gcs
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$DIR/token
export RAY_DASHBOARD=http://127.0.0.1:$dash
EOF
  : > "$DIR/pids"
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 "$RAY" start --head --block --node-ip-address=127.0.0.1 \
    --port="$gcs" --num-cpus="$head_cpus" --dashboard-host=127.0.0.1 --dashboard-port="$dash" \
    --ray-client-server-port="$(free_port)" $(node_ports) \
    --temp-dir="$(cat "$DIR/raytmp")" > "$DIR/logs/head.log" 2>&1 &
  echo $! >> "$DIR/pids"
  export RAY_ADDRESS=$name:$gcs
  wait_nodes 1
  local i=0 spec
  for spec in "${workers[@]}"; do
    i=$((i + 1))
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 "$RAY" start --block --address="$name:$gcs" \
      --num-cpus="${spec%%:*}" --resources="${spec#*:}" $(node_ports) \
      > "$DIR/logs/worker-$i.log" 2>&1 &
    echo $! >> "$DIR/pids"
    wait_nodes $((i + 1))  # one at a time: nodes starting together may race for a port
  done
  echo "local-cluster: head + $i workers up at $name:$gcs (source $DIR/env)"
}

stop() {
  DIR=$1
  [ -s "$DIR/pids" ] || { echo "local-cluster: no cluster in $DIR"; return 0; }
  local pid
  # workers first, then the head: each `ray start --block` stops its own node on SIGTERM
  for pid in $(tac "$DIR/pids"); do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq 1 60); do
    local left=0
    for pid in $(cat "$DIR/pids"); do kill -0 "$pid" 2>/dev/null && left=1; done
    [ $left = 0 ] && break
    sleep 0.5
  done
  for pid in $(cat "$DIR/pids"); do kill -KILL "$pid" 2>/dev/null || true; done
  : > "$DIR/pids"
  if [ -s "$DIR/raytmp" ]; then
    rm -rf "$(cat "$DIR/raytmp")"
    : > "$DIR/raytmp"
  fi
  echo "local-cluster: stopped"
}

case "${1:-}" in
  start) shift; [ $# -ge 1 ] || { echo "usage: $0 start DIR [HEAD_CPUS] [WORKER ...]" >&2; exit 2; }
         start "$@" ;;
  stop) [ $# -eq 2 ] || { echo "usage: $0 stop DIR" >&2; exit 2; }
        stop "$2" ;;
  *) echo "usage: $0 start DIR [HEAD_CPUS] [CPUS:RESOURCES_JSON ...] | $0 stop DIR" >&2; exit 2 ;;
esac
