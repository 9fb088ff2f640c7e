#!/usr/bin/env bash
# ./test.sh: every test. Installs torpor first when it is not installed (./install.sh), then
# reinstalls this tree into torpor's venv so the tests exercise what a user gets.
#   tests/unit          fast; fakes for the driver and NVML
#   tests/integration   real CRIU dumps/restores, the real torpord socket, fake GPU
#   tests/gpu           real GPU (skipped without one; run on the GPU host)
# Extra arguments go to pytest, e.g. ./test.sh tests/unit -k manifest
set -Eeuo pipefail
cd "$(dirname "$(readlink -f "$0")")"
PREFIX="${TORPOR_PREFIX:-/opt/torpor/venv}"

has_criu() { [[ -x /usr/local/sbin/criu ]] || command -v criu >/dev/null; }
if [[ ! -x "$PREFIX/bin/torpor" ]] || ! has_criu; then
    ./install.sh
fi
# the build compiles the protos with the newest grpcio-tools 1.85.x (pyproject.toml), whose code
# needs a grpcio at least as new: a venv made before that release gets it too
"$PREFIX/bin/python" -m pip install -q --upgrade "grpcio>=1.85,<1.86" >/dev/null
"$PREFIX/bin/python" -m pip install -q --force-reinstall --no-deps . >/dev/null
"$PREFIX/bin/python" -m pip install -q pytest hypothesis kubernetes-validate >/dev/null
make -s -C tests/fakes >/dev/null
# an older glibc (Debian 11's 2.31, Ubuntu 20.04's) for the agent's load test
# (tests/unit/test_agent_glibc.py); fetched once, the test skips if it cannot be had
OLD_GLIBC=/var/cache/torpor/glibc-2.31
if [[ -z "${TORPOR_OLD_GLIBC:-}" ]]; then
    [[ -x $OLD_GLIBC/usr/bin/getconf ]] ||
        timeout 300 bash tests/fakes/fetch_old_glibc.sh "$OLD_GLIBC" >/dev/null 2>&1 ||
        echo "test.sh: no older glibc could be fetched; the agent's old-glibc load test skips" >&2
    [[ -x $OLD_GLIBC/usr/bin/getconf ]] && export TORPOR_OLD_GLIBC=$OLD_GLIBC
fi
# a newer glibc with its headers (Debian unstable's), for the agent's build against one: hosts of
# glibc >= 2.38 redirect functions to symbols no older glibc has (tests/unit/test_agent_glibc.py)
NEW_GLIBC=/var/cache/torpor/glibc-unstable
if [[ -z "${TORPOR_NEW_GLIBC:-}" ]]; then
    [[ -e $NEW_GLIBC/usr/include/stdlib.h && -x $NEW_GLIBC/usr/bin/getconf ]] ||
        { rm -rf "$NEW_GLIBC"; SUITE=unstable PACKAGES="libc6 libc-bin libc6-dev linux-libc-dev" \
            timeout 300 bash tests/fakes/fetch_old_glibc.sh "$NEW_GLIBC" >/dev/null 2>&1; } ||
        echo "test.sh: no newer glibc could be fetched; the agent's newer-glibc build test skips" >&2
    [[ -e $NEW_GLIBC/usr/include/stdlib.h ]] && export TORPOR_NEW_GLIBC=$NEW_GLIBC
fi
# the CRI client of tests/integration/test_cri.py (from containerd 2's api.proto, if installed)
"$PREFIX/bin/python" proto/generate_cri.py >/dev/null

exec "$PREFIX/bin/python" -m pytest -p no:cacheprovider -ra "${@:-tests}"
