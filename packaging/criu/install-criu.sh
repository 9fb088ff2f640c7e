#!/usr/bin/env bash
# install-criu.sh: make sure CRIU >= 4 is installed (and optionally CRIU's
# pycriu Python package in a given site-packages directory).
#
# Used by torpor's ./install.sh and by CI. Safe to run again: when CRIU >= 4
# is already there it only says so (and refreshes pycriu if asked to).
#
#   1. criu >= 4 at /usr/local/sbin/criu or on PATH  -> nothing to do
#   2. the distribution's candidate `criu` is >= 4     -> apt-get install criu
#   3. otherwise: build CRIU from Debian's source package of trixie (the
#      upstream tarball, checked against Debian's signed Sources index),
#      fetched through a private apt configuration (the system's apt sources
#      are not touched), build dependencies from the machine's own packages,
#      binary installed to /usr/local/sbin/criu.
#
# See packaging/criu/README.md. CRIU is GPL-2.0 and is used as a separate
# program; nothing of it is linked into torpor.

set -Eeuo pipefail

readonly PROG="torpor"
# The oldest CRIU this installer is content with: 4.1 cannot dump any TCP socket on kernels
# >= 6.16 (SO_PASSCRED/SO_PASSSEC only for Unix and netlink sockets: "Can't get 1:34 opt"),
# 4.2 handles them. torpor itself runs with any CRIU >= 4.0 (criu.MIN_VERSION).
readonly WANT_VERSION=4.2
readonly INSTALL_PATH=/usr/local/sbin/criu
readonly DEFAULT_WORK=/var/cache/torpor/criu-build

# Overridable from the environment (mostly for testing).
SRC_SUITE="${TORPOR_CRIU_SRC_SUITE:-unstable}"   # the suite with CRIU >= WANT_VERSION
SRC_MIRROR="${TORPOR_CRIU_SRC_MIRROR:-}"      # empty: derive from the system's sources

