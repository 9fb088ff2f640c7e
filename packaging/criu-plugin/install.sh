#!/usr/bin/env bash
# packaging/criu-plugin/install.sh: build torpor's CRIU plugin and put it into CRIU's plugin
# directory, where every CRIU on this node loads it (any engine's: runc, crun, containerd,
# CRI-O, podman). Off by default: ./install.sh runs this only with TORPOR_INSTALL_CRIU_PLUGIN=1.
# See docs/criu-plugin.md. Also keeps CRIU's plugin header (include/criu-plugin.h, CRIU 4.2.1)
# under /usr/local/include/torpor/criu/ for anyone building against it.
#
#   install.sh [--uninstall]
# Environment: TORPOR_CRIU_PLUGIN_DIR (default /usr/lib/criu: CRIU's built-in default),
#              TORPOR_CRIU_HELPER (default /usr/local/bin/torpor-criu-helper),
#              TORPOR_INCLUDE_DIR (default /usr/local/include/torpor)
set -Eeuo pipefail
cd "$(dirname "$(readlink -f "$0")")"
DIR="${TORPOR_CRIU_PLUGIN_DIR:-/usr/lib/criu}"
HELPER="${TORPOR_CRIU_HELPER:-/usr/local/bin/torpor-criu-helper}"
INCLUDE="${TORPOR_INCLUDE_DIR:-/usr/local/include/torpor}"
say() { printf 'torpor: %s\n' "$*"; }
die() { printf 'torpor: error: %s\n' "$*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "run as root (CRIU's plugin directory is root's)"

if [[ ${1:-} == --uninstall ]]; then
    rm -f "$DIR/torpor_criu_plugin.so"
    say "removed $DIR/torpor_criu_plugin.so"
    exit 0
fi
[[ -z ${1:-} ]] || die "usage: $0 [--uninstall]"
[[ -x $HELPER ]] || die "$HELPER is missing: install torpor first (./install.sh)"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
make -s BUILD="$build" HELPER="$HELPER" >/dev/null
install -d -m 0755 "$DIR" "$INCLUDE/criu"
install -m 0644 include/criu-plugin.h "$INCLUDE/criu/criu-plugin.h"
install -m 0755 "$build/torpor_criu_plugin.so" "$DIR/.torpor_criu_plugin.so.new"
mv -f "$DIR/.torpor_criu_plugin.so.new" "$DIR/torpor_criu_plugin.so"   # CRIU never sees half
say "installed $DIR/torpor_criu_plugin.so (helper $HELPER); every CRIU on this node loads it"
