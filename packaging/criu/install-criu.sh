#!/usr/bin/env bash
# install-criu.sh: make sure CRIU >= 4 is installed (and optionally CRIU's
# pycriu Python package in a given site-packages directory).
#
# Used by torpor's ./install.sh and by CI. Safe to run again: when CRIU >= 4
# is already there it only says so (and refreshes pycriu if asked to).
#
#   1. criu >= 4.2 at /usr/local/sbin/criu or on PATH -> nothing to do
#   2. the distribution's candidate `criu` is >= 4.2   -> apt-get install criu
#   3. otherwise: build CRIU from Debian's source package, newest suite first
#      (unstable, then trixie; the upstream tarball, checked against Debian's
#      signed Sources index), fetched through a private apt configuration (the
#      system's apt sources are not touched), build dependencies from the
#      machine's own packages. A build is installed to /usr/local/sbin/criu
#      only after it dumped and restored a process with a listening TCP socket.
#   4. when no suite gives a CRIU that works: the distribution's criu if it is
#      >= 4, or the CRIU >= 4 already installed, with a warning saying what
#      does not work with it (TCP sockets on Linux >= 6.16 need CRIU >= 4.2).
#
# See packaging/criu/README.md. CRIU is GPL-2.0 and is used as a separate
# program; nothing of it is linked into torpor.

set -Eeuo pipefail

readonly PROG="torpor"
readonly MIN_MAJOR=4
# The version aimed for: 4.2 is the first CRIU that dumps TCP sockets on Linux >= 6.16
# (which allows SO_PASSCRED/SO_PASSSEC only on Unix and netlink sockets; 4.1.1 fails
# with "Can't get 1:34 opt: Operation not supported" on any TCP socket there).
readonly WANT_VERSION=4.2
readonly DEFAULT_WORK=/var/cache/torpor/criu-build