usage() {
    cat <<EOF
Usage: $0 [options]

Ensure CRIU >= ${WANT_VERSION} is installed (apt if the distribution has it, else
built from Debian's ${SRC_SUITE} source package into ${INSTALL_PATH}).

Options:
  --pycriu-into DIR   also install CRIU's pycriu package into DIR (a Python
                      site-packages directory, e.g. a venv's); its protobuf
                      modules are generated with PY -m grpc_tools.protoc so they
                      match PY's protobuf runtime
  --python PY         the Python that will import pycriu (needs grpcio-tools and
                      protobuf); default: python3
  --selftest          after installing, run 'criu check' and dump/restore a
                      trivial process tree (and read its image with pycriu if
                      --pycriu-into/--python was given)
  --force             rebuild/reinstall even if a suitable CRIU is present
  --work-dir DIR      build/cache directory (default: ${DEFAULT_WORK})
  -h, --help          this help

Environment: TORPOR_CRIU_SRC_SUITE (default unstable; trixie has 4.1),
             TORPOR_CRIU_SRC_MIRROR (default: the system's Debian mirror,
             else http://deb.debian.org/debian)
EOF
}

say()  { printf '%s: %s\n' "$PROG" "$*"; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }
die()  { printf '%s: ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }
on_err() {
    local rc=$? line=$1 cmd=$2
    printf '%s: ERROR: unexpected failure (exit %s) at line %s: %s\n' "$PROG" "$rc" "$line" "$cmd" >&2
    exit "$rc"
}
trap 'on_err "$LINENO" "$BASH_COMMAND"' ERR

# Things to undo on exit (temp dirs, the self-test's process).
CLEANUP_DIRS=()
CLEANUP_PIDS=()
cleanup() {
    local p d
    for p in "${CLEANUP_PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    for d in "${CLEANUP_DIRS[@]}"; do rm -rf "$d"; done
}
trap cleanup EXIT

# ---------------------------------------------------------------- arguments
PYCRIU_INTO=""
PY=""
SELFTEST=0
FORCE=0
WORK=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --pycriu-into) [[ $# -ge 2 ]] || die "--pycriu-into needs a directory"; PYCRIU_INTO="$2"; shift 2 ;;
        --pycriu-into=*) PYCRIU_INTO="${1#*=}"; shift ;;
        --python) [[ $# -ge 2 ]] || die "--python needs an interpreter"; PY="$2"; shift 2 ;;
        --python=*) PY="${1#*=}"; shift ;;
        --selftest) SELFTEST=1; shift ;;
        --force) FORCE=1; shift ;;
        --work-dir) [[ $# -ge 2 ]] || die "--work-dir needs a directory"; WORK="$2"; shift 2 ;;
        --work-dir=*) WORK="${1#*=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done
if [[ -n "$PYCRIU_INTO" && -z "$PY" ]]; then PY=python3; fi

IS_ROOT=0; [[ $(id -u) -eq 0 ]] && IS_ROOT=1
export DEBIAN_FRONTEND=noninteractive

if [[ -z "$WORK" ]]; then
    if [[ $IS_ROOT -eq 1 ]]; then WORK="$DEFAULT_WORK"
    else WORK="${XDG_CACHE_HOME:-$HOME/.cache}/torpor/criu-build"; fi
fi
LOG="$WORK/build.log"

# -------------------------------------------------------------------- utils
need_root() { [[ $IS_ROOT -eq 1 ]] || die "$1 needs root (run with sudo)"; }

work_init() {   # create the work dir and take its lock (once)
    [[ -n "${WORK_LOCKED:-}" ]] && return 0
    mkdir -p "$WORK" || die "cannot create work directory $WORK"
    exec 9>"$WORK/.lock"
    if ! flock -n 9; then
        say "waiting for another install-criu.sh run (lock $WORK/.lock)..."
        flock 9
    fi
    WORK_LOCKED=1
}

# run_logged "what" cmd...: output to $LOG; on failure print its tail and die
run_logged() {
    local what="$1"; shift
    local start
    printf '\n===== %s: %s\n$ %s\n' "$(date -Is)" "$what" "$*" >>"$LOG"
    start=$(stat -c %s "$LOG")
    if ! "$@" >>"$LOG" 2>&1; then
        printf -- '----- last lines of %s -----\n' "$LOG" >&2
        tail -c +"$((start + 1))" "$LOG" | tail -n 40 >&2 || true
        printf -- '-----\n' >&2
        die "$what failed (full log: $LOG)"
    fi
}

# version of a criu binary ("4.1.1"), empty if it does not run
criu_version() {
    "$1" --version 2>/dev/null | awk '/^Version:/ {print $2; exit}'
}

version_ok() {  # version_ok 4.1.1 -> true if >= WANT_VERSION
    [[ -n "$1" ]] && dpkg --compare-versions "$1" ge "${WANT_VERSION}"
}

# Find a criu >= WANT_VERSION: sets CRIU_BIN / CRIU_VER. Returns 1 if none.
CRIU_BIN=""; CRIU_VER=""
find_criu() {
    local c v seen=" "
    CRIU_BIN=""; CRIU_VER=""
    for c in "$INSTALL_PATH" "$(command -v criu 2>/dev/null || true)" /usr/sbin/criu /sbin/criu /usr/bin/criu; do
        [[ -n "$c" && -x "$c" ]] || continue
        c="$(readlink -f "$c")"
        [[ "$seen" == *" $c "* ]] && continue
        seen+="$c "
        v="$(criu_version "$c")"
        if version_ok "$v"; then CRIU_BIN="$c"; CRIU_VER="$v"; return 0; fi
        [[ -n "$v" ]] && say "found $c, but it is CRIU $v (need >= ${WANT_VERSION})"
    done
    return 1
}

APT_UPDATED=0
apt_update_once() {
    [[ $APT_UPDATED -eq 1 ]] && return 0
    # Skip when the package lists are fresh (< 6 hours), which keeps CI fast.
    if [[ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mmin -360 2>/dev/null | head -n1)" ]]; then
        say "apt-get update..."
        run_logged "apt-get update" apt-get update
    fi
    APT_UPDATED=1
}

apt_candidate() {   # candidate version of a package, empty if none
    apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2; exit}' | sed 's/^(none)$//'
}

# ------------------------------------------------- Debian source of CRIU
# The system's Debian mirror (so deb-src uses the same place as everything
# else), or deb.debian.org. Only for Debian; Ubuntu mirrors have no trixie.
debian_mirror() {
    local uri=""
    if [[ -n "$SRC_MIRROR" ]]; then echo "$SRC_MIRROR"; return; fi
    if grep -qs '^ID=debian' /etc/os-release; then
        local f
        for f in /etc/apt/sources.list.d/*.sources; do
            [[ -f "$f" ]] || continue
            uri="$(awk '
                function flush() {
                    if (types ~ /(^| )deb( |$)/ && enabled !~ /^[Nn]o/ && suites !~ /security/ &&
                        uri ~ /^https?:\/\// && uri !~ /security/ && uri ~ /\/debian\/?$/ && out == "")
                        out = uri
                    types = ""; uri = ""; suites = ""; enabled = ""
                }
                /^[ \t]*#/ { next }
                /^[ \t]*$/ { flush(); next }
                tolower($1) == "types:"   { $1 = ""; types = $0 }
                tolower($1) == "uris:"    { uri = $2 }
                tolower($1) == "suites:"  { $1 = ""; suites = $0 }
                tolower($1) == "enabled:" { enabled = $2 }
                END { flush(); print out }' "$f")"
            [[ -n "$uri" ]] && break
        done
        if [[ -z "$uri" ]]; then
            uri="$( { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } |
                awk '$1 == "deb" {
                        i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                        if ($i ~ /^https?:\/\// && $i !~ /security/ && $i ~ /\/debian\/?$/ && $(i+1) !~ /security/) { print $i; exit }
                     }')"
        fi
    fi
    uri="${uri%/}"
    echo "${uri:-http://deb.debian.org/debian}"
}

debian_keyring() {
    local k
    for k in /usr/share/keyrings/debian-archive-keyring.gpg /usr/share/keyrings/debian-archive-keyring.pgp; do
        [[ -f "$k" ]] && { echo "$k"; return 0; }
    done
    return 1
}

ensure_xz() {   # the source tarball is .tar.xz
    command -v xz >/dev/null 2>&1 && return 0
    need_root "installing xz-utils (to unpack CRIU's source)"
    apt_update_once
    run_logged "apt-get install xz-utils" apt-get install -y --no-install-recommends xz-utils
}

# Ensure $WORK/criu-src.tar (the upstream CRIU tarball, as compressed by
# Debian, from Debian's source package). Sets SRC_TARBALL and SRC_VERSION.
ensure_source() {
    work_init
    ensure_xz
    SRC_TARBALL="$WORK/criu-src.tar"
    if [[ -f "$SRC_TARBALL" && -f "$WORK/criu-src.version" && -f "$WORK/criu-src.sha256" ]] &&
       [[ "$(cat "$WORK/criu-src.suite" 2>/dev/null)" == "$SRC_SUITE" ]] &&
       version_ok "$(cat "$WORK/criu-src.version")" &&
       (cd "$WORK" && sha256sum --quiet -c criu-src.sha256 >/dev/null 2>&1); then
        SRC_VERSION="$(cat "$WORK/criu-src.version")"
        return 0
    fi

    local keyring mirror aptdir line uri name size hash
    if ! keyring="$(debian_keyring)"; then
        need_root "installing debian-archive-keyring"
        apt_update_once
        run_logged "apt-get install debian-archive-keyring" apt-get install -y --no-install-recommends debian-archive-keyring
        keyring="$(debian_keyring)" || die "no Debian archive keyring found after installing debian-archive-keyring"
    fi
    mirror="$(debian_mirror)"
    aptdir="$WORK/apt"
    rm -rf "$aptdir"
    mkdir -p "$aptdir/lists/partial" "$aptdir/get"
    cat >"$aptdir/src.sources" <<EOF
Types: deb-src
URIs: ${mirror}
Suites: ${SRC_SUITE}
Components: main
Signed-By: ${keyring}
EOF
    # Private apt configuration: our own source list, lists directory and no
    # binary caches, so the system's apt state is left alone.
    local o=(-o "Dir::Etc::SourceList=$aptdir/src.sources" -o "Dir::Etc::SourceParts=/dev/null"
             -o "Dir::State::Lists=$aptdir/lists" -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
             -o "APT::Sandbox::User=root" -o "Acquire::Languages=none")
    say "fetching the index of Debian ${SRC_SUITE} source packages from ${mirror} (private apt config)..."
    run_logged "apt-get update (private deb-src ${SRC_SUITE})" apt-get "${o[@]}" update
    # --print-uris lists the files with the SHA256 from the signed index.
    local uris
    uris="$(cd "$aptdir/get" && apt-get "${o[@]}" source --print-uris criu 2>>"$LOG")" ||
        die "apt-get source --print-uris criu failed (log: $LOG)"
    line="$(printf '%s\n' "$uris" | grep -E "^'[^']+' criu_[^ ]+\.orig\.tar\.[a-z0-9]+ " | head -n1)" ||
        die "no CRIU upstream tarball in Debian ${SRC_SUITE}'s source package (log: $LOG)"
    read -r uri name size hash <<<"$line"
    uri="${uri//\'/}"
    [[ "$hash" == SHA256:* ]] || die "unexpected checksum for $name: $hash"
    SRC_VERSION="${name#criu_}"; SRC_VERSION="${SRC_VERSION%%.orig.tar.*}"
    say "downloading CRIU ${SRC_VERSION} source ($name, $((size / 1024)) KiB) from Debian..."
    run_logged "download $name" /usr/lib/apt/apt-helper -o APT::Sandbox::User=root download-file "$uri" "$aptdir/get/$name" "$hash"
    # double check (apt-helper already verified it)
    echo "${hash#SHA256:}  $aptdir/get/$name" | sha256sum --quiet -c - >/dev/null ||
        die "checksum mismatch for $name"
    # Keep it uncompressed-agnostic: store as-is, tar detects the compression.
    mv -f "$aptdir/get/$name" "$SRC_TARBALL"
    (cd "$WORK" && sha256sum criu-src.tar >criu-src.sha256)
    echo "$SRC_VERSION" >"$WORK/criu-src.version"
    echo "$SRC_SUITE" >"$WORK/criu-src.suite"
    echo "$name" >"$WORK/criu-src.name"
    rm -rf "$aptdir"
}

# ------------------------------------------------------- build from source
BUILD_DEPS=(build-essential pkg-config xz-utils
            libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
            libnl-3-dev libnet1-dev libcap-dev uuid-dev
            libbsd-dev libgnutls28-dev libnftables-dev)
RUNTIME_EXTRA=(iproute2)   # criu runs `ip` when network namespaces are dumped

build_from_source() {
    need_root "building and installing CRIU"
    work_init
    say "installing CRIU build dependencies from this system's packages..."
    apt_update_once
    run_logged "apt-get install build dependencies" \
        apt-get install -y --no-install-recommends "${BUILD_DEPS[@]}" "${RUNTIME_EXTRA[@]}"

    ensure_source
    local t0 t1 src="$WORK/build"
    rm -rf "$src"; mkdir -p "$src"
    run_logged "unpack CRIU source" tar -xf "$SRC_TARBALL" -C "$src" --strip-components=1
    say "building CRIU ${SRC_VERSION} from Debian's source package (about a minute; log: $LOG)..."
    t0=$(date +%s)
    # Only the criu binary (no docs/man pages, which need asciidoc/xmlto; no
    # plugins, libcriu, crit). WERROR=0: newer compilers add warnings.
    run_logged "make criu" make -C "$src" -j"$(nproc)" WERROR=0 criu
    t1=$(date +%s)
    local built="$src/criu/criu" v
    v="$(criu_version "$built")"
    version_ok "$v" || die "the freshly built criu reports version '${v:-?}'"
    install -d -m 0755 "$(dirname "$INSTALL_PATH")"
    install -m 0755 "$built" "$INSTALL_PATH.new"
    mv -f "$INSTALL_PATH.new" "$INSTALL_PATH"
    say "built in $((t1 - t0)) s; installed CRIU $v to $INSTALL_PATH"
    keep_runtime_libs "$INSTALL_PATH"
    rm -rf "$src"
}

# Mark the shared libraries criu links against as manually installed, so
# removing the -dev packages later (apt autoremove) keeps criu working.
keep_runtime_libs() {
    local f pkgs=() p
    while read -r f; do
        [[ -n "$f" ]] || continue
        p="$(dpkg -S "$f" 2>/dev/null || dpkg -S "$(readlink -f "$f")" 2>/dev/null ||
             dpkg -S "/usr$f" 2>/dev/null || dpkg -S "${f#/usr}" 2>/dev/null || true)"
        p="${p%%: *}"                    # "pkg-a, pkg-b: /path" -> owners
        for p in ${p//,/ }; do
            p="${p%%:*}"                 # drop :arch
            [[ "$p" == *-dev ]] || pkgs+=("$p")
        done
    done < <(ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// {print $3}')
    if [[ ${#pkgs[@]} -gt 0 ]]; then
        mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | sort -u)
        apt-mark manual "${pkgs[@]}" >>"$LOG" 2>&1 || warn "apt-mark manual failed for: ${pkgs[*]}"
    fi
}

install_from_apt() {
    need_root "installing criu with apt-get"
    local extra=()
    [[ -n "$(apt_candidate python3-pycriu)" ]] && extra+=(python3-pycriu)
    say "installing criu $1 from the distribution (apt-get install criu ${extra[*]})..."
    work_init
    run_logged "apt-get install criu" apt-get install -y criu "${extra[@]}"
}

# -------------------------------------------------------------------- pycriu
pycriu_install() {
    local dest_dir="$1" py="$2"
    [[ -d "$dest_dir" ]] || die "--pycriu-into: $dest_dir is not a directory"
    dest_dir="$(cd "$dest_dir" && pwd -P)"
    command -v "$py" >/dev/null 2>&1 || [[ -x "$py" ]] || die "--python: $py not found"
    local pbver
    pbver="$("$py" -c 'import google.protobuf, grpc_tools.protoc; print(google.protobuf.__version__)' 2>/dev/null)" ||
        die "$py lacks protobuf and/or grpcio-tools (install them: $py -m pip install protobuf grpcio-tools)"

    local stamp="$dest_dir/pycriu/.torpor-stamp"
    # the stamp names the CRIU it came from: a pycriu of another CRIU (images change) is redone
    if [[ $FORCE -eq 0 && -f "$stamp" ]] && grep -qx "protobuf=$pbver" "$stamp" &&
       { [[ -z "$CRIU_VER" ]] || grep -qx "criu=$CRIU_VER" "$stamp"; } &&
       pycriu_check "$dest_dir" "$py" quiet; then
        say "pycriu already in $dest_dir ($(grep '^criu=' "$stamp"), generated for protobuf $pbver)"
        return 0
    fi

    ensure_source
    say "installing pycriu ${SRC_VERSION} into $dest_dir (protobuf modules generated for protobuf $pbver)..."
    local tmp; tmp="$(mktemp -d)"
    CLEANUP_DIRS+=("$tmp")
    tar -xf "$SRC_TARBALL" -C "$tmp" --strip-components=1 --wildcards --no-wildcards-match-slash \
        '*/lib/pycriu' '*/images' '*/scripts/magic-gen.py' '*/criu/include/magic.h' 2>>"$LOG" ||
        tar -xf "$SRC_TARBALL" -C "$tmp" --strip-components=1 ||
        die "cannot unpack the CRIU source (log: $LOG)"
    local pkg="$tmp/lib/pycriu" protos=() p m
    [[ -d "$pkg/images" && -f "$tmp/images/rpc.proto" ]] || die "unexpected CRIU source layout (no lib/pycriu or images/rpc.proto)"
    for p in "$tmp"/images/*.proto; do
        [[ "$(basename "$p")" == rpc.proto ]] || protos+=("$p")
    done
    # google/protobuf/descriptor.proto (imported by opts.proto) from grpc_tools
    local wkt
    wkt="$("$py" -c 'import os, grpc_tools; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')"
    run_logged "protoc images/*.proto" "$py" -m grpc_tools.protoc -I"$tmp/images" -I"$wkt" --python_out="$pkg/images" "${protos[@]}"
    run_logged "protoc images/rpc.proto" "$py" -m grpc_tools.protoc -I"$tmp/images" -I"$wkt" --python_out="$pkg" "$tmp/images/rpc.proto"
    # The generated modules import each other as top-level modules ("import
    # opts_pb2 as opts__pb2"); upstream makes that work by appending the
    # package directory to sys.path. Use package-relative imports instead.
    sed -i -E 's/^import ([A-Za-z0-9_]+_pb2) as /from . import \1 as /' "$pkg"/images/*_pb2.py "$pkg"/*_pb2.py
    sed -i -E 's/^import opts_pb2$/from . import opts_pb2/' "$pkg/images/pb2dict.py"
    sed -i -E '/^sys\.path\.append\(os\.path\.dirname\(os\.path\.realpath\(__file__\)\)\)$/d' "$pkg/images/__init__.py"
    # protobuf >= 6 dropped FieldDescriptor.label; use is_repeated when present.
    if grep -q 'field.label == FD.LABEL_REPEATED' "$pkg/images/pb2dict.py"; then
        sed -i 's/field\.label == FD\.LABEL_REPEATED/_is_repeated(field)/' "$pkg/images/pb2dict.py"
        cat >>"$pkg/images/pb2dict.py" <<'EOF'


def _is_repeated(field):
    # added by torpor's install-criu.sh: protobuf >= 6 has no FieldDescriptor.label
    rep = getattr(field, "is_repeated", None)
    if rep is not None:
        return rep
    return field.label == FD.LABEL_REPEATED
EOF
    fi
    # magic.py, pb.py, version.py as lib/pycriu's Makefiles make them
    "$py" "$tmp/scripts/magic-gen.py" "$tmp/criu/include/magic.h" "$pkg/images/magic.py" >>"$LOG" 2>&1 ||
        die "magic-gen.py failed (log: $LOG)"
    {
        echo "# Autogenerated. Do not edit!"
        for p in "${protos[@]}"; do
            m="$(basename "$p" .proto)"; m="${m//-/_}_pb2"
            [[ "$m" == opts_pb2 ]] || echo "from .$m import *"
        done
    } >"$pkg/images/pb.py"
    echo "__version__ = '${SRC_VERSION}'" >"$pkg/version.py"
    rm -f "$pkg/Makefile" "$pkg/images/Makefile" "$pkg/.gitignore" "$pkg/images/.gitignore"
    printf 'criu=%s\nprotobuf=%s\n' "$SRC_VERSION" "$pbver" >"$pkg/.torpor-stamp"

    # Install (replace any previous copy) plus a minimal .dist-info so pip
    # knows about it (pip list / pip uninstall pycriu).
    rm -rf "$dest_dir/pycriu" "$dest_dir"/pycriu-*.dist-info
    cp -r "$pkg" "$dest_dir/pycriu"
    local di="$dest_dir/pycriu-${SRC_VERSION}.dist-info"
    mkdir -p "$di"
    cat >"$di/METADATA" <<EOF
Metadata-Version: 2.1
Name: pycriu
Version: ${SRC_VERSION}
Summary: Python bindings for CRIU (installed by torpor's install-criu.sh)
Home-page: https://criu.org
License: GPLv2
EOF
    echo "torpor-install-criu" >"$di/INSTALLER"
    "$py" - "$dest_dir" "$di" <<'EOF' || warn "could not write pycriu's RECORD"
import base64, hashlib, os, sys
root, di = sys.argv[1], sys.argv[2]
rows = []
for base in (os.path.join(root, "pycriu"), di):
    for d, _, files in os.walk(base):
        for f in sorted(files):
            p = os.path.join(d, f)
            rel = os.path.relpath(p, root)
            if f == "RECORD":
                continue
            h = base64.urlsafe_b64encode(hashlib.sha256(open(p, "rb").read()).digest()).rstrip(b"=").decode()
            rows.append("%s,sha256=%s,%d" % (rel, h, os.path.getsize(p)))
rows.append(os.path.relpath(os.path.join(di, "RECORD"), root) + ",,")
open(os.path.join(di, "RECORD"), "w").write("\n".join(rows) + "\n")
EOF
    # A venv owned by a normal user, script run with sudo: keep ownership.
    chown -R --reference="$dest_dir" "$dest_dir/pycriu" "$di" 2>/dev/null || true
    pycriu_check "$dest_dir" "$py" || die "pycriu was installed into $dest_dir but does not import with $py"
    say "pycriu ${SRC_VERSION} installed at $dest_dir/pycriu"
}

pycriu_check() {   # pycriu_check DIR PY [quiet]
    local out
    if out="$(PYTHONDONTWRITEBYTECODE=1 "$2" - "$1" 2>&1 <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
import pycriu, pycriu.images
assert pycriu.__file__.startswith(sys.argv[1]), pycriu.__file__
print(pycriu.rpc_pb2, pycriu.images.pstree_pb2 if hasattr(pycriu.images, "pstree_pb2") else "")
EOF
)"; then
        [[ "${3:-}" == quiet ]] || say "pycriu imports: ${out%%$'\n'*}"
        return 0
    fi
    [[ "${3:-}" == quiet ]] || printf '%s\n' "$out" >&2
    return 1
}

# ------------------------------------------------------------------ selftest
selftest() {
    local criu="$1"
    need_root "the CRIU self-test"
    say "self-test: $criu --version"
    "$criu" --version | sed 's/^/    /'
    version_ok "$(criu_version "$criu")" || die "self-test: $criu is not CRIU >= ${WANT_VERSION}"

    say "self-test: criu check"
    local out
    if ! out="$("$criu" check 2>&1)"; then
        printf '%s\n' "$out" | sed 's/^/    /' >&2
        die "self-test: 'criu check' failed: this kernel/host cannot run CRIU"
    fi
    printf '%s\n' "$out" | sed 's/^/    /'
    say "self-test: criu check --all (informational; missing optional features are fine)"
    "$criu" check --all 2>&1 | sed 's/^/    /' || true

    local d pid
    d="$(mktemp -d /tmp/torpor-criu-selftest.XXXXXX)"
    # Start it with only fds 0-2: anything inherited (our flock on the work
    # dir, fds from the caller) could make the dump fail for reasons that
    # have nothing to do with CRIU.
    (
        cd /
        for f in /proc/"$BASHPID"/fd/*; do
            n="${f##*/}"
            if [[ "$n" =~ ^[0-9]+$ && "$n" -gt 2 ]]; then eval "exec $n>&-"; fi
        done
        exec setsid sleep 1000
    ) </dev/null >/dev/null 2>&1 &
    pid=$!
    disown "$pid"    # no "Killed" job notice when the dump kills it
    CLEANUP_PIDS+=("$pid"); CLEANUP_DIRS+=("$d")
    sleep 0.3
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == sleep ]] || die "self-test: could not start the test process"
    say "self-test: criu dump --tree $pid (setsid sleep 1000)"
    if ! "$criu" dump --tree "$pid" -D "$d" -o dump.log -v4; then
        tail -n 30 "$d/dump.log" >&2 || true
        die "self-test: criu dump failed (log above)"
    fi
    CLEANUP_PIDS=()
    for _ in $(seq 50); do   # dump kills the tree; bash reaps it
        [[ -e "/proc/$pid" ]] || break
        sleep 0.1
    done
    [[ -e "/proc/$pid" ]] && die "self-test: the process is still running after dump"
    say "self-test: dumped $(find "$d" -name '*.img' | wc -l) image files"

    if [[ -n "$PY" ]]; then
        local sp="${PYCRIU_INTO:-}"
        say "self-test: reading pstree.img with pycriu ($PY)"
        PYTHONDONTWRITEBYTECODE=1 "$PY" - "$d/pstree.img" "$sp" <<'EOF' || die "self-test: pycriu could not read the dump"
