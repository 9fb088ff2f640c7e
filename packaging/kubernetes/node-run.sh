#!/usr/bin/env bash
# node-run.sh: the DaemonSet's main container. Runs the bundle's torpord in the node's
# namespaces (nsenter: it must see the node's processes, GPUs and paths as runc does), labels
# the node torpor.dev/runtime=ready while torpord answers, and on SIGTERM takes the label off
# first (no new torpor pods land here), then stops torpord (which rolls back what is open:
# programs run again) and exits with torpord's status. The bundle and the runtime handler
# stay: containers started through it still need torpor-runtime (node-install.sh uninstall
# removes them after a drain).
set -uo pipefail
NODE_DIR="${NODE_DIR:-/opt/torpor/node}"
SOCKET="${SOCKET:-/host/run/torpor/torpord.sock}"
label() { python3 /opt/torpor/k8s/label-node.py "$1" || echo "torpor-node: could not set the node label ($1)" >&2; }

nsenter --target 1 --mount --uts --ipc --net --pid -- "$NODE_DIR/bin/torpord" --foreground &
pid=$!
stop() {
    label remove
    kill -TERM "$pid" 2>/dev/null
    wait "$pid"; rc=$?
    exit "$rc"
}
trap stop TERM INT
for _ in $(seq 1 300); do
    [[ -S $SOCKET ]] && { label set; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
done
wait "$pid"; rc=$?
label remove
exit "$rc"
