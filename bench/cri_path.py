#!/usr/bin/env python3
"""Benchmark: the kubelet's checkpoint path through containerd 2.x's CRI + torpor, against podman
export/import of the same container, and checkpoint images through a registry, in one run:

  cri       a pod through the torpor runtime handler (integration/cri_gpu.py: a private
            containerd 2, the GPU from the node's CDI spec): CheckpointContainer into the
            kubelet's archive (the container runs on), RemovePodSandbox, then a new pod's
            CreateContainer from the archive and StartContainer
  podman    podman container checkpoint --export / restore --import (--compress none) through
            torpor-runtime (bench/podman_path.py's torpor path), the same program and seed
  registry  (--registry-gib, default 2; 0: none) org.torpor.store=on: two
            CheckpointContainer of one training pod a few steps apart, each `torpor image
            build` + `torpor image push` to Debian's docker-registry (TLS, htpasswd), then
            `torpor image pull` of each into a second node's empty store: seconds and bytes
            (the second push must send <= 10 % of the first: only the chunks that changed)

Both restored programs (cri and podman) train the same seed: their steps files must agree
(bit_exact). Archives are deleted after each leg (the GPU host's disk is 64 GB). JSON to --out,
rewritten after each leg, so a run cut short keeps what it measured.

    python3 bench/cri_path.py --sizes 4 8 --workdir /var/tmp/torpor-cbench --out cri_path.json
        [--registry-gib 2] [--budget-s 480] [--no-podman] [--runtime torpor-runtime]
        [--cpu]   (tests/gpu/cpu_program.py, no GPU, no podman leg: a rehearsal of the harness)

Time on an H200 (disk 1.4-1.9 GB/s; podman_path measured 13.6 s + 12.7 s for 4 GiB): about
45 s + 7 s/GiB per size and path (a program start, a checkpoint, a restore, a few steps) and
40 s + 10 s/GiB for the registry leg: --sizes 4 8 with the registry at 2 GiB about 6.5 min
(the set-up of run-on-gpu-host.sh not counted); it prints its own estimate first. --budget-s
skips a leg that would end past it (the GPU host's commands stop at 10 min), saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT), str(ROOT / "bench")]

from integration import cri  # noqa: E402
from integration.cri_gpu import CPU_PROGRAM, CriTorch, GpuNode  # noqa: E402
from integration.gpu import TORCH_PROGRAM  # noqa: E402
from integration.oci_registry import LayoutRegistry  # noqa: E402
from tests.gpu.compare_steps import compare  # noqa: E402

GB = 1e9
SEED = 4321


def leg_s(gib: float, registry: bool = False) -> float:
    """Estimated seconds of one leg on the H200 (module docstring)."""
    return 40 + 10 * gib if registry else 45 + 7 * gib


def estimate_s(sizes: list[float], podman: bool, registry_gib: float) -> float:
    legs = 2 if podman else 1
    return sum(legs * leg_s(g) for g in sizes) + (leg_s(registry_gib, True) if registry_gib else 0)


def _manifest(archive: Path) -> dict:
    """The archive's torpor.json ({} where torpor-runtime passed the checkpoint to runc: a
    container without GPU state, as in --cpu)."""
    with tarfile.open(archive) as tf:
        try:
            f = tf.extractfile("checkpoint/torpor.json")
        except KeyError:
            return {}
        return json.loads(f.read()) if f else {}


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def cri_leg(node: GpuNode, gib: float, work: Path, program: Path, gpu: bool) -> dict:
    """CheckpointContainer + CreateContainer-restore of one pod; its figures."""
    tc = CriTorch(node, f"cri-{gib:g}", work, gib, seed=SEED, program=program, gpu=gpu)
    out: dict = {"path": "cri", "gib": gib}
    t = time.perf_counter()
    tc.run("torpor")
    tc.wait_ready(600)
    out["start_ready_s"] = time.perf_counter() - t
    tc.wait_step(5)
    pid = node.cri.pid(tc.cid)
    t = time.perf_counter()
    archive = node.checkpoint(tc)
    out["checkpoint_s"] = time.perf_counter() - t
    out["archive_bytes"] = archive.stat().st_size
    m = _manifest(archive)
    out["torpor_timings"] = m.get("timings")
    out["gpu_memory"] = (m.get("sizes") or {}).get("gpu_memory")
    out["agent_bytes"] = sum(a.get("bytes", 0) for a in (m.get("agent") or {}).values())
    at = tc.step()
    tc.remove()
    t = time.perf_counter()
    tc.create("torpor", image=str(archive))
    out["create_s"] = time.perf_counter() - t
    t = time.perf_counter()
    node.cri.start(tc.cid)
    out["start_s"] = time.perf_counter() - t
    out["restore_total_s"] = out["create_s"] + out["start_s"]
    out["end_to_end_s"] = out["checkpoint_s"] + out["restore_total_s"]
    out["new_pid_differs"] = node.cri.pid(tc.cid) != pid
    out["restored"] = node.cri.status(tc.cid).status.annotations.get("restored") == "true"
    tc.wait_step(at + 5, timeout=600)
    out["steps_file"] = str(tc.steps)
    tc.remove()
    archive.unlink(missing_ok=True)
    return out


def podman_leg(runtime: str, gib: float, work: Path) -> dict:
    """bench/podman_path.py's torpor path (export/import, --compress none)."""
    import podman_path
    from integration.containers import Podman
    from torpor import config
    pm = Podman(runtime, timeout=3000)
    pm.ensure_image()
    cfg = config.load()
    out = podman_path.run_one("torpor", pm, None, gib, "none", work,
                              int(cfg.lock_timeout_s * 1000))
    out["path"] = "podman"
    return out


