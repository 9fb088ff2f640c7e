#!/usr/bin/env bash
# fetch_old_glibc.sh DEST: Debian 11's glibc (2.31, Ubuntu 20.04's) extracted under DEST
# (DEST/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2, libc.so.6, ..., DEST/usr/bin/getconf), for
# tests/unit/test_agent_glibc.py's run of the agent under an older glibc:
#   tests/fakes/fetch_old_glibc.sh /tmp/glibc-2.31 && TORPOR_OLD_GLIBC=/tmp/glibc-2.31 ./test.sh ...
# SUITE=unstable PACKAGES="libc6 libc-bin libc6-dev linux-libc-dev" fetches a newer one, with
# its headers, for the build against a glibc newer than this machine's (TORPOR_NEW_GLIBC).
# apt-get with private lists and cache under DEST/.apt: the system's apt state is not touched.
set -Eeuo pipefail
dest=$(realpath -m "${1:?usage: fetch_old_glibc.sh DEST}")
suite=${SUITE:-bullseye}
apt="$dest/.apt"
mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs"
touch "$apt/status"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" \
    > "$apt/sources.list"
opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o "Dir::Etc::sourceparts=/nonexistent"
      -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o "Dir::State::status=$apt/status"
      -o "APT::Sandbox::User=root")
apt-get "${opts[@]}" -qq update
read -r -a packages <<<"${PACKAGES:-libc6 libc-bin}"
(cd "$apt/debs" && apt-get "${opts[@]}" -qq download "${packages[@]}")
for deb in "$apt"/debs/*.deb; do dpkg-deb -x "$deb" "$dest"; done
# a merged /usr (bookworm on): the paths its linker scripts name, as the system has them
for d in lib lib64; do
    [[ -e "$dest/$d" || ! -d "$dest/usr/$d" ]] || ln -s "usr/$d" "$dest/$d"
done
"$dest/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$dest/lib/x86_64-linux-gnu" \
    "$dest/usr/bin/getconf" GNU_LIBC_VERSION
