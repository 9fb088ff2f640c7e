#!/usr/bin/env bash
# Runs the GPU tests and the driver-path benchmark on the GPU host, which has PyTorch and the
# driver but no CRIU and no package access. What it needs travels in ignored folders:
#   .device/criu   CRIU >= 4 bundle (../shared/gpu-host/criu)      -> /opt/criu
#                  (or .device/criu.tar.xz, the same packed: packaging/containerd/gpu-host-bundle.sh)
#   .device/py     CRIU's pycriu, generated for the protobuf below
#   .whl           protobuf, grpcio, zstandard and xxhash wheels (cp312, manylinux)
#   shim/torpor/_proto  proto/generate.py output
#   .device/podman-bundle.tar.xz, .device/gpubase-rootfs.tar   podman 4.3 + runc (../shared/gpu-host)
#   .device/include/xxhash.h   the agent's one build dependency (libxxhash-dev's header)
#   .device/containerd2-bundle.tar.xz   containerd 2 + docker-registry (gpu-host-bundle.sh)
#                  -> /opt/torpor-c2; integration/_cri (test.sh's CRI client) carried with it;
#                  CRI_BENCH_SIZES="4 8" runs bench/cri_path.py (below)
# Usage: tests/gpu/run-on-gpu-host.sh [pytest args...]; BENCH_SIZES="1 8 32" to benchmark the
# driver path, PODMAN_BENCH_SIZES="1 4 16" the podman path, AGENT_BENCH_SIZES="1 16" the
# in-process agent against the driver path (bench/agent_path.py), STORE_BENCH_SIZES="16" the
# agent + image store against the driver path + CRIU (bench/store_e2e.py, training and
# inference programs, or STORE_BENCH_KINDS; more arguments in STORE_BENCH_ARGS, e.g. --no-ends;
# bench/criu_share.py at CRIU_SHARE_MIB, default 8192, 0 for none); CHUNK_WRITES_GIB=16 how fast
# chunks become durable on the disk (bench/chunk_writes.py, CHUNK_WRITES_THREADS); JAX_BENCH=1
# which XLA feature keeps a JAX program from the driver path (bench/jax_driver_path.py);
# UPSTREAM_BENCH_SIZES="4 16" podman + runc + CRIU's cuda plugin + the cuda-checkpoint stand-in
# against torpor's driver, agent and store legs (bench/upstream_path.py; the plugin from
# .device/upstream/cuda_plugin.so, UPSTREAM_BENCH_ARGS for more, e.g. --zstd-sizes);
# MOVER_SWEEP=1 the agent mover's tunings against the pinned-copy limit (bench/mover_sweep.py,
# MOVER_SWEEP_SIZES default "8 16", MOVER_SWEEP_ARGS e.g. --leave-running); TESTS=0 skips the
# tests. AGENT_OVERHEAD_REPS=10 the agent's cost to a training loop and token latency
# (bench/agent_overhead.py; AGENT_OVERHEAD_ARGS for more, e.g. --steps 200). HOST_BOUNDS=1 what
# the host allows the mover: pinned copies, the CPU's copy alone and under DMA, the mover's
# staged shape per sink, cuMemHostRegister per kind of memory (bench/host_bounds.sh; its
# arguments in HOST_BOUNDS_ARGS, default --gib 16 --threads 16; about a minute). PROBE_HELD=1
# whether a program's GPU memory held by another process survives the driver's checkpoint
# (bench/probe_held_memory.c at PROBE_HELD_GIB, default 4: seconds). PROBE_EXPORT=1 what the
# driver's exported descriptors are and whether an imported handle exports again
# (bench/probe_export_identity.c: seconds).
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
OUT="${OUT:-/tmp/torpor-out}"; mkdir -p "$OUT"
criu_bundle=.device/criu
if [[ ! -f .device/criu/install.sh && -f .device/criu.tar.xz ]]; then
    rm -rf /tmp/criu-bundle && mkdir -p /tmp/criu-bundle &&
        tar xJf .device/criu.tar.xz -C /tmp/criu-bundle && criu_bundle=/tmp/criu-bundle/criu
