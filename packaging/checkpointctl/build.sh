#!/usr/bin/env bash
# Build checkpointctl from Debian's source package, for Debian 12, into DEST (default
# /usr/local/bin/checkpointctl). Debian ships it only in unstable, linked against a newer libc;
# this builds Debian's 1.3.0 source (its patches applied) with bookworm-backports' Go 1.23 and
# the Go libraries as Debian packages them (GOPATH mode, as dh-golang does). Three of unstable's
# libraries need Go 1.24 (the "weak" package, strings.SplitSeq), so bookworm's are used for
# those: klauspost/compress 1.15, cespare/xxhash 2.1, containers/storage 1.43 (checkpointctl
# uses only its archive package). Nothing is installed through dpkg: apt reads its own lists in a
# temporary directory, the .debs are only unpacked there. Used by ./install.sh (optional) and by
# tests/integration/test_registry.py's checkpointctl test (docs/registries.md).
set -Eeuo pipefail
DEST="${1:-/usr/local/bin/checkpointctl}"
work=$(mktemp -d /tmp/torpor-checkpointctl.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"
mkdir -p lists/partial debs root src
cat > sources.list <<'LIST'
deb http://deb.debian.org/debian unstable main
deb-src http://deb.debian.org/debian unstable main
deb http://deb.debian.org/debian bookworm-backports main
LIST
APT=(-o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o Dir::State::Lists="$work/lists" -o APT::Sandbox::User=root)
apt-get "${APT[@]}" update -qq
(cd src && apt-get "${APT[@]}" source --download-only -qq checkpointctl >/dev/null 2>&1 || true)
ls src/*.orig.tar.* src/*.debian.tar.* >/dev/null || { echo "checkpointctl source not found" >&2; exit 1; }
UNSTABLE=(golang-github-checkpoint-restore-go-criu-dev golang-github-docker-go-units-dev
          golang-github-klauspost-pgzip-dev golang-github-moby-sys-dev
          golang-github-opencontainers-runc-dev golang-github-opencontainers-specs-dev
          golang-github-sirupsen-logrus-dev golang-github-spf13-cobra-dev
          golang-github-spf13-pflag-dev golang-github-ulikunitz-xz-dev
          golang-github-xlab-treeprint-dev golang-gocapability-dev golang-golang-x-net-dev
          golang-golang-x-sys-dev golang-google-protobuf-dev)
(cd debs && apt-get "${APT[@]}" download -qq "${UNSTABLE[@]}" golang-1.23-go golang-1.23-src)
# bookworm's, from the system's own lists
(cd debs && apt-get download -qq golang-github-klauspost-compress-dev/bookworm \
    golang-github-cespare-xxhash-dev/bookworm golang-github-containers-storage-dev/bookworm)
for deb in debs/*.deb; do dpkg-deb -x "$deb" root; done
mkdir -p gopath/src/github.com/checkpoint-restore
tar -xf src/*.orig.tar.* -C src && tar -xf src/*.debian.tar.* -C src
pkg=gopath/src/github.com/checkpoint-restore/checkpointctl
mv src/checkpointctl-*/ "$pkg"
if [[ -f src/debian/patches/series ]]; then
    while read -r p; do [[ -n "$p" && "$p" != \#* ]] && patch -s -d "$pkg" -p1 < "src/debian/patches/$p"; done < src/debian/patches/series
fi
(cd "$pkg" && GOROOT="$work/root/usr/lib/go-1.23" GOPATH="$work/gopath:$work/root/usr/share/gocode" \
    GO111MODULE=off GOFLAGS= GOTOOLCHAIN=local GOCACHE="$work/cache" \
    "$work/root/usr/lib/go-1.23/bin/go" build -trimpath -o "$work/checkpointctl" .)
install -D -m 0755 "$work/checkpointctl" "$DEST"
"$DEST" --help >/dev/null
