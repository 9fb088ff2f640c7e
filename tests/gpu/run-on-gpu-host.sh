#!/usr/bin/env bash
# Runs the GPU tests and the driver-path benchmark on the GPU host, which has PyTorch and the
# driver but no CRIU and no package access. What it needs travels in ignored folders:
#   .device/criu   CRIU >= 4 bundle (../shared/gpu-host/criu)      -> /opt/criu
#   .device/py     CRIU's pycriu, generated for the protobuf below
#   .whl           protobuf and grpcio wheels matching the generated modules
#   shim/torpor/_proto  proto/generate.py output
# Usage: tests/gpu/run-on-gpu-host.sh [pytest args...]; BENCH_SIZES="1 8 32" to benchmark.
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
OUT="${OUT:-/tmp/torpor-out}"; mkdir -p "$OUT"
sh .device/criu/install.sh /opt/criu >/dev/null || { echo "CRIU bundle install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
mkdir -p /etc/criu && echo "network-lock nftables" > /etc/criu/runc.conf
export PYTHONPATH="/tmp/site:$PWD/shim:$PWD/.device/py:$PWD" TORPOR_CRIU=/opt/criu/bin/criu
export PYTHONUNBUFFERED=1
python3 -m torpor.cli.main doctor 2>&1 | tee "$OUT/doctor.txt"
python3 -m pytest -p no:cacheprovider -ra -v tests/gpu "$@" 2>&1 | tee "$OUT/gpu-tests.txt"
rc=${PIPESTATUS[0]}
if [[ -n "${BENCH_SIZES:-}" ]]; then
    python3 bench/driver_path.py --sizes $BENCH_SIZES --images-root /tmp/torpor-bench \
        --out "$OUT/driver_path.json" 2>&1 | tee "$OUT/bench.txt"
fi
exit "$rc"