fi
sh "$criu_bundle/install.sh" /opt/criu >/dev/null || { echo "CRIU bundle install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
mkdir -p /etc/criu && echo "network-lock nftables" > /etc/criu/runc.conf
ln -sf /opt/criu/bin/criu /usr/local/sbin/criu   # runc runs `criu` from PATH
# the agent, where the package build would put it (gcc and make are on the GPU host)
make -s -C agent BUILD=/tmp/agent-build EXTRA_CFLAGS="-I$PWD/.device/include" && mkdir -p shim/torpor/_agent &&
    cp /tmp/agent-build/libtorpor-agent.so /tmp/agent-build/torpor-copier shim/torpor/_agent/ ||
    echo "agent build failed"
export PYTHONPATH="/tmp/site:$PWD/shim:$PWD/.device/py:$PWD:$PWD/hooks" TORPOR_CRIU=/opt/criu/bin/criu
export PYTHONUNBUFFERED=1
# podman bundle (podman starts conmon and runc with a clean environment: its wrappers carry
# the library path), and torpor-runtime / torpor-hook as commands, as ./install.sh links them
if [[ -f .device/podman-bundle.tar.xz ]]; then
    tar xJf .device/podman-bundle.tar.xz -C /tmp && sh /tmp/pb/setup.sh /opt/podman-bundle >/dev/null
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/opt/podman-bundle/lib exec /opt/podman-bundle/bin/podman "$@"\n' \
        > /usr/local/bin/podman
    chmod 755 /usr/local/bin/podman
    for cmd in torpor-runtime-py:torpor.runtime.main torpor-hook:torpor_hook; do
        printf '#!/bin/sh\nunset LD_LIBRARY_PATH\nexport PYTHONPATH="%s" TORPOR_CRIU=/opt/criu/bin/criu TORPOR_OCI_RUNTIME=/opt/podman-bundle/bin/runc\nexec %s -m %s "$@"\n' \
            "$PYTHONPATH" "$(command -v python3)" "${cmd#*:}" > "/usr/local/bin/${cmd%%:*}"
        chmod 755 "/usr/local/bin/${cmd%%:*}"
    done
    # torpor-runtime: the native front (shim/front), as ./install.sh installs it
    make -s -C shim/front BUILD=/tmp/front-build || echo "torpor-runtime front build failed"
    printf '#!/bin/sh\nunset LD_LIBRARY_PATH\nexport TORPOR_OCI_RUNTIME=/opt/podman-bundle/bin/runc TORPOR_RUNTIME_PY=/usr/local/bin/torpor-runtime-py\nexec /tmp/front-build/torpor-runtime "$@"\n' \
        > /usr/local/bin/torpor-runtime
    chmod 755 /usr/local/bin/torpor-runtime
fi
# containerd 2 (the CRI tests and bench/cri_path.py start private daemons from
# TORPOR_CONTAINERD2, as integration/cri.py renders packaging/containerd/containerd2.toml):
# its runc handler runs `runc` from PATH (the podman bundle's), torpor's the torpor-runtime
# above. A smoke run first, as install-containerd2.sh sets it up: the config rendered with
# root and state under /var/lib/torpor-c2, the sandbox image imported, CRI's Version; then
# stopped. Where overlay does not mount, containerd's native snapshotter.
if [[ -f .device/containerd2-bundle.tar.xz ]]; then
    rm -rf /tmp/c2 && tar xJf .device/containerd2-bundle.tar.xz -C /tmp &&
        sh /tmp/c2/setup.sh /opt/torpor-c2 >/dev/null || echo "containerd 2 bundle set-up failed"
    export TORPOR_CONTAINERD2=/opt/torpor-c2 TORPOR_DOCKER_REGISTRY=/opt/torpor-c2/bin/docker-registry
    command -v openssl >/dev/null && command -v htpasswd >/dev/null ||
        export TORPOR_REGISTRY_TLS=/opt/torpor-c2/share/registry-tls
    [[ -e /usr/local/bin/runc || ! -x /opt/podman-bundle/bin/runc ]] ||
        ln -s /opt/podman-bundle/bin/runc /usr/local/bin/runc
    [[ -f integration/_cri/api_pb2.py ]] || python3 proto/generate_cri.py ||
        echo "no CRI client: carry integration/_cri (test.sh generates it)"
    o=$(mktemp -d /var/tmp/torpor-ovl.XXXXXX) && mkdir "$o"/{l,u,w,m} &&   # overlay here?
        { mount -t overlay overlay -o "lowerdir=$o/l,upperdir=$o/u,workdir=$o/w" "$o/m" 2>/dev/null &&
          umount "$o/m"; } || export TORPOR_CONTAINERD2_SNAPSHOTTER=native
    rm -rf "$o"
    python3 tests/gpu/containerd2_smoke.py /var/lib/torpor-c2 2>&1 | tee "$OUT/containerd2-smoke.txt"
fi
python3 -m torpor.cli.main doctor 2>&1 | tee "$OUT/doctor.txt"
rc=0
if [[ "${TESTS:-1}" != 0 ]]; then
    where=(tests/gpu)   # unless the arguments name tests themselves (node IDs, files)
    for a in "$@"; do [[ "$a" == tests/* ]] && where=(); done
    python3 -m pytest -p no:cacheprovider -ra -v "${where[@]}" "$@" 2>&1 | tee "$OUT/gpu-tests.txt"
    rc=${PIPESTATUS[0]}
fi
if [[ -n "${BENCH_SIZES:-}" ]]; then
    python3 bench/driver_path.py --sizes $BENCH_SIZES --images-root /tmp/torpor-bench \
        --out "$OUT/driver_path.json" 2>&1 | tee "$OUT/bench.txt"
fi
if [[ -n "${PODMAN_BENCH_SIZES:-}" ]]; then
    python3 bench/podman_path.py --sizes $PODMAN_BENCH_SIZES --workdir /tmp/torpor-pbench \
        --runc /opt/podman-bundle/bin/runc \
        --out "$OUT/podman_path.json" 2>&1 | tee "$OUT/podman-bench.txt"
fi
# CRI CheckpointContainer + CreateContainer-restore through containerd 2 + torpor against podman
# export/import, and registry push/pull (bench/cri_path.py); legs that would end past
# CRI_BENCH_BUDGET_S (default 450 s) are skipped; CRI_BENCH_ARGS for more
if [[ -n "${CRI_BENCH_SIZES:-}" ]]; then
    python3 bench/cri_path.py --sizes $CRI_BENCH_SIZES --workdir /var/tmp/torpor-cbench \
        --runtime /usr/local/bin/torpor-runtime --budget-s "${CRI_BENCH_BUDGET_S:-450}" \
        ${CRI_BENCH_ARGS:-} --out "$OUT/cri_path.json" 2>&1 | tee "$OUT/cri-bench.txt"
fi
if [[ -n "${AGENT_BENCH_SIZES:-}" ]]; then
    python3 bench/agent_path.py --sizes $AGENT_BENCH_SIZES --shm-root /dev/shm/torpor-abench \
        --disk-root /var/tmp/torpor-abench ${AGENT_BENCH_ARGS:-} \
        --out "$OUT/agent_path.json" 2>&1 | tee "$OUT/agent-bench.txt"
fi
if [[ -n "${STORE_BENCH_SIZES:-}" ]]; then
    python3 bench/store_e2e.py --sizes $STORE_BENCH_SIZES --kinds ${STORE_BENCH_KINDS:-torch infer} \
        --root /var/tmp/torpor-sbench ${STORE_BENCH_ARGS:-} \
        --out "$OUT/store_e2e.json" 2>&1 | tee "$OUT/store-bench.txt"
    if [[ "${CRIU_SHARE_MIB:-8192}" != 0 ]]; then
        python3 bench/criu_share.py --mib "${CRIU_SHARE_MIB:-8192}" --repeat 2 \
            --disk /var/tmp/torpor-criu-bench --out "$OUT/criu_share.json" 2>&1 \
            | tee "$OUT/criu-share.txt"
    fi
fi
if [[ -n "${JAX_BENCH:-}" ]]; then
    python3 bench/jax_driver_path.py --root /var/tmp/torpor-jax --out "$OUT/jax_driver_path.json" \
        2>&1 | tee "$OUT/jax-bench.txt"
fi
if [[ -n "${UPSTREAM_BENCH_SIZES:-}${UPSTREAM_BENCH_ARGS:-}" ]]; then   # ARGS alone: e.g. --cache-gib 4
    make -s -C bench/upstream BUILD=/tmp/upstream-build &&
    python3 bench/upstream_path.py --sizes ${UPSTREAM_BENCH_SIZES:-} --plugin-dir .device/upstream \
        --standin /tmp/upstream-build/cuda-checkpoint --runc /opt/podman-bundle/bin/runc \
        --workdir /var/tmp/torpor-ubench ${UPSTREAM_BENCH_ARGS:-} \
        --out "$OUT/upstream_path.json" 2>&1 | tee "$OUT/upstream-bench.txt"
fi
if [[ -n "${HOST_BOUNDS:-}" && "${HOST_BOUNDS}" != 0 ]]; then
    OUT="$OUT" bench/host_bounds.sh ${HOST_BOUNDS_ARGS:-} || echo "host_bounds failed"
fi
if [[ -n "${PROBE_HELD:-}" && "${PROBE_HELD}" != 0 ]]; then
    gcc -O2 bench/probe_held_memory.c -ldl -o /tmp/probe_held_memory &&
        /tmp/probe_held_memory --gib "${PROBE_HELD_GIB:-4}" > "$OUT/probe_held_memory.json" \
        2> >(tee "$OUT/probe-held-memory.txt" >&2)
fi
if [[ -n "${PROBE_EXPORT:-}" && "${PROBE_EXPORT}" != 0 ]]; then
    gcc -O1 bench/probe_export_identity.c -ldl -o /tmp/probe_export_identity &&
        /tmp/probe_export_identity 2>&1 | tee "$OUT/probe-export-identity.txt"
fi
if [[ -n "${MOVER_SWEEP:-}" && "${MOVER_SWEEP}" != 0 ]]; then
    python3 bench/mover_sweep.py --sizes ${MOVER_SWEEP_SIZES:-8 16} ${MOVER_SWEEP_ARGS:-} \
        --out "$OUT/mover_sweep.json" 2>&1 | tee "$OUT/mover-sweep.txt"
fi
if [[ -n "${CHUNK_WRITES_GIB:-}" ]]; then
    python3 bench/chunk_writes.py --gib "$CHUNK_WRITES_GIB" --threads ${CHUNK_WRITES_THREADS:-16} \
        --root /var/tmp/torpor-cw --out "$OUT/chunk_writes.json" 2>&1 | tee "$OUT/chunk-writes.txt"
fi
if [[ -n "${AGENT_OVERHEAD_REPS:-}" ]]; then   # what the agent costs a running program
    python3 bench/agent_overhead.py --reps "$AGENT_OVERHEAD_REPS" ${AGENT_OVERHEAD_ARGS:-} \
        --out "$OUT/agent_overhead.json" 2>&1 | tee "$OUT/agent-overhead.txt"
fi
# torpor's logs as one file: the device tool brings back at most 8 files, and four logs beside
# the results once crowded out store_e2e.json
tar czf "$OUT/torpor-logs.tar.gz" -C /var/lib/torpor $(cd /var/lib/torpor 2>/dev/null && ls *.log) 2>/dev/null
exit "$rc"
