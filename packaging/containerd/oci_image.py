#!/usr/bin/env python3
"""Build the two local images containerd 2.x's CRI plugin needs here, as OCI image-layout tars
for ``ctr -n k8s.io images import`` (the machines torpor is tested on cannot pull any image).

    oci_image.py pause   PAUSE_BINARY   OUT.tar [--name localhost/torpor-pause:1]
    oci_image.py busybox BUSYBOX_BINARY OUT.tar [--name localhost/torpor-busybox:1]

pause: one file, /pause (the static torpor-pause built from pause.c), entrypoint /pause.
busybox: a static busybox at /bin/busybox with a symlink per applet in /bin, empty /usr,
/proc, /sys, /dev, /tmp (1777), /etc, /run, /root, /var, /data, /mnt, and lib -> usr/lib,
lib64 -> usr/lib64 (a container that bind-mounts the host's /usr finds its dynamic loader).

Stdlib only; reproducible (every mtime 0, owner root), one uncompressed layer; the index
entry names the image with ``io.containerd.image.name`` so ``ctr images import`` keeps it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import platform
import subprocess
import sys
import tarfile
from pathlib import Path

PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DIRS = ("bin", "usr", "proc", "sys", "dev", "tmp", "etc", "run", "root", "var", "data", "mnt")


def oci_arch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x",
            "riscv64": "riscv64"}.get(m, m)


def _add(t: tarfile.TarFile, name: str, *, data: bytes | None = None, mode: int = 0o755,
         link: str | None = None) -> None:
    ti = tarfile.TarInfo(name)
    ti.mtime, ti.uid, ti.gid, ti.mode = 0, 0, 0, mode
    if link is not None:
        ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, link, 0o777
    elif data is None:
        ti.type = tarfile.DIRTYPE
    else:
        ti.size = len(data)
    t.addfile(ti, io.BytesIO(data) if data is not None else None)


def pause_layer(binary: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        _add(t, "pause", data=binary.read_bytes())
    return buf.getvalue()


def busybox_layer(binary: Path) -> bytes:
    applets = subprocess.run([str(binary), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for d in DIRS:
            _add(t, d, mode=0o1777 if d == "tmp" else 0o755)
        _add(t, "lib", link="usr/lib")
        _add(t, "lib64", link="usr/lib64")
        _add(t, "bin/busybox", data=binary.read_bytes())
        for a in sorted(set(applets) - {"busybox"}):
            if "/" not in a:
                _add(t, f"bin/{a}", link="busybox")
    return buf.getvalue()


def image_layout(name: str, layer: bytes, entrypoint: list[str]) -> bytes:
    """An OCI image-layout tar holding one image ``name`` of the one uncompressed ``layer``."""
    config = json.dumps({
        "architecture": oci_arch(), "os": "linux",
        "config": {"Env": [PATH_ENV], "Entrypoint": entrypoint, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }, sort_keys=True).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        def blob(data: bytes, media_type: str) -> dict:
            digest = hashlib.sha256(data).hexdigest()
            _add(t, f"blobs/sha256/{digest}", data=data, mode=0o644)
            return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

        _add(t, "blobs", mode=0o755)
        _add(t, "blobs/sha256", mode=0o755)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": blob(config, "application/vnd.oci.image.config.v1+json"),
            "layers": [blob(layer, "application/vnd.oci.image.layer.v1.tar")],
        }, sort_keys=True).encode()
        desc = blob(manifest, "application/vnd.oci.image.manifest.v1+json")
        desc["platform"] = {"architecture": oci_arch(), "os": "linux"}
        desc["annotations"] = {"io.containerd.image.name": name,
                               "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}
        _add(t, "oci-layout", data=b'{"imageLayoutVersion":"1.0.0"}', mode=0o644)
        _add(t, "index.json", data=json.dumps({"schemaVersion": 2, "manifests": [desc]}).encode(),
             mode=0o644)
    return buf.getvalue()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("pause", "busybox"))
    ap.add_argument("binary", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--name")
    a = ap.parse_args(argv)
    if a.kind == "pause":
        layer, entry = pause_layer(a.binary), ["/pause"]
        name = a.name or "localhost/torpor-pause:1"
    else:
        layer, entry = busybox_layer(a.binary), ["/bin/sh"]
        name = a.name or "localhost/torpor-busybox:1"
    tmp = a.out.with_name(a.out.name + ".tmp")
    tmp.write_bytes(image_layout(name, layer, entry))
    tmp.replace(a.out)
    print(f"{a.out}: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
