#!/usr/bin/env bash
# node-install.sh install|uninstall: put torpor on a Kubernetes node from the installer image
# (packaging/kubernetes/Containerfile), as the DaemonSet's init container runs it.
#
# install:
#   1. a self-contained bundle in $HOST_ROOT$NODE_DIR (default /opt/torpor/node): the image's
#      Python interpreter, standard library and torpor's virtual environment, CRIU, and every
#      shared library they load, with the image's own dynamic loader. Nothing of the node's
#      libraries is used and nothing is set in the environment (children of torpor, runc and
#      the programs it restores, inherit no LD_LIBRARY_PATH or PYTHONHOME): the interpreter
#      and CRIU are started through the bundle's loader by small wrappers.
#        $NODE_DIR/bin/{torpor,torpord,torpor-runtime,torpor-hook,criu}
#      Versions live in $NODE_DIR/versions/, `current` links the newest: an update switches
#      with one rename while containers keep running through the handler.
#   2. $TORPOR_ETC/config.toml (default /etc/torpor) from the ConfigMap ($CONFIG), with `criu` pointing at the bundle
#      where the config does not name one
#   3. containerd's runtime handler "$HANDLER" (runc v2 shim, BinaryName = the bundle's
#      torpor-runtime) in $CONTAINERD_DIR/conf.d/torpor.toml, imported from config.toml (kept
#      as config.toml.torpor-orig the first time), then containerd restarted ($RESTART=1)
# uninstall: the handler and the import removed, containerd restarted, the bundle removed.
#   Containers started through the handler still call torpor-runtime for their delete and
#   checkpoint: drain the node of them first (the DaemonSet's pod never uninstalls by itself).
# Safe to run again. Needs bash, coreutils, ldd, python3 (the image's).
set -Eeuo pipefail

HOST_ROOT="${HOST_ROOT-/host}"                   # the node's / as mounted in the pod
NODE_DIR="${NODE_DIR:-/opt/torpor/node}"         # the bundle, as the node sees it
SRC_PREFIX="${SRC_PREFIX:-/opt/torpor/venv}"     # torpor's virtual environment in the image
SRC_CRIU="${SRC_CRIU:-/usr/local/sbin/criu}"
CONFIG="${CONFIG:-/etc/torpor-k8s/config.toml}"  # the ConfigMap's config (absent: defaults)
CONTAINERD_DIR="${CONTAINERD_DIR:-/etc/containerd}"
TORPOR_ETC="${TORPOR_ETC:-/etc/torpor}"            # where the node's torpor reads config.toml
HANDLER="${HANDLER:-torpor}"
RESTART="${RESTART:-1}"                          # restart containerd on the node (hostPID)

say() { printf 'torpor-node: %s\n' "$*"; }
die() { printf 'torpor-node: error: %s\n' "$*" >&2; exit 1; }
trap 'die "failed at line $LINENO"' ERR

[[ $NODE_DIR == /* && $NODE_DIR != */ && $NODE_DIR != *..* ]] || die "NODE_DIR must be an absolute path"
[[ $HANDLER =~ ^[a-z0-9][a-z0-9-]{0,62}$ ]] || die "HANDLER must be a DNS label"
root="${HOST_ROOT%/}"
dest="$root$NODE_DIR"
conf="$root$CONTAINERD_DIR/config.toml"
snippet="$root$CONTAINERD_DIR/conf.d/torpor.toml"
snippet_on_node="$CONTAINERD_DIR/conf.d/torpor.toml"

python_for() { "$SRC_PREFIX/bin/python" "$@"; }

# Every shared library an ELF file loads, as resolved in this image (ldd), one path a line.
needed_libs() {
    ldd "$1" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' || true
}

