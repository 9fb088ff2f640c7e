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
"$PREFIX/bin/python" -m pip install -q --force-reinstall --no-deps . >/dev/null
"$PREFIX/bin/python" -m pip install -q pytest hypothesis kubernetes-validate >/dev/null
make -s -C tests/fakes >/dev/null
# the CRI client of tests/integration/test_cri.py (from containerd 2's api.proto, if installed)
"$PREFIX/bin/python" proto/generate_cri.py >/dev/null

exec "$PREFIX/bin/python" -m pytest -p no:cacheprovider -ra "${@:-tests}"