import sys
if sys.argv[2]:
    sys.path.insert(0, sys.argv[2])
import pycriu, pycriu.images
img = pycriu.images.load(open(sys.argv[1], "rb"))
e = img["entries"][0]
print("    pstree.img: magic=%s pid=%s sid=%s" % (img["magic"], e["pid"], e["sid"]))
# also round-trip it (dict -> protobuf -> bytes)
import io
buf = io.BytesIO()
pycriu.images.dump(img, buf)
if buf.getvalue() != open(sys.argv[1], "rb").read():
    print("    note: pycriu's re-encoded pstree.img differs byte-wise from CRIU's")
EOF
    fi

    say "self-test: criu restore -d"
    if ! "$criu" restore -d -D "$d" -o restore.log -v4; then
        tail -n 30 "$d/restore.log" >&2 || true
        die "self-test: criu restore failed (log above)"
    fi
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == sleep ]] || die "self-test: restored process $pid is not running"
    CLEANUP_PIDS=("$pid")
    say "self-test: process $pid restored and running; killing it"
    kill -9 "$pid"; CLEANUP_PIDS=()
    local _
    for _ in $(seq 50); do
        [[ -e "/proc/$pid" ]] || break
        [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" == Z ]] && break   # zombie: fine
        sleep 0.1
    done
    say "self-test passed"
}

