#!/usr/bin/env bash
# install-containerd2.sh: containerd 2.x with its CRI plugin, side by side with the
# distribution's containerd 1.6 (which the `ctr` tests and ./install.sh's snippet keep using).
#
#   1. containerd >= 2.1 from Debian unstable (Debian 12 has 1.6; unstable's .deb needs only
#      libc >= 2.34 and runc), fetched through a private apt configuration (the system's apt
#      sources and package state are not touched; apt checks the .deb against the signed
#      index), unpacked into $PREFIX (default /opt/torpor/containerd2): bin/containerd,
#      bin/containerd-shim-runc-v2, bin/ctr. Nothing goes on PATH.
#   2. the CRI api.proto (runtime.v1) from unstable's golang-k8s-cri-api-dev, kept as
#      $PREFIX/share/cri-api/api.proto: test.sh generates the tests' CRI client from it.
#   3. images nothing here can pull, built locally as OCI archives in $PREFIX/share/images:
#      torpor-pause.tar (localhost/torpor-pause:1, pause.c built with gcc -static: the
#      sandbox image) and torpor-busybox.tar (localhost/torpor-busybox:1, Debian's static
#      busybox: the tests' base image).
#   4. /etc/torpor/containerd2/config.toml (kept if present) from containerd2.toml: root
#      /var/lib/torpor-containerd2, state /run/torpor-containerd2, socket
#      /run/torpor-containerd2/containerd.sock, runtime handlers runc and torpor; and the
#      systemd unit torpor-containerd2.service (not started; it imports the pause image).
#
# Safe to run again: what is installed at the wanted version is kept. Needs root.
# Environment: TORPOR_CONTAINERD2 (prefix), TORPOR_CONTAINERD2_SUITE (default unstable),
# TORPOR_CONTAINERD2_MIRROR (default: the system's Debian mirror, else deb.debian.org),
# TORPOR_RUNTIME (the torpor handler's BinaryName, default /usr/local/bin/torpor-runtime).
set -Eeuo pipefail

readonly MIN_VERSION=2.1
PREFIX="${TORPOR_CONTAINERD2:-/opt/torpor/containerd2}"
SUITE="${TORPOR_CONTAINERD2_SUITE:-unstable}"
TORPOR_RUNTIME="${TORPOR_RUNTIME:-/usr/local/bin/torpor-runtime}"
CONFIG_DIR=/etc/torpor/containerd2
HERE="$(cd "$(dirname "$(readlink -f "$0")")" && pwd)"
WORK=/var/cache/torpor/containerd2

say() { printf 'torpor: containerd2: %s\n' "$*"; }
die() { printf 'torpor: containerd2: error: %s\n' "$*" >&2; exit 1; }
trap 'die "failed at line $LINENO: $BASH_COMMAND"' ERR

[[ $(id -u) -eq 0 ]] || die "needs root"
command -v dpkg-deb >/dev/null || die "needs dpkg-deb (Debian or Ubuntu)"
mkdir -p "$WORK"
exec 9>"$WORK/.lock"
flock 9

installed_version() {   # "2.1.9" of $PREFIX/bin/containerd, empty if none
    [[ -x "$PREFIX/bin/containerd" ]] || return 0
    "$PREFIX/bin/containerd" --version 2>/dev/null | awk '{print $3}' | sed 's/[+~].*//'
}

mirror() {
    local uri
    [[ -n "${TORPOR_CONTAINERD2_MIRROR:-}" ]] && { echo "$TORPOR_CONTAINERD2_MIRROR"; return; }
    uri="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
           awk 'tolower($1) == "uris:" && $2 ~ /^https?:\/\// && $2 ~ /\/debian\/?$/ { print $2; exit }')"
    [[ -n "$uri" ]] || uri="$(cat /etc/apt/sources.list 2>/dev/null |
           awk '$1 == "deb" && $2 ~ /^https?:\/\// && $2 ~ /\/debian\/?$/ && $3 !~ /security/ { print $2; exit }')"
    uri="${uri%/}"
    echo "${uri:-http://deb.debian.org/debian}"
}

# fetch PKG...: download PKGs of $SUITE into $WORK/get (apt verifies them against the signed
# index), with a private apt configuration: own source list, lists, no package state.
fetch() {
    local keyring=/usr/share/keyrings/debian-archive-keyring.gpg apt="$WORK/apt"
    [[ -f "$keyring" ]] || die "no $keyring (apt-get install debian-archive-keyring)"
    rm -rf "$apt" "$WORK/get"
    mkdir -p "$apt/lists/partial" "$WORK/get"
    printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
        "$(mirror)" "$SUITE" "$keyring" >"$apt/debian.sources"
    local o=(-o "Dir::Etc::SourceList=$apt/debian.sources" -o "Dir::Etc::SourceParts=/dev/null"
             -o "Dir::State::Lists=$apt/lists" -o "Dir::State::status=/dev/null"
             -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
             -o "APT::Sandbox::User=root" -o "Acquire::Languages=none")
    say "fetching the index of Debian ${SUITE} from $(mirror) (private apt config)"
    apt-get "${o[@]}" -qq update >"$WORK/apt.log" 2>&1 || { cat "$WORK/apt.log" >&2; die "apt-get update of ${SUITE} failed"; }
    (cd "$WORK/get" && apt-get "${o[@]}" -qq download "$@") >>"$WORK/apt.log" 2>&1 ||
        { tail -n 20 "$WORK/apt.log" >&2; die "downloading $* from ${SUITE} failed"; }
}