# Overridable from the environment (mostly for testing).
INSTALL_PATH="${TORPOR_CRIU_INSTALL_PATH:-/usr/local/sbin/criu}"
# CRIU's cuda plugin (plugins/cuda), built with CRIU for the upstream benchmark leg; never in
# CRIU's own plugin directory
UPSTREAM_PLUGIN_DIR="${TORPOR_CRIU_UPSTREAM_PLUGIN_DIR:-/usr/local/lib/torpor/criu-upstream}"
# Debian suites whose source package of CRIU is tried, newest first.
read -r -a SRC_SUITES <<<"${TORPOR_CRIU_SRC_SUITE:-unstable trixie}"
[[ ${#SRC_SUITES[@]} -gt 0 ]] || SRC_SUITES=(unstable trixie)
SRC_MIRROR="${TORPOR_CRIU_SRC_MIRROR:-}"      # empty: derive from the system's sources

usage() {
    cat <<EOF
Usage: $0 [options]

Ensure CRIU >= ${WANT_VERSION} is installed (apt if the distribution has it, else
built from Debian's source package, newest suite first (${SRC_SUITES[*]}),
into ${INSTALL_PATH}); where none works, keep or install a CRIU >= ${MIN_MAJOR}
and say what it lacks.

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
  --force             rebuild/reinstall even if CRIU >= ${WANT_VERSION} is present
  --work-dir DIR      build/cache directory (default: ${DEFAULT_WORK})
  -h, --help          this help

Environment: TORPOR_CRIU_SRC_SUITE (Debian suites to build from, tried in
             order; default "unstable trixie"),
             TORPOR_CRIU_SRC_MIRROR (default: the system's Debian mirror,
             else http://deb.debian.org/debian),
             TORPOR_CRIU_INSTALL_PATH (default /usr/local/sbin/criu)
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

# try_isolated CMD...: run CMD in a subshell that stops at its first failure (errexit and
# the ERR trap, as the script itself), without ending the script; TRY_RC = its status.
# Call it as a plain command: in an if/while condition or a && || list bash ignores
# errexit in everything below, subshells included.
TRY_RC=0
try_isolated() {
    set +e; trap - ERR
    ( set -e; trap 'on_err "$LINENO" "$BASH_COMMAND"' ERR; "$@" )
    TRY_RC=$?
    trap 'on_err "$LINENO" "$BASH_COMMAND"' ERR; set -e
}

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

version_ok() {  # version_ok 4.1.1 -> true if >= MIN_MAJOR
    [[ -n "$1" ]] && dpkg --compare-versions "$1" ge "${MIN_MAJOR}.0"
}

version_want() {  # version_want 4.2.1 -> true if >= WANT_VERSION
    [[ -n "$1" ]] && dpkg --compare-versions "$1" ge "$WANT_VERSION"
}

upstream_version() {  # "1:4.2.1-2+b1" -> "4.2.1"
    local v="${1#*:}"
    echo "${v%%-*}"
}

# Find a criu >= MIN_MAJOR: sets CRIU_BIN / CRIU_VER. Returns 1 if none.
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
        [[ -n "$v" ]] && say "found $c, but it is CRIU $v (need >= ${MIN_MAJOR})"
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

# Ensure $WORK/src/SUITE/criu-src.tar (the upstream CRIU tarball, as
# compressed by Debian, from Debian SUITE's source package), cached per suite.
# Sets SRC_TARBALL and SRC_VERSION.
ensure_source() {
    local suite="$1" cache
    work_init
    ensure_xz
    # the cache of install-criu.sh before it knew suites: one tarball, suite unknown
    rm -f "$WORK"/criu-src.tar "$WORK"/criu-src.sha256 "$WORK"/criu-src.version "$WORK"/criu-src.name
    cache="$WORK/src/$suite"
    SRC_TARBALL="$cache/criu-src.tar"
    if [[ -f "$SRC_TARBALL" && -f "$cache/criu-src.version" && -f "$cache/criu-src.sha256" ]] &&
       (cd "$cache" && sha256sum --quiet -c criu-src.sha256 >/dev/null 2>&1); then
        SRC_VERSION="$(cat "$cache/criu-src.version")"
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
    rm -rf "$aptdir" "$cache"
    mkdir -p "$aptdir/lists/partial" "$aptdir/get"
    cat >"$aptdir/src.sources" <<EOF
Types: deb-src
URIs: ${mirror}
Suites: ${suite}
Components: main
Signed-By: ${keyring}
EOF
    # Private apt configuration: our own source list, lists directory and no
    # binary caches, so the system's apt state is left alone.
    local o=(-o "Dir::Etc::SourceList=$aptdir/src.sources" -o "Dir::Etc::SourceParts=/dev/null"
             -o "Dir::State::Lists=$aptdir/lists" -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
             -o "APT::Sandbox::User=root" -o "Acquire::Languages=none")
    say "fetching the index of Debian ${suite} source packages from ${mirror} (private apt config)..."
    run_logged "apt-get update (private deb-src ${suite})" apt-get "${o[@]}" update
    # --print-uris lists the files with the SHA256 from the signed index.
    local uris
    uris="$(cd "$aptdir/get" && apt-get "${o[@]}" source --print-uris criu 2>>"$LOG")" ||
        die "apt-get source --print-uris criu failed (log: $LOG)"
    line="$(printf '%s\n' "$uris" | grep -E "^'[^']+' criu_[^ ]+\.orig\.tar\.[a-z0-9]+ " | head -n1)" ||
        die "no CRIU upstream tarball in Debian ${suite}'s source package (log: $LOG)"
    read -r uri name size hash <<<"$line"
    uri="${uri//\'/}"
    [[ "$hash" == SHA256:* ]] || die "unexpected checksum for $name: $hash"
    SRC_VERSION="${name#criu_}"; SRC_VERSION="${SRC_VERSION%%.orig.tar.*}"
    say "downloading CRIU ${SRC_VERSION} source ($name, $((size / 1024)) KiB) from Debian ${suite}..."
    run_logged "download $name" /usr/lib/apt/apt-helper -o APT::Sandbox::User=root download-file "$uri" "$aptdir/get/$name" "$hash"
    # double check (apt-helper already verified it)
    echo "${hash#SHA256:}  $aptdir/get/$name" | sha256sum --quiet -c - >/dev/null ||
        die "checksum mismatch for $name"
    # Keep it uncompressed-agnostic: store as-is, tar detects the compression.
    mkdir -p "$cache"
    mv -f "$aptdir/get/$name" "$SRC_TARBALL"
    echo "$name" >"$cache/criu-src.name"
    echo "$SRC_VERSION" >"$cache/criu-src.version"
    (cd "$cache" && sha256sum criu-src.tar >criu-src.sha256)   # last: marks the cache complete
    rm -rf "$aptdir"
}

# ------------------------------------------------------- build from source
# protobuf-compiler: CRIU 4.2 runs protoc when it builds
BUILD_DEPS=(build-essential pkg-config xz-utils
            libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
            libnl-3-dev libnet1-dev libcap-dev uuid-dev
            libbsd-dev libgnutls28-dev libnftables-dev)
RUNTIME_EXTRA=(iproute2)   # criu runs `ip` when network namespaces are dumped

build_deps_once() {
    [[ -z "${BUILD_DEPS_DONE:-}" ]] || return 0
    say "installing CRIU build dependencies from this system's packages..."
    apt_update_once
    run_logged "apt-get install build dependencies" \
        apt-get install -y --no-install-recommends "${BUILD_DEPS[@]}" "${RUNTIME_EXTRA[@]}"
    BUILD_DEPS_DONE=1
}

# build_from_source SUITE: build CRIU from Debian SUITE's source, check that it
# dumps and restores a process with a listening TCP socket on this machine, and
# only then install it (atomic rename) at INSTALL_PATH. Dies on any failure;
# main runs it in a subshell so that the next suite can be tried.
build_from_source() {
    local suite="$1"
    need_root "building and installing CRIU"
    work_init
    build_deps_once
    ensure_source "$suite"
    local t0 t1 src="$WORK/build"
    rm -rf "$src"; mkdir -p "$src"
    run_logged "unpack CRIU source" tar -xf "$SRC_TARBALL" -C "$src" --strip-components=1
    say "building CRIU ${SRC_VERSION} from Debian ${suite}'s source package (about a minute; log: $LOG)..."
    t0=$(date +%s)
    # Only the criu binary (no docs/man pages, which need asciidoc/xmlto; no
    # plugins, libcriu, crit). WERROR=0: newer compilers add warnings.
    run_logged "make criu" make -C "$src" -j"$(nproc)" WERROR=0 criu
    t1=$(date +%s)
    local built="$src/criu/criu" v
    v="$(criu_version "$built")"
    version_ok "$v" || die "the freshly built criu reports version '${v:-?}'"
    say "built CRIU $v in $((t1 - t0)) s; checking it on this machine before installing it..."
    "$built" check >>"$LOG" 2>&1 || die "the freshly built CRIU $v fails 'criu check' here (log: $LOG)"
    tcp_roundtrip "$built" || die "the freshly built CRIU $v cannot checkpoint a TCP listener here (log: $LOG)"
    install -d -m 0755 "$(dirname "$INSTALL_PATH")"
    install -m 0755 "$built" "$INSTALL_PATH.new"
    mv -f "$INSTALL_PATH.new" "$INSTALL_PATH"
    say "installed CRIU $v to $INSTALL_PATH"
    keep_runtime_libs "$INSTALL_PATH"
    # CRIU's own cuda plugin, for the benchmarks' upstream leg only (bench/upstream_path.py
    # gives it to CRIU through --libdir): kept out of CRIU's plugin directory, so no CRIU
    # run of torpor's or the engines' ever loads it. Seconds once criu is built.
    if make -C "$src" WERROR=0 cuda_plugin >>"$LOG" 2>&1; then
        install -d -m 0755 "$UPSTREAM_PLUGIN_DIR"
        install -m 0644 "$src/plugins/cuda/cuda_plugin.so" "$UPSTREAM_PLUGIN_DIR/cuda_plugin.so"
    else
        warn "CRIU's cuda plugin did not build (only the benchmarks' upstream leg needs it; log: $LOG)"
    fi
    rm -rf "$src"
}

# tcp_roundtrip CRIU: dump and restore (criu restore -d) a process that holds a
# listening TCP socket on 127.0.0.1, connect to the restored one, then kill it. Output to $LOG; returns 1 if
# CRIU cannot (CRIU < 4.2 on Linux >= 6.16: "Can't get 1:34 opt").
tcp_roundtrip() {
    local criu="$1" d pid ok=0
    command -v perl >/dev/null 2>&1 || { warn "no perl: the TCP check of CRIU is skipped"; return 0; }
    d="$(mktemp -d /tmp/torpor-criu-tcp.XXXXXX)"
    CLEANUP_DIRS+=("$d")
    (   # only fds 0-2 (our flock on the work dir must not go into the dump)
        cd /
        for f in /proc/"$BASHPID"/fd/*; do
            n="${f##*/}"
            if [[ "$n" =~ ^[0-9]+$ && "$n" -gt 2 ]]; then eval "exec $n>&-"; fi
        done
        exec setsid perl -MIO::Socket::INET -e '
            my $s = IO::Socket::INET->new(Listen => 5, LocalAddr => "127.0.0.1", LocalPort => 0,
                                          Proto => "tcp", ReuseAddr => 1) or die "listen: $!";
            open(my $f, ">", $ARGV[0]) or die; print $f $s->sockport(), "\n"; close($f);
            while (1) { my $c = $s->accept() or next; print $c "ok\n"; close($c); }' "$d/port"
    ) </dev/null >/dev/null 2>&1 &
    pid=$!
    disown "$pid"
    CLEANUP_PIDS+=("$pid")
    for _ in $(seq 50); do [[ -s "$d/port" ]] && break; sleep 0.1; done
    if [[ -s "$d/port" ]] &&
       "$criu" dump --tree "$pid" -D "$d" -o dump.log -v4 >>"$LOG" 2>&1; then
        for _ in $(seq 50); do [[ -e "/proc/$pid" ]] || break; sleep 0.1; done
        if "$criu" restore -d -D "$d" -o restore.log -v4 >>"$LOG" 2>&1 &&
           [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == perl ]]; then
            # the restored listener must answer on its port
            if timeout 10 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1" && read -r l <&3 && [[ "$l" == ok ]]' _ "$(cat "$d/port")"; then
                ok=1
            else
                echo "the restored process $pid does not answer on 127.0.0.1:$(cat "$d/port")" >>"$LOG"
            fi
        else
            echo "restore failed, or process $pid is not the restored perl" >>"$LOG"
        fi
    else
        echo "no listener started, or its dump failed" >>"$LOG"
    fi
    { echo "----- TCP check of $criu:"; cat "$d"/dump.log "$d"/restore.log 2>/dev/null | grep -E 'Error|error' | tail -n 20 || true; } >>"$LOG"
    kill -9 "$pid" 2>/dev/null || true
    CLEANUP_PIDS=()
    [[ $ok -eq 1 ]]
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

    local stamp="$dest_dir/pycriu/.torpor-stamp" want
    want="$(upstream_version "$CRIU_VER")"
    if [[ $FORCE -eq 0 && -f "$stamp" ]] && grep -qx "protobuf=$pbver" "$stamp" &&
       grep -qx "criu=$want" "$stamp" && pycriu_check "$dest_dir" "$py" quiet; then
        say "pycriu already in $dest_dir (criu=$want, generated for protobuf $pbver)"
        return 0
    fi

    source_of_version "$want"
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

# source_of_version VER: ensure_source of the first suite whose CRIU is VER
# (pycriu must match the criu that writes the images); if none is, the first
# suite that can be had, with a warning.
source_of_version() {
    local suite first=""
    for suite in "${SRC_SUITES[@]}"; do
        try_isolated ensure_source "$suite"
        if [[ $TRY_RC -ne 0 ]]; then warn "CRIU's source from Debian ${suite} cannot be had (log: $LOG)"; continue; fi
        [[ -n "$first" ]] || first="$suite"
        if [[ "$(cat "$WORK/src/$suite/criu-src.version")" == "$1" ]]; then ensure_source "$suite"; return 0; fi
    done
    [[ -n "$first" ]] || die "no CRIU source to make pycriu from (suites: ${SRC_SUITES[*]}; log: $LOG)"
    ensure_source "$first"
    warn "no Debian suite of ${SRC_SUITES[*]} has CRIU $1's source; pycriu is made from CRIU ${SRC_VERSION}'s"
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
    version_ok "$(criu_version "$criu")" || die "self-test: $criu is not CRIU >= ${MIN_MAJOR}"

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
    say "self-test: criu dump and restore of a process with a listening TCP socket"
    if tcp_roundtrip "$criu"; then
        say "self-test: TCP listener dumped and restored"
    elif version_want "$(criu_version "$criu")"; then
        die "self-test: CRIU cannot checkpoint a TCP listener here (log: $LOG)"
    else
        warn "self-test: this CRIU cannot checkpoint TCP sockets on this kernel (needs CRIU >= ${WANT_VERSION} on Linux >= 6.16)"
    fi
    say "self-test passed"
}

# ---------------------------------------------------------------------- main
# obtain_criu: install CRIU >= WANT_VERSION (apt, else built from the suites in
# order); where none can be had, the distribution's CRIU >= MIN_MAJOR. OBTAINED=1
# when something was installed.
OBTAINED=0
obtain_criu() {
    local cand suite
    if [[ $IS_ROOT -eq 1 ]]; then apt_update_once; fi
    cand="$(apt_candidate criu)"
    if [[ -n "$cand" ]] && version_want "$(upstream_version "$cand")"; then
        install_from_apt "$cand"; OBTAINED=1; return 0
    fi
    if [[ -n "$cand" ]]; then
        say "the distribution's criu is ${cand} (< ${WANT_VERSION}: no TCP sockets on Linux >= 6.16; 3.x fails on recent kernels)"
    fi
    for suite in "${SRC_SUITES[@]}"; do
        try_isolated build_from_source "$suite"
        if [[ $TRY_RC -eq 0 ]]; then OBTAINED=1; return 0; fi
        warn "CRIU from Debian ${suite}'s source could not be built, checked or installed (above; log: $LOG)"
    done
    if [[ -n "$cand" ]] && version_ok "$(upstream_version "$cand")"; then
        install_from_apt "$cand"; OBTAINED=1
    fi
}

main() {
    local have=0 have_bin="" have_ver=""
    find_criu && { have=1; have_bin="$CRIU_BIN"; have_ver="$CRIU_VER"; }
    if [[ $FORCE -eq 0 && $have -eq 1 ]] && version_want "$CRIU_VER"; then
        say "CRIU ${CRIU_VER} already installed at ${CRIU_BIN}; skipping the build"
    elif [[ $FORCE -eq 0 && $have -eq 1 && $IS_ROOT -eq 0 ]]; then
        warn "CRIU ${CRIU_VER} at ${CRIU_BIN} is older than ${WANT_VERSION} (it cannot checkpoint TCP sockets on Linux >= 6.16); run this as root to build a newer one"
    else
        if [[ $IS_ROOT -eq 1 ]]; then work_init; fi
        if [[ $FORCE -eq 0 ]] && find_criu && version_want "$CRIU_VER"; then
            say "another run installed CRIU ${CRIU_VER} meanwhile"
        else
            if [[ $have -eq 1 ]] && ! version_want "$have_ver"; then
                say "CRIU ${have_ver} at ${have_bin} is older than ${WANT_VERSION} (it cannot checkpoint TCP sockets on Linux >= 6.16); upgrading"
            fi
            obtain_criu
            if [[ $OBTAINED -eq 0 ]]; then
                [[ $have -eq 1 ]] || die "no CRIU >= ${MIN_MAJOR} could be installed (suites tried: ${SRC_SUITES[*]}; log: $LOG)"
            fi
        fi
        find_criu || die "CRIU >= ${MIN_MAJOR} is still not found after installing it"
        if version_want "$CRIU_VER"; then
            say "CRIU ${CRIU_VER} ready at ${CRIU_BIN}"
        else
            warn "CRIU ${CRIU_VER} at ${CRIU_BIN} is used: no CRIU >= ${WANT_VERSION} could be had (suites tried: ${SRC_SUITES[*]}; log: $LOG). It works, but cannot checkpoint programs with TCP sockets on Linux >= 6.16; set TORPOR_CRIU_SRC_SUITE to a Debian suite with CRIU >= ${WANT_VERSION} and run this again"
        fi
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
