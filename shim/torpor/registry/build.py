"""`torpor image build`: a torpor checkpoint -> an OCI image layout (docs/registries.md).

Sources: a checkpoint directory (`torpor checkpoint -D DIR`, packed into the store with --store
or not), or a checkpoint archive (podman's `checkpoint --export`, any compression). Out: an OCI
image layout directory (new or empty, 0700) holding

  - the checkpoint image: one layer (layer.py), annotated for the engines and checkpointctl
    (oci.py), its config an ordinary image config;
  - for a packed directory, the chunk artifact: one blob per chunk of its snapshot, each
    verified (its content against its name) before it is added, hard links to the
    directory's chunk links where the filesystem allows. The layer then holds the manifest,
    CRIU's small files and torpor-store.json (the snapshot naming the chunks), not the chunks.

A bare directory's files go under checkpoint/ in the layer, where podman and CRI-O keep CRIU's
images; an archive's members keep their own paths (podman's --create-image layout, and what
containerd 2's CRI restores from: config.dump, spec.dump, status.dump at the layer's root).
An archive of a packed checkpoint (torpor-store.json beside torpor.json, the chunk links as
torpor-chunks+<sha256> flat files, as torpor-runtime leaves them for the kubelet's archive and
podman's export, or under torpor-chunks/) is split the same way: its chunks, each verified,
go to the chunk artifact, the layer keeps the rest.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

from .. import archive, flat, manifest
from ..errors import NotFoundError, UsageError
from ..files import atomic_write, loads_json, private_dir, read_untrusted, write_new
from ..layout import CHUNKS, MANIFEST, MAX_MANIFEST, MAX_PACKED, PACKED
from ..store import chunk, images, snapshot
from . import layer, oci

CHECKPOINT_DIR = "checkpoint"   # podman's and CRI-O's name for CRIU's images in an archive
ENGINE_FILES = ("config.dump", "spec.dump")   # podman's / CRI-O's container description
MAX_ENGINE_FILE = 4 << 20
GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


@dataclasses.dataclass(frozen=True)
class Built:
    layout: Path
    digest: str          # the checkpoint image's manifest
    layer_bytes: int
    chunks: int          # blobs in the chunk artifact (0: none)
    chunk_bytes: int
    annotations: dict[str, str]


class Layout:
    """An OCI image layout directory being written: blobs by digest."""

    def __init__(self, path: Path) -> None:
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise UsageError(f"{path} is not a new or empty directory")
        self.path = private_dir(path)
        self.blobs = private_dir(path / "blobs" / "sha256")

    def blob_path(self, digest: str) -> Path:
        return self.blobs / digest.removeprefix("sha256:")

    def add(self, data: bytes) -> str:
        digest = oci.digest_of(data)
        if not self.blob_path(digest).exists():
            write_new(self.blob_path(digest), data)
        return digest

    def link(self, src: Path, digest: str) -> None:
        """Blob digest as a hard link to src (already verified), else a copy of it."""
        dest = self.blob_path(digest)
        if dest.exists():
            return
        try:
            os.link(src, dest)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            write_new(dest, chunk.read_blob_file(src, str(src.parent)))

    def finish(self, image: oci.Descriptor, extra: list[oci.Descriptor]) -> None:
        atomic_write(self.path / "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        index = {"schemaVersion": 2, "mediaType": oci.INDEX_TYPE,
                 "manifests": [image.to_json(), *(d.to_json() for d in extra)]}
        atomic_write(self.path / "index.json", oci.canonical(index))


def _engine_files(src: Path) -> dict[str, Any]:
    """config.dump and spec.dump of a podman / CRI-O archive, where it has them (parsed)."""
    found: dict[str, Any] = {}

    def each(tar: Any, m: Any) -> None:
        name = m.name.removeprefix("./")
        if name in ENGINE_FILES and m.isfile() and m.size <= MAX_ENGINE_FILE:
            try:
                found[name] = loads_json(tar.extractfile(m).read())
            except ValueError:
                pass
    archive._members(src, each)
    return found


def annotations_for(m: dict[str, Any], name: str, manifest_bytes: bytes, manifest_path: str,
                    engine: dict[str, Any]) -> dict[str, str]:
    """The checkpoint image's annotations: org.criu.checkpoint.* (checkpointctl's lib), podman's
    and CRI-O's checkpoint name (how each engine knows a checkpoint image), torpor's own."""
    config = engine.get("config.dump") if isinstance(engine.get("config.dump"), dict) else {}
    name = name or str(config.get("name") or "") or "checkpoint"
    a = {
        "org.criu.checkpoint.container.name": name,
        "org.criu.checkpoint.engine.name": "podman" if config else "torpor",
        "org.criu.checkpoint.engine.version": str(m.get("torpor_version", "")
                                                  or config.get("podmanVersion", "") or ""),
        "org.criu.checkpoint.criu.version": str(m.get("criu_version", "")),
        "org.criu.checkpoint.host.arch": GOARCH.get(platform.machine(), platform.machine()),
        "org.criu.checkpoint.host.kernel": str(m.get("kernel", "")),
        "io.kubernetes.cri-o.annotations.checkpoint.name": name,
        "io.podman.annotations.checkpoint.name": name,
    }
    if manifest_path:
        a[oci.A_MANIFEST] = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
        a[oci.A_PATH] = manifest_path
        a[oci.A_GPUS] = json.dumps([{k: g.get(k) for k in ("uuid", "name", "memory_total")}
                                    for g in m.get("gpus", [])], separators=(",", ":"))
    for key, field in (("rootfsImage", "rootfsImage"), ("rootfsImageName", "rootfsImageName"),
                       ("rootfsImageID", "rootfsImageRef"), ("runtime.name", "ociRuntime")):
        if isinstance(config.get(field), str) and config[field]:
            a[f"org.criu.checkpoint.{key}"] = config[field]
    return {k: v for k, v in a.items() if v}


def build(src: Path, out: Path, name: str = "", tag: str = "latest") -> Built:
    """Build the checkpoint image of src into the OCI layout out (module docstring)."""
    if src.is_dir():
        m = manifest.read(src)
        mbytes = read_untrusted(src, MANIFEST, MAX_MANIFEST)   # no link, as manifest.read
        mpath, engine, packed = f"{CHECKPOINT_DIR}/{MANIFEST}", {}, images.is_packed(src)
    elif os.path.lexists(src):
        engine, packed = _engine_files(src), False
        try:
            top, mbytes = archive._find(src)
            m, mpath = manifest.parse(mbytes, f"{src}:{MANIFEST}"), (top / MANIFEST).as_posix()
            prefix = layer._norm(top.as_posix())
            prefix = prefix + "/" if prefix and prefix != "." else ""
            doc = _archive_packed_doc(src, prefix)
            packed = prefix if doc is not None else False
        except NotFoundError:   # an engine's own checkpoint (runc, crun): no torpor.json
            if not engine:
                raise UsageError(f"{src} holds neither {MANIFEST} nor config.dump/spec.dump: "
                                 "not a checkpoint archive") from None
            m, mbytes, mpath = {}, b"", ""
    else:
        # exit 3, as restore and inspect say of a checkpoint that is not there (it was 2)
        raise NotFoundError(f"no checkpoint directory or archive {src}")
    name = name or (src.name if src.is_dir() else "")
    lay = Layout(out)
    try:
        return _build(src, lay, m, mbytes, annotations_for(m, name, mbytes, mpath, engine),
                      packed, tag)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def _build(src: Path, lay: Layout, m: dict[str, Any], mbytes: bytes, ann: dict[str, str],
           packed: bool | str, tag: str) -> Built:
    """packed: True for a packed directory, the path of torpor.json's directory inside the
    archive ("" or "dir/") for an archive of a packed checkpoint, False for neither."""
    extra: list[oci.Descriptor] = []
    chunks, chunk_bytes = 0, 0
    if packed is True:
        art, chunk_bytes = _chunk_artifact(lay, src)
    elif packed is not False:
        art, chunk_bytes = _archive_chunk_artifact(lay, src, str(packed))
    if packed is not False:
        chunks = len(art.layers)
        data = art.dump()
        extra.append(oci.Descriptor.of(oci.MANIFEST_TYPE, data))
        ann[oci.A_CHUNKS] = lay.add(data)
    tmp = lay.blobs / f".layer.tmp.{os.getpid()}"
    with open(tmp, "xb") as f:
        w = layer.HashingWriter(f)
        if src.is_dir():
            layer.write_dir(w, src, CHECKPOINT_DIR, lambda rel: packed and (
                rel == CHUNKS or rel.startswith(images.UNPACKED_PREFIX)))  # type: ignore[arg-type]
        else:
            layer.write_archive(w, src, lambda name: packed is not False and  # type: ignore
                                _chunk_member(name, str(packed)) is not None)
        f.flush()
        os.fsync(f.fileno())
    layer_d = oci.Descriptor(oci.LAYER_TYPE, w.digest(), w.size)
    os.replace(tmp, lay.blob_path(layer_d.digest))
    config = {"architecture": ann["org.criu.checkpoint.host.arch"], "os": "linux", "config": {},
              "rootfs": {"type": "layers", "diff_ids": [layer_d.digest]}}
    if m.get("created"):    # optional in OCI; "" (an engine's checkpoint) fails containerd's pull
        config["created"] = m["created"]
    cdata = oci.canonical(config)
    config_d = oci.Descriptor(oci.CONFIG_TYPE, lay.add(cdata), len(cdata))
    image = oci.Manifest(config_d, (layer_d,), tuple(sorted(ann.items())))
    idata = image.dump()
    image_d = oci.Descriptor(oci.MANIFEST_TYPE, lay.add(idata), len(idata),
                             ((oci.A_REF_NAME, tag),))
    lay.finish(image_d, extra)
    return Built(lay.path, image_d.digest, layer_d.size, chunks, chunk_bytes, ann)


def _chunk_artifact(lay: Layout, src: Path) -> tuple[oci.Manifest, int]:
    """The chunk artifact of packed directory src: each chunk its snapshot names, verified
    against its name, added as a blob (a hard link where possible)."""
    doc = images.packed_doc(src)
    lay.add(oci.EMPTY_JSON)
    layers, total = [], 0
    for name in sorted(snapshot.chunk_names(doc)):
        path = src / CHUNKS / name
        try:
            blob = chunk.read_blob_file(path, f"{src}/{CHUNKS}")
        except FileNotFoundError:
            raise UsageError(f"{src}: chunk {name} is missing from {CHUNKS}/") from None
        chunk.decode(blob, name, f"{src}/{CHUNKS}")
        d = oci.Descriptor.of(oci.CHUNK_TYPE, blob, {oci.A_CHUNK: name})
        lay.link(path, d.digest)
        layers.append(d)
        total += d.size
    return oci.Manifest(oci.empty_config(), tuple(layers), (), oci.CHUNKS_ARTIFACT), total


def _chunk_member(name: str, prefix: str) -> str | None:
    """The chunk an archive member is the link of (prefix/torpor-chunks+<name> as torpor-runtime
    flattens it, or prefix/torpor-chunks/<name>), else None."""
    if not name.startswith(prefix):
        return None
    rel = name[len(prefix):]
    for lead in (CHUNKS + flat.SEP, CHUNKS + "/"):
        if rel.startswith(lead):
            return rel[len(lead):]
    return None


def _archive_packed_doc(src: Path, prefix: str) -> dict[str, Any] | None:
    """The snapshot (torpor-store.json beside torpor.json) of an archive of a packed checkpoint,
    validated; None where the archive holds none."""
    found: list[dict[str, Any]] = []

    def each(tar: Any, m: Any) -> None:
        if layer._norm(m.name) != prefix + PACKED:
            return
        if found or not m.isfile() or m.size > MAX_PACKED:
            raise UsageError(f"{src}: {m.name[:80]!r} is not one plain file of at most "
                             f"{MAX_PACKED} bytes")
        found.append(snapshot.parse(tar.extractfile(m).read(), f"{src}:{m.name}"))
    archive._members(src, each)
    return found[0] if found else None


def _archive_chunk_artifact(lay: Layout, src: Path, prefix: str) -> tuple[oci.Manifest, int]:
    """The chunk artifact of an archive of a packed checkpoint: each chunk its snapshot names,
    read from the archive's chunk links, verified against its name, added as a blob."""
    doc = _archive_packed_doc(src, prefix)
    assert doc is not None
    needed = snapshot.chunk_names(doc)
    found: dict[str, oci.Descriptor] = {}
    lay.add(oci.EMPTY_JSON)

    def each(tar: Any, m: Any) -> None:
        name = _chunk_member(layer._norm(m.name), prefix)
        if name is None or name not in needed or name in found:
            return
        if not m.isfile() or m.issparse() or m.size > chunk.HEADER.size + chunk.MAX_CHUNK + 1024:
            raise UsageError(f"{src}: chunk link {m.name[:120]!r} is not a plain file of a "
                             "chunk's size")
        blob = tar.extractfile(m).read()
        chunk.decode(blob, name, f"{src}:{prefix}{CHUNKS}")
        found[name] = oci.Descriptor.of(oci.CHUNK_TYPE, blob, {oci.A_CHUNK: name})
        lay.add(blob)
    archive._members(src, each)
    lost = sorted(needed - found.keys())
    if lost:
        raise UsageError(f"{src}: chunk {lost[0]} is missing from its {CHUNKS} links "
                         f"({len(lost)} missing)")
    layers = tuple(found[n] for n in sorted(found))
    return (oci.Manifest(oci.empty_config(), layers, (), oci.CHUNKS_ARTIFACT),
            sum(d.size for d in layers))