# --- 1 and 2: containerd 2 and the CRI api.proto --------------------------------------------
have="$(installed_version)"
if [[ -n "$have" ]] && dpkg --compare-versions "$have" ge "$MIN_VERSION" &&
   [[ -f "$PREFIX/share/cri-api/api.proto" ]]; then
    say "containerd $have already in $PREFIX"
else
    fetch containerd golang-k8s-cri-api-dev
    deb="$(ls "$WORK"/get/containerd_*.deb)"
    ver="$(dpkg-deb -f "$deb" Version)"
    dpkg --compare-versions "${ver#*:}" ge "$MIN_VERSION" ||
        die "Debian ${SUITE} has containerd ${ver}, older than ${MIN_VERSION}"
    rm -rf "$WORK/x"; mkdir -p "$WORK/x"
    dpkg-deb -x "$deb" "$WORK/x"
    dpkg-deb -x "$(ls "$WORK"/get/golang-k8s-cri-api-dev_*.deb)" "$WORK/x"
    "$WORK/x/usr/bin/containerd" --version >/dev/null ||
        die "containerd ${ver} from ${SUITE} does not run here (libc >= 2.34 needed)"
    install -d -m 0755 "$PREFIX/bin" "$PREFIX/share/cri-api" "$PREFIX/share/doc"
    for b in containerd containerd-shim-runc-v2 ctr; do
        install -m 0755 "$WORK/x/usr/bin/$b" "$PREFIX/bin/$b.new"
        mv -f "$PREFIX/bin/$b.new" "$PREFIX/bin/$b"
    done
    install -m 0644 "$WORK/x/usr/share/gocode/src/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto" \
        "$PREFIX/share/cri-api/api.proto"
    install -m 0644 "$WORK/x/usr/share/doc/containerd/copyright" "$PREFIX/share/doc/containerd.copyright"
    rm -rf "$WORK/x" "$WORK/get"
    say "installed containerd ${ver} from Debian ${SUITE} into $PREFIX"
fi

# --- 3: the local images ----------------------------------------------------------------------
images="$PREFIX/share/images"
install -d -m 0755 "$images"
gcc -static -Os -Wall -o "$WORK/torpor-pause" "$HERE/pause.c" ||
    die "building the static pause program failed (needs libc6-dev's libc.a)"
strip "$WORK/torpor-pause" 2>/dev/null || true
python3 "$HERE/oci_image.py" pause "$WORK/torpor-pause" "$images/torpor-pause.tar" >/dev/null
busybox=""
if [[ -x /bin/busybox ]] && LC_ALL=C ldd /bin/busybox 2>&1 | grep -q 'not a dynamic'; then
    busybox=/bin/busybox   # busybox-static is installed
fi
if [[ -z "$busybox" ]]; then
    # the image has no libc: a static busybox, from busybox-static's .deb (the package itself
    # conflicts with busybox, which the system may need; nothing is installed)
    rm -rf "$WORK/bb"; mkdir -p "$WORK/bb"
    (cd "$WORK/bb" && apt-get -qq download busybox-static >/dev/null 2>&1) ||
        { apt-get update -qq && (cd "$WORK/bb" && apt-get -qq download busybox-static); }
    dpkg-deb -x "$WORK"/bb/busybox-static_*.deb "$WORK/bb/x"
    busybox="$WORK/bb/x/bin/busybox"
fi
python3 "$HERE/oci_image.py" busybox "$busybox" "$images/torpor-busybox.tar" >/dev/null
rm -rf "$WORK/bb" "$WORK/torpor-pause"
say "images in $images: localhost/torpor-pause:1 (sandbox), localhost/torpor-busybox:1"

# --- 4: config and unit -----------------------------------------------------------------------
install -d -m 0755 "$CONFIG_DIR" "$CONFIG_DIR/certs.d"
if [[ ! -e "$CONFIG_DIR/config.toml" ]]; then
    sed -e "s#@ROOT@#/var/lib/torpor-containerd2#g" -e "s#@STATE@#/run/torpor-containerd2#g" \
        -e "s#@PREFIX@#$PREFIX#g" -e "s#@CONFIG_DIR@#$CONFIG_DIR#g" \
        -e "s#@TORPOR_RUNTIME@#$TORPOR_RUNTIME#g" "$HERE/containerd2.toml" >"$CONFIG_DIR/config.toml"
    "$PREFIX/bin/containerd" --config "$CONFIG_DIR/config.toml" config dump >/dev/null ||
        die "containerd rejects $CONFIG_DIR/config.toml"
fi
if [[ -d /etc/systemd/system ]]; then
    sed -e "s#@PREFIX@#$PREFIX#g" -e "s#@CONFIG_DIR@#$CONFIG_DIR#g" \
        "$HERE/torpor-containerd2.service" >/etc/systemd/system/torpor-containerd2.service
    if [[ -d /run/systemd/system ]]; then systemctl daemon-reload || true; fi
fi
say "config $CONFIG_DIR/config.toml; start it with: systemctl start torpor-containerd2"
say "(CRI socket /run/torpor-containerd2/containerd.sock; runtime handlers: runc, torpor)"
