#!/usr/bin/env bash
# fetch_old_glibc.sh DEST: Debian 11's glibc (2.31, Ubuntu 20.04's) extracted under DEST
# (DEST/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2, libc.so.6, ..., DEST/usr/bin/getconf), for
# tests/unit/test_agent_glibc.py's run of the agent under an older glibc:
#   tests/fakes/fetch_old_glibc.sh /tmp/glibc-2.31 && TORPOR_OLD_GLIBC=/tmp/glibc-2.31 ./test.sh ...
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
(cd "$apt/debs" && apt-get "${opts[@]}" -qq download libc6 libc-bin)
for deb in "$apt"/debs/*.deb; do dpkg-deb -x "$deb" "$dest"; done
"$dest/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$dest/lib/x86_64-linux-gnu" \
    "$dest/usr/bin/getconf" GNU_LIBC_VERSION