def _torpor(env: dict[str, str], *args: str) -> tuple[dict, float]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "torpor.cli.main", "--json", *args], env=env,
                       capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"torpor {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return json.loads(r.stdout), time.perf_counter() - t


def registry_leg(node: GpuNode, gib: float, work: Path, program: Path, gpu: bool) -> dict:
    """Two store checkpoints of one training pod through the registry; seconds and bytes."""
    from tests.integration.registry_server import Registry
    work.mkdir(parents=True, exist_ok=True)
    reg = Registry(work / "registry").start()
    env_a = dict(os.environ)
    env_b = {**os.environ, "TORPOR_STORE_DIR": str(work / "store-b"),
             "TORPOR_STATE_DIR": str(work / "b-state"), "TORPOR_RUN_DIR": str(work / "b-run")}
    out: dict = {"gib": gib, "checkpoints": []}
    tc = CriTorch(node, f"reg-{gib:g}", work / "prog", gib, seed=SEED, program=program, gpu=gpu,
                  annotations={"org.torpor.store": "on"})
    try:
        tc.run("torpor")
        tc.wait_ready(600)
        tc.wait_step(5)
        for i in (1, 2):
            c: dict = {"n": i, "step": tc.step()}
            t = time.perf_counter()
            archive = node.checkpoint(tc)
            c["checkpoint_s"] = time.perf_counter() - t
            c["archive_bytes"] = archive.stat().st_size
            layout = work / f"layout-{i}"
            built, c["build_s"] = _torpor(env_a, "image", "build", str(archive), "-o",
                                          str(layout), "--name", tc.name)
            c.update(layer_bytes=built["layer_bytes"], chunks=built["chunks"],
                     chunk_bytes=built["chunk_bytes"])
            archive.unlink()
            ref = f"{reg.host}/ckpt/{tc.name}:v{i}"
            pushed, c["push_s"] = _torpor(env_a, "image", "push", str(layout), ref, *reg.args())
            c.update(bytes_sent=pushed["bytes_sent"], bytes_total=pushed["bytes_total"],
                     uploaded_blobs=pushed["uploaded_blobs"], skipped_blobs=pushed["skipped_blobs"])
            shutil.rmtree(layout, ignore_errors=True)
            c["ref"] = ref
            out["checkpoints"].append(c)
            print(json.dumps(c), flush=True)
            if i == 1:
                tc.wait_step(tc.step() + 5, timeout=600)   # it trains on: a few steps change
        tc.remove()
        for c in out["checkpoints"]:                     # node B, its store empty at first
            dest = work / f"pulled-{c['n']}"
            pulled, c["pull_s"] = _torpor(env_b, "image", "pull", c["ref"], "-D", str(dest),
                                          *reg.args())
            c.update(bytes_received=pulled["bytes_received"],
                     chunks_fetched=pulled["chunks_fetched"],
                     chunks_from_store=pulled["chunks_from_store"])
            shutil.rmtree(dest, ignore_errors=True)
        first, second = out["checkpoints"]
        out["second_push_ratio"] = second["bytes_sent"] / max(first["bytes_sent"], 1)
        out["second_pull_ratio"] = second["bytes_received"] / max(first["bytes_received"], 1)
        out["second_push_within_10pct"] = out["second_push_ratio"] <= 0.10
        out["registry_bytes"] = _tree_bytes(reg.storage)
    finally:
        tc.remove()
        reg.kill()
        for d in ("registry", "store-b", "b-state", "b-run", "prog"):
            shutil.rmtree(work / d, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[4, 8], help="GiB held")
    ap.add_argument("--registry-gib", type=float, default=2,
                    help="size of the registry leg (0: none)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="skip a leg whose estimate would end the run past this (0: no limit)")
    ap.add_argument("--no-podman", action="store_true")
    ap.add_argument("--cpu", action="store_true",
                    help="tests/gpu/cpu_program.py without a GPU or podman: rehearse the harness")
    ap.add_argument("--runtime", default="/usr/local/bin/torpor-runtime")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/torpor-cbench"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    why = cri.missing()
    if why:
        print(f"cri_path: {why}", file=sys.stderr)
        return 2
    podman = not (args.no_podman or args.cpu) and shutil.which("podman") is not None
    reg_gib = args.registry_gib
    from tests.integration.registry_server import missing as registry_missing
    reg_why = registry_missing() if reg_gib else "--registry-gib 0"
    program, gpu = (CPU_PROGRAM, False) if args.cpu else (TORCH_PROGRAM, True)
    est = estimate_s(args.sizes, podman, reg_gib if not reg_why else 0)
    print(f"cri_path: sizes {args.sizes} GiB, podman {'on' if podman else 'off'}, registry "
          f"{reg_gib if not reg_why else 'off (' + reg_why + ')'}: about {est / 60:.1f} min",
          flush=True)
    cri.remove_tree(args.workdir)
    args.workdir.mkdir(parents=True)
    doc = {"benchmark": "cri_path", "host": platform.node(), "kernel": platform.release(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "program": program.name, "estimate_s": est, "rows": []}
    t_all = time.perf_counter()

    def save() -> None:
        doc["elapsed_s"] = time.perf_counter() - t_all
        args.out.write_text(json.dumps(doc, indent=1))

    ok = True

    def fits(est_s: float, what: str) -> bool:
        left = args.budget_s - (time.perf_counter() - t_all)
        if args.budget_s and est_s > left:
            print(f"== {what}: skipped, estimated {est_s:.0f} s, {left:.0f} s of the budget left",
                  flush=True)
            doc.setdefault("skipped", []).append(what)
            return False
        return True
    with LayoutRegistry({"torpor-busybox": cri.BUSYBOX_TAR}) as base_images:
        node = GpuNode(args.workdir / "node-a", args.runtime, base_images, gpu=gpu)
        doc["containerd"] = node.cri.version()
        try:
            for gib in args.sizes:
                row: dict = {"gib": gib}
                doc["rows"].append(row)
                work = args.workdir / f"w{gib:g}"
                if not fits(leg_s(gib), f"{gib:g} GiB cri"):
                    continue
                print(f"== {gib:g} GiB: cri", flush=True)
                row["cri"] = cri_leg(node, gib, work, program, gpu)
                print(json.dumps(row["cri"]), flush=True)
                save()
                if podman and fits(leg_s(gib), f"{gib:g} GiB podman"):
                    print(f"== {gib:g} GiB: podman", flush=True)
                    row["podman"] = podman_leg(args.runtime, gib, work)
                    print(json.dumps(row["podman"]), flush=True)
                    n, mismatch = compare(row["cri"]["steps_file"], row["podman"]["steps_file"])
                    row["bit_exact"] = mismatch is None and n > 5
                    row["common_steps"] = n
                    ok &= row["bit_exact"]
                    for k, (ck, pk) in {"checkpoint": ("checkpoint_s", "checkpoint_total_s"),
                                        "restore": ("restore_total_s", "restore_total_s"),
                                        "end_to_end": ("end_to_end_s", "end_to_end_s")}.items():
                        row[f"ratio_{k}_cri_podman"] = row["cri"][ck] / row["podman"][pk]
                shutil.rmtree(work, ignore_errors=True)
                save()
            if not reg_why and fits(leg_s(reg_gib, True), "registry"):
                print(f"== registry, {reg_gib:g} GiB, store on", flush=True)
                doc["registry"] = registry_leg(node, reg_gib, args.workdir / "reg", program, gpu)
                if not args.cpu:     # --cpu: runc's own checkpoints, no store, no chunks
                    ok &= doc["registry"]["second_push_within_10pct"]
            else:
                doc["registry"] = {"skipped": reg_why or "budget"}
            save()
        finally:
            node.close()
            save()
    print(f"\n{'GiB':>4} {'path':>7} {'ckpt s':>7} {'restore s':>9} {'archive GB':>10} "
          "bit-exact")
    for row in doc["rows"]:
        for path in ("cri", "podman"):
            r = row.get(path)
            if r:
                ck = r.get("checkpoint_s", r.get("checkpoint_total_s"))
                print(f"{row['gib']:>4g} {path:>7} {ck:>7.2f} {r['restore_total_s']:>9.2f} "
                      f"{r['archive_bytes'] / GB:>10.2f} {row.get('bit_exact', '-')}")
    reg = doc.get("registry") or {}
    for c in reg.get("checkpoints", []):
        print(f"registry #{c['n']}: push {c['push_s']:.1f} s, {c['bytes_sent'] / GB:.3f} GB sent "
              f"of {c['bytes_total'] / GB:.3f}; pull {c.get('pull_s', 0):.1f} s, "
              f"{c.get('bytes_received', 0) / GB:.3f} GB received")
    if "second_push_ratio" in reg:
        print(f"second push / first: {reg['second_push_ratio']:.3f}")
    print(f"elapsed {doc['elapsed_s']:.0f} s (estimated {est:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