bundle() {
    local id stage real stdlib site ver
    id="$(date +%Y%m%d%H%M%S)-$$"
    stage="$dest/versions/$id"
    real=$(readlink -f "$SRC_PREFIX/bin/python")
    ver=$(python_for -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    stdlib=$(python_for -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    site=$(python_for -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [[ -x $SRC_CRIU ]] || die "no CRIU at $SRC_CRIU in the image"
    install -d -m 0755 "$dest" "$dest/versions" "$dest/bin"
    install -d -m 0755 "$stage"/{lib,libexec,python/bin,python/lib}
    # The interpreter finds its standard library from where it runs (prefix = python/), and
    # Debian's site module adds prefix/lib/python3/dist-packages: torpor's environment goes
    # there, so any run of the bundle's interpreter (sys.executable included) sees it.
    cp -a "$stdlib" "$stage/python/lib/python$ver"
    rm -rf "$stage/python/lib/python$ver"/{test,idlelib,tkinter,ensurepip,site-packages,dist-packages}
    install -d -m 0755 "$stage/python/lib/python3"
    cp -a "$site" "$stage/python/lib/python3/dist-packages"
    rm -rf "$stage/python/lib/python3/dist-packages"/{pip,setuptools,_pytest,pytest,hypothesis}
    install -m 0755 "$real" "$stage/python/bin/.python-real"
    install -m 0755 "$SRC_CRIU" "$stage/libexec/criu"
    # torpor-runtime's native front (shim/front), which execs runc itself for containers
    # torpor has nothing to do with; a venv without it has the Python entry only
    local front=""
    if [[ $(head -c4 "$SRC_PREFIX/bin/torpor-runtime" | od -An -c | tr -d ' ') == '177ELF' ]]; then
        front="$SRC_PREFIX/bin/torpor-runtime"
        install -m 0755 "$front" "$stage/libexec/torpor-runtime"
    fi
    cp -L "$(needed_libs "$real" | grep '/ld-linux' | head -1)" "$stage/lib/ld.so"
    # the loader's closure of everything the bundle runs; torpor's agent is left out: it is
    # preloaded into containers and loads with their libc, never through this loader
    {
        needed_libs "$real"; needed_libs "$SRC_CRIU"; [[ -z $front ]] || needed_libs "$front"
        find "$stage/python" -name '*.so*' -type f ! -path '*/_agent/*' -print0 |
            while IFS= read -r -d '' so; do needed_libs "$so"; done
    } | grep -v '/ld-linux' | sort -u | while read -r lib; do cp -L "$lib" "$stage/lib/"; done

    local cur="$NODE_DIR/current" loader
    loader="$cur/lib/ld.so --library-path $cur/lib"
    # --argv0: the interpreter sees the wrapper as its executable (prefix, sys.executable)
    printf '#!/bin/sh\nexec %s --argv0 "$0" %s/python/bin/.python-real "$@"\n' \
        "$loader" "$cur" > "$stage/python/bin/python3"
    chmod 0755 "$stage/python/bin/python3"
    chmod -R go-w "$stage"
    # One rename switches every wrapper to the new version; the previous one stays for
    # commands still running from it, older ones go.
    ln -sfn "versions/$id" "$dest/current.new"
    mv -T "$dest/current.new" "$dest/current"
    local v
    for v in $(ls -1t "$dest/versions" | tail -n +3); do rm -rf "${dest:?}/versions/$v"; done

    local cmd
    wrap() { printf '%s\n' "$2" > "$dest/bin/.$1.new"; chmod 0755 "$dest/bin/.$1.new"; mv -T "$dest/bin/.$1.new" "$dest/bin/$1"; }
    wrap criu "$(printf '#!/bin/sh\nexec %s --argv0 "$0" %s/libexec/criu "$@"\n' "$loader" "$cur")"
    if [[ -n $front ]]; then   # the Python side is named to it: it is not next to the loader
        wrap torpor-runtime "$(printf '#!/bin/sh\nTORPOR_RUNTIME_PY=%s/bin/torpor-runtime-py exec %s --argv0 "$0" %s/libexec/torpor-runtime "$@"\n' "$NODE_DIR" "$loader" "$cur")"
    fi
    for cmd in torpor:torpor.cli.main torpord:torpor.sidecar.daemon torpor-hook:torpor_hook \
               torpor-runtime-py:torpor.runtime.main \
               ${front:+x}torpor-runtime:torpor.runtime.main; do
        [[ $cmd == x* ]] && continue
        wrap "${cmd%%:*}" "$(printf '#!%s/python/bin/python3 -s\nimport sys\nfrom %s import main\nsys.exit(main())\n' "$cur" "${cmd#*:}")"
    done
}

write_config() {
    install -d -m 0755 "$root$TORPOR_ETC"
    local out="$root$TORPOR_ETC/config.toml" tmp
    tmp=$(mktemp "$out.XXXXXX")
    if [[ -f $CONFIG ]]; then cat "$CONFIG" > "$tmp"; fi
    # the bundle's CRIU unless the ConfigMap names one (a top-level key: before any table)
    if ! python_for - "$tmp" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    sys.exit(0 if "criu" in tomllib.load(f) else 1)
EOF
    then
        { printf 'criu = "%s/bin/criu"\n' "$NODE_DIR"; cat "$tmp"; } > "$tmp.2" && mv "$tmp.2" "$tmp"
    fi
    chmod 0644 "$tmp"
    mv "$tmp" "$out"
}

# The import of our snippet in containerd's config.toml: edits the `imports` array in place
# or adds one before the first table (TOML: top-level keys come first).
containerd_import() {
    python_for - "$conf" "$snippet_on_node" "$1" <<'EOF'
import os, re, sys, tomllib
path, snippet, action = sys.argv[1:]
try:
    text = open(path).read()
except FileNotFoundError:
    text = "version = 3\n" if action == "add" else None
if text is None:
    sys.exit(0)
doc = tomllib.loads(text)
imports = doc.get("imports", [])
if not isinstance(imports, list):
    sys.exit(f"{path}: imports is not a list")
if action == "add" and snippet in imports:
    sys.exit(0)
if action == "remove" and snippet not in imports:
    sys.exit(0)
new = [i for i in imports if i != snippet] + ([snippet] if action == "add" else [])
line = "imports = [" + ", ".join('"%s"' % i for i in new) + "]\n"
pat = re.compile(r"^imports\s*=\s*\[[^\]]*\]\s*\n", re.M)
if pat.search(text):
    text = pat.sub(line, text, count=1)
else:
    first = re.search(r"^\s*\[", text, re.M)
    at = first.start() if first else len(text)
    text = text[:at] + line + text[at:]
tomllib.loads(text)          # still TOML
tmp = path + ".torpor-tmp"
with open(tmp, "w") as f:
    f.write(text)
os.chmod(tmp, 0o644)
os.replace(tmp, path)
EOF
}

# containerd 2.x reads config version 3 (the CRI runtime plugin is io.containerd.cri.v1.runtime),
# 1.6/1.7 version 2 (io.containerd.grpc.v1.cri); the snippet follows the main config.
write_snippet() {
    local version plugin
    version=$(python_for - "$conf" <<'EOF'
import sys, tomllib
try:
    print(tomllib.load(open(sys.argv[1], "rb")).get("version", 3))
except FileNotFoundError:
    print(3)
EOF
)
    case $version in
        3) plugin='plugins."io.containerd.cri.v1.runtime".containerd.runtimes' ;;
        2) plugin='plugins."io.containerd.grpc.v1.cri".containerd.runtimes' ;;
        *) die "containerd config version $version: torpor knows 2 and 3" ;;
    esac
    install -d -m 0755 "$(dirname "$snippet")"
    cat > "$snippet.tmp" <<EOF
# torpor's runtime handler "$HANDLER" (written by torpor's node installer; removed by its
# uninstall). Pods choose it with runtimeClassName: $HANDLER (packaging/kubernetes/runtimeclass.yaml).
version = $version

[$plugin.$HANDLER]
  runtime_type = "io.containerd.runc.v2"
  # torpor's annotations (org.torpor.agent, .store, .device-map) reach the OCI spec from the
  # pod's or the container's annotations (containerd drops the others); checkpointImage (the
  # CRI restore's image reference): where torpor-runtime fetches the chunks its store lacks
  pod_annotations = ["org.torpor.*"]
  container_annotations = ["org.torpor.*", "checkpointImage"]

[$plugin.$HANDLER.options]
  BinaryName = "$NODE_DIR/bin/torpor-runtime"
EOF
    chmod 0644 "$snippet.tmp"
    mv "$snippet.tmp" "$snippet"
}

restart_containerd() {
    [[ $RESTART == 1 ]] || { say "containerd not restarted (RESTART=$RESTART)"; return 0; }
    say "restarting containerd on the node"
    nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl restart containerd ||
        die "could not restart containerd on the node (the pod needs hostPID and privileges)"
}

case "${1:-}" in
    install)
        say "bundling torpor into $NODE_DIR"
        bundle
        "$dest/bin/torpor" --version >/dev/null 2>&1 || [[ -n $root ]] ||
            die "the bundle does not run: $dest/bin/torpor --version failed"
        write_config
        [[ -f $conf && ! -e $conf.torpor-orig ]] && cp -p "$conf" "$conf.torpor-orig"
        write_snippet
        containerd_import add
        restart_containerd
        say "installed: runtime handler \"$HANDLER\" -> $NODE_DIR/bin/torpor-runtime"
        ;;
    uninstall)
        containerd_import remove
        rm -f "$snippet"
        restart_containerd
        rm -rf "$dest"
        say "uninstalled"
        ;;
    *) die "usage: node-install.sh install|uninstall" ;;
esac
