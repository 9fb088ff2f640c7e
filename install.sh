#!/usr/bin/env bash
# ./install.sh: set torpor up on a Debian or Ubuntu machine, as root.
#
#   1. system packages: python3 + venv, a C compiler and xxHash's header (the agent; the test
#      suite builds its fakes)
#   2. CRIU >= 4.2 (packaging/criu/install-criu.sh: the distribution's, or built from Debian's
#      source package, unstable first; >= 4 with a warning where 4.2 cannot be had) and pycriu
#   3. torpor itself in a virtual environment ($TORPOR_PREFIX, default /opt/torpor/venv),
#      its commands linked into /usr/local/bin (torpor-runtime is the native front that
#      `pip install .` builds from shim/front; it execs runc, or torpor-runtime-py beside it)
#   4. /etc/torpor/config.toml (kept if present), the torpord systemd unit (not started),
#      podman's runtime "torpor" (containers.conf.d), containerd's snippet (/etc/containerd)
#   5. the container engines torpor is tested with: podman, containerd, runc, and iptables
#      (CRIU locks a container's network with iptables-restore); TORPOR_ENGINES=0 leaves them
#      out (the Kubernetes node image: the node brings its own containerd and runc)
#   6. containerd 2.x with its CRI plugin beside the distribution's 1.6, torpor as its runtime
#      handler (packaging/containerd/install-containerd2.sh: from Debian unstable, into
#      /opt/torpor/containerd2; TORPOR_NO_CONTAINERD2=1 skips it)
#   7. optional, TORPOR_INSTALL_CRIU_PLUGIN=1: torpor's CRIU plugin into /usr/lib/criu
#      (packaging/criu-plugin/install.sh, docs/criu-plugin.md)
# Safe to run again. Needs only the distribution's package mirror and PyPI.
set -Eeuo pipefail

cd "$(dirname "$(readlink -f "$0")")"
PREFIX="${TORPOR_PREFIX:-/opt/torpor/venv}"
say() { printf 'torpor: %s\n' "$*"; }
die() { printf 'torpor: error: %s\n' "$*" >&2; exit 1; }
trap 'die "install failed at line $LINENO (see the output above)"' ERR

[[ $(id -u) -eq 0 ]] || die "run ./install.sh as root (CRIU and the driver checkpoint API need root)"
command -v apt-get >/dev/null || die "this installer knows Debian and Ubuntu (apt-get) only"

export DEBIAN_FRONTEND=noninteractive
missing=()
# libc6-dev: libc.a for the static pause program of containerd 2's sandbox image
for pkg in python3 python3-venv python3-dev gcc make procps libxxhash-dev libc6-dev; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [[ ! -x "$PREFIX/bin/python" ]]; then
    say "creating the virtual environment $PREFIX"
    /usr/bin/python3 -m venv "$PREFIX"
fi
say "installing torpor and its Python dependencies into $PREFIX"
"$PREFIX/bin/python" -m pip install -q --upgrade pip >/dev/null
# grpcio-tools: generates pycriu's protobuf modules so they match this venv's protobuf.
"$PREFIX/bin/python" -m pip install -q grpcio-tools
"$PREFIX/bin/python" -m pip install -q --force-reinstall --no-deps . >/dev/null
"$PREFIX/bin/python" -m pip install -q .

site=$("$PREFIX/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
bash packaging/criu/install-criu.sh --pycriu-into "$site" --python "$PREFIX/bin/python"

# Container engines (tests/integration/test_containers_*.py, integration/containers.py), and
# iptables: runc has CRIU lock a container's network namespace, by default with
# iptables-restore, which none of them depends on (network-lock nftables in
# /etc/criu/runc.conf instead crashes CRIU 4.1.1's RPC mode: see integration/README.md).
# --no-install-recommends: runc recommends the distribution's criu, older than CRIU 4 on
# Debian 12 (a second criu on PATH), and podman recommends buildah, slirp4netns, ... (unused).
missing=()
# docker-registry, apache2-utils (htpasswd), openssl: tests/integration/test_registry.py runs a
# real registry with TLS and htpasswd auth, as a user would (docs/registries.md).
[[ ${TORPOR_ENGINES:-1} == 0 ]] ||
    for pkg in podman containerd runc iptables docker-registry apache2-utils openssl; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# checkpointctl (optional: tests/integration/test_registry.py has it read a pulled checkpoint
# image): Debian 12 has none; built from Debian's source (docs/registries.md).
if [[ ${TORPOR_ENGINES:-1} != 0 ]] && ! command -v checkpointctl >/dev/null; then
    say "building checkpointctl from Debian's source (optional)"
    bash packaging/checkpointctl/build.sh /usr/local/bin/checkpointctl >/dev/null 2>&1 \
        || say "checkpointctl was not built (optional; its test part is skipped)"
fi

for cmd in torpor torpord torpor-runtime torpor-runtime-py torpor-hook torpor-criu-helper; do
    ln -sf "$PREFIX/bin/$cmd" "/usr/local/bin/$cmd"
done
# torpor's CRIU plugin (docs/criu-plugin.md): GPU checkpoints through any engine's own CRIU,
# for nodes that cannot use torpor-runtime. Off by default: every CRIU on the node loads it.
if [[ ${TORPOR_INSTALL_CRIU_PLUGIN:-0} == 1 ]]; then
    bash packaging/criu-plugin/install.sh
fi
# podman learns the runtime "torpor" (podman --runtime torpor, or runtime = "torpor" in that
# file makes it the default); containerd's snippet is copied for the operator to import.
install -d -m 0755 /etc/containers/containers.conf.d
install -m 0644 packaging/podman/torpor.conf /etc/containers/containers.conf.d/torpor.conf
if [[ -d /etc/containerd ]]; then
    install -m 0644 packaging/containerd/torpor.toml /etc/containerd/torpor.toml
fi
install -d -m 0755 /etc/torpor
[[ -e /etc/torpor/config.toml ]] || install -m 0644 packaging/config.toml /etc/torpor/config.toml
install -d -m 0700 /var/lib/torpor
if [[ -d /etc/systemd/system ]]; then
    install -m 0644 packaging/systemd/torpord.service /etc/systemd/system/torpord.service
    if [[ -d /run/systemd/system ]]; then systemctl daemon-reload || true; fi
fi
# a torpord already running runs the version this replaced, and the two sides must agree (its
# records and agent directories are named <id>@<root key>, its fingerprint owners too): under
# systemd it is restarted (an operation in flight is rolled back, the program runs on);
# started otherwise, the operator is told
if [[ -d /run/systemd/system ]] && systemctl is-active --quiet torpord 2>/dev/null; then
    if systemctl try-restart torpord; then say "torpord restarted: it runs this version now"
    else say "warning: torpord could not be restarted: 'systemctl restart torpord'"; fi
elif pids=$(pgrep -x torpord 2>/dev/null | tr '\n' ' ') && [[ -n $pids ]]; then
    say "warning: torpord (pid ${pids% }) runs the version this replaced: restart it"
fi

if [[ "${TORPOR_NO_CONTAINERD2:-0}" != 1 && ${TORPOR_ENGINES:-1} != 0 ]]; then
    bash packaging/containerd/install-containerd2.sh
fi

say "installed: $(/usr/local/bin/torpor --version), CRIU $(/usr/local/sbin/criu --version 2>/dev/null | sed -n 's/^Version: //p' || criu --version | sed -n 's/^Version: //p')"
say "next: 'torpor doctor' checks the machine, 'torpor demo' runs the demo"
