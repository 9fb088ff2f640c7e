#!/usr/bin/env bash
# bench/host_bounds.c on the GPU host, as the mover meets it: into a tmpfs mounted like
# torpor's suspend_dir (huge=within_size), with hugetlbfs pages reserved for the register test
# and the host's setting put back after. Needs root, gcc and the driver; no CRIU, no Python.
#   OUT=/tmp/out bench/host_bounds.sh [host_bounds args...]      (default: --gib 16 --threads 16)
# writes $OUT/host_bounds.json (and .txt: a line a measurement).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
OUT="${OUT:-/tmp/torpor-out}"; mkdir -p "$OUT"
bin=$(mktemp -d)/host_bounds
gcc -O2 -pthread bench/host_bounds.c -ldl -o "$bin"
mnt=$(mktemp -d /dev/shm/torpor-bounds.XXXXXX)   # a mount point, not a place to write into
mount -t tmpfs -o size=100%,mode=0700,huge=within_size torpor-bounds "$mnt"
pages_before=$(cat /proc/sys/vm/nr_hugepages)
want=$(( ${HOST_BOUNDS_HUGETLB_GIB:-4} * 512 ))    # 2 MiB pages for the register test
echo "$want" > /proc/sys/vm/nr_hugepages || true
echo "hugetlbfs pages reserved: $(cat /proc/sys/vm/nr_hugepages) of $want asked" >&2
trap 'echo "$pages_before" > /proc/sys/vm/nr_hugepages; umount "$mnt"; rmdir "$mnt"' EXIT
args=("$@"); [[ ${#args[@]} -gt 0 ]] || args=(--gib 16 --threads 16)
"$bin" "${args[@]}" --dir "$mnt" > "$OUT/host_bounds.json" 2> >(tee "$OUT/host_bounds.txt" >&2)