# ---------------------------------------------------------------------- main
main() {
    if [[ $FORCE -eq 0 ]] && find_criu; then
        say "CRIU ${CRIU_VER} already installed at ${CRIU_BIN}; skipping the build"
    else
        local cand
        if [[ $IS_ROOT -eq 1 ]]; then work_init; fi
        if [[ $FORCE -eq 0 ]] && find_criu; then
            say "another run installed CRIU ${CRIU_VER} meanwhile"
        else
            if [[ $IS_ROOT -eq 1 ]]; then apt_update_once; fi
            cand="$(apt_candidate criu)"
            if [[ -n "$cand" ]] && version_ok "${cand#*:}"; then
                install_from_apt "$cand"
            else
                if [[ -n "$cand" ]]; then
                    say "the distribution's criu is ${cand} (< ${WANT_VERSION}: older ones fail on recent kernels)"
                fi
                build_from_source
            fi
        fi
        find_criu || die "CRIU >= ${WANT_VERSION} is still not found after installing it"
        say "CRIU ${CRIU_VER} ready at ${CRIU_BIN}"
        case ":$PATH:" in *":$(dirname "$CRIU_BIN"):"*) ;; *) warn "$(dirname "$CRIU_BIN") is not on PATH" ;; esac
        if [[ "$CRIU_BIN" == "$INSTALL_PATH" && -x /usr/sbin/criu ]]; then
            local old; old="$(criu_version /usr/sbin/criu)"
            version_ok "$old" || warn "an older /usr/sbin/criu (${old:-?}) is also installed; /usr/local/sbin comes first on PATH"
        fi
    fi

    if [[ -n "$PYCRIU_INTO" ]]; then
        pycriu_install "$PYCRIU_INTO" "$PY"
    fi
    if [[ $SELFTEST -eq 1 ]]; then
        selftest "$CRIU_BIN"
    fi
}

main
