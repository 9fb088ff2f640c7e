#!/usr/bin/env bash
# gpu-host-bundle.sh: pack containerd 2 (as install-containerd2.sh installed it here) and
# Debian's docker-registry for the GPU test host, which has no package access and takes at
# most 64 MiB of carried files (tests/gpu/run-on-gpu-host.sh sets it up from there).
#
#   packaging/containerd/gpu-host-bundle.sh [OUT_DIR]        (default .device)
#
# Writes OUT_DIR/containerd2-bundle.tar.xz, one tree c2/:
#   bin/containerd, bin/containerd-shim-runc-v2, bin/ctr (integration/cri.py imports the
#   sandbox image with it), bin/docker-registry      unmodified Debian binaries (already
#                                                    stripped); Go links only libc
#   share/images/torpor-pause.tar, torpor-busybox.tar  the locally built images
#   share/cri-api/api.proto, share/doc/*.copyright
#   share/registry-tls/{ca.crt,server.crt,server.key,htpasswd}  for the test registry (below)
#   setup.sh PREFIX                                  copies the tree to PREFIX (default
#                                                    /opt/torpor-c2) and checks it runs
# The binaries are Go programs that share much of their runtime and libraries: one xz stream
# with a dictionary larger than the tree (-9e, dict 192 MiB) stores containerd, the shim and
# docker-registry in 16.7 MB where xz'd apart they take 20.1 MB (15.2 + 4.9); ctr adds 2.2 MB,
# the images and the rest 0.9 MB: 19.8 MB in all (measured 2026-12-04; decompressing needs
# ~200 MiB of memory). Re-packing the podman bundle into the same stream would save 4 MB more
# (29.4 MB for both against 33.4 MB), but the podman set-up reads its own file; packing CRIU's
# directory (CRIU_DIR below) saves 10 MB.
# With CRIU_DIR (a CRIU bundle directory, e.g. ../shared/gpu-host/criu) it also writes
# OUT_DIR/criu.tar.xz (14 MB -> 4.4 MB): run-on-gpu-host.sh takes it in place of .device/criu.
# Environment: TORPOR_CONTAINERD2 (where containerd 2 is installed, default
# /opt/torpor/containerd2), DOCKER_REGISTRY (default /usr/bin/docker-registry).
set -Eeuo pipefail
OUT="$(readlink -f "${1:-.device}")"
SRC="${TORPOR_CONTAINERD2:-/opt/torpor/containerd2}"
REG="${DOCKER_REGISTRY:-/usr/bin/docker-registry}"
die() { printf 'gpu-host-bundle: error: %s\n' "$*" >&2; exit 1; }
for f in bin/containerd bin/containerd-shim-runc-v2 bin/ctr share/images/torpor-pause.tar \
         share/images/torpor-busybox.tar share/cri-api/api.proto; do
    [[ -f "$SRC/$f" ]] || die "$SRC/$f missing (packaging/containerd/install-containerd2.sh)"
done
[[ -x "$REG" ]] || die "$REG missing (apt-get install docker-registry)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
c2="$work/c2"
install -d "$c2/bin" "$c2/share/images" "$c2/share/cri-api" "$c2/share/doc"
cp "$SRC"/bin/{containerd,containerd-shim-runc-v2,ctr} "$REG" "$c2/bin/"
cp "$SRC"/share/images/torpor-{pause,busybox}.tar "$c2/share/images/"
cp "$SRC/share/cri-api/api.proto" "$c2/share/cri-api/"
cp "$SRC"/share/doc/* "$c2/share/doc/" 2>/dev/null || true
[[ -f /usr/share/doc/docker-registry/copyright ]] &&
    cp /usr/share/doc/docker-registry/copyright "$c2/share/doc/docker-registry.copyright"
# the test registry's TLS (a CA made here, a server certificate for localhost/127.0.0.1, 30
# days) and htpasswd (tests/integration/registry_server.py's test user): the GPU host may have
# neither openssl nor htpasswd; TORPOR_REGISTRY_TLS=PREFIX/share/registry-tls. Test-only keys.
tls="$c2/share/registry-tls"
install -d -m 0700 "$tls"
(cd "$tls" &&
 openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 \
     -subj "/CN=torpor GPU-host test CA" 2>/dev/null &&
 openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost 2>/dev/null &&
 printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >san.cnf &&
 openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt \
     -days 30 -extfile san.cnf 2>/dev/null &&
 rm -f ca.key ca.srl server.csr san.cnf &&
 htpasswd -Bbn torpor s3cret-pass >htpasswd) || die "making the registry's TLS files failed"
"$SRC/bin/containerd" --version >"$c2/VERSION"
dpkg-query -W -f='docker-registry ${Version}\n' docker-registry >>"$c2/VERSION" 2>/dev/null || true
cat >"$c2/setup.sh" <<'EOF'
#!/bin/sh
# Installs this containerd 2 + docker-registry bundle under PREFIX (default /opt/torpor-c2):
# PREFIX/bin/{containerd,containerd-shim-runc-v2,ctr,docker-registry}, PREFIX/share/images
# (the sandbox and base images), PREFIX/share/cri-api/api.proto. Nothing goes on PATH; point
# TORPOR_CONTAINERD2 at PREFIX (integration/cri.py renders packaging/containerd/
# containerd2.toml for its private daemons from there).
set -eu
here=$(cd "$(dirname "$0")" && pwd); P=${1:-/opt/torpor-c2}
mkdir -p "$P"
cp -r "$here/bin" "$here/share" "$here/VERSION" "$P/"
chmod 700 "$P/share/registry-tls"
chmod 755 "$P"/bin/*
"$P/bin/containerd" --version
"$P/bin/docker-registry" --version
EOF
chmod 755 "$c2/setup.sh"
mkdir -p "$OUT"
# binaries first, then the rest: the Go programs sit next to each other in the stream
(cd "$work" && tar --owner=0 --group=0 --sort=name -cf - c2/bin c2/share c2/VERSION c2/setup.sh) |
    xz -9e --lzma2=preset=9e,dict=192MiB -T1 -c >"$OUT/containerd2-bundle.tar.xz.new"
mv -f "$OUT/containerd2-bundle.tar.xz.new" "$OUT/containerd2-bundle.tar.xz"
printf 'gpu-host-bundle: %s: %s bytes\n' "$OUT/containerd2-bundle.tar.xz" \
    "$(stat -c %s "$OUT/containerd2-bundle.tar.xz")"
if [[ -n "${CRIU_DIR:-}" ]]; then
    [[ -f "$CRIU_DIR/install.sh" ]] || die "$CRIU_DIR is not a CRIU bundle (no install.sh)"
    tar --owner=0 --group=0 --sort=name -cf - -C "$(dirname "$(readlink -f "$CRIU_DIR")")" \
        --transform 's#^[^/]*#criu#' "$(basename "$(readlink -f "$CRIU_DIR")")" |
        xz -9e -T1 -c >"$OUT/criu.tar.xz.new"
    mv -f "$OUT/criu.tar.xz.new" "$OUT/criu.tar.xz"
    printf 'gpu-host-bundle: %s: %s bytes\n' "$OUT/criu.tar.xz" "$(stat -c %s "$OUT/criu.tar.xz")"
fi
