"""`torpor image push` and `torpor image pull`: an image layout <-> a registry.

Push sends only the blobs the registry lacks (HEAD first), each in pieces (PATCH), then the
chunk artifact's manifest (by digest) and the image's (by tag). The upload of a blob in progress
is recorded (its Location) under the state dir, so a push cut off mid-blob (a registry that died,
a lost connection) resumes where the registry stands when run again; the local layout is only
read.

Pull fetches the image's manifest, config and layer, each checked against its digest and size
before it is used; unpacks the layer (layer.unpack: plain files at safe paths only) into a new
private directory, checks torpor.json against the image's annotation, and for a packed
checkpoint gets every chunk its snapshot names into the node's image store: only those it
lacks are fetched from the chunk artifact, each checked against the blob digest and the
chunk's own sha256 name before it enters the store. The directory's torpor-chunks/ then links
to the store's copies (a packed directory, self-contained, restored like any). Any failure
removes the directory (by its real name: a -D that is a link, what it points to): nothing
half-pulled is left to restore from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from .. import manifest
from ..errors import CorruptCheckpointError, UsageError, no_space
from ..files import atomic_write, loads_json, open_trusted_dir, private_dir, read_small_file
from ..layout import MANIFEST, PACKED, safe_relpath
from ..store import Store
from . import chunks, layer, oci
from .client import Client, each

PIECE = 8 << 20
WORKERS = 4   # connections at once: blobs are mostly 4 MiB chunks, one round trip each
LAYER_TYPES = (oci.LAYER_TYPE, "application/vnd.docker.image.rootfs.diff.tar",
               oci.LAYER_TYPE + "+gzip", "application/vnd.docker.image.rootfs.diff.tar.gzip")


@dataclasses.dataclass(frozen=True)
class PushResult:
    reference: str
    digest: str
    blobs: int
    uploaded_blobs: int
    skipped_blobs: int        # the registry had them
    resumed_blobs: int        # an upload cut off earlier, continued
    bytes_total: int          # of all the image's blobs
    bytes_sent: int           # on the wire, manifests included


@dataclasses.dataclass(frozen=True)
class PullResult:
    reference: str
    digest: str
    directory: str            # the unpacked layer
    checkpoint: str           # where torpor.json is: restore -D this (else the directory)
    chunks: int
    chunks_fetched: int
    chunks_from_store: int
    bytes_received: int
    has_manifest: bool        # torpor's checkpoint; else an engine's own (runc, crun)


# --- push -------------------------------------------------------------------------------------

def _read_layout(path: Path) -> tuple[oci.Descriptor, oci.Manifest, oci.Manifest | None]:
    """The image manifest of an OCI layout torpor built (its first manifest) and its chunk
    artifact's, each checked against its digest."""
    def small(rel: str) -> bytes:   # a manifest or the index: no FIFO, no /dev/zero
        try:
            return read_small_file(path / rel, oci.MAX_MANIFEST_BYTES)
        except ValueError as e:
            raise CorruptCheckpointError(f"{path}/{rel} is {e}: refused") from None

    def blob(d: oci.Descriptor) -> bytes:   # d.digest checked: sha256 and 64 hex digits
        try:
            data = small(f"blobs/sha256/{d.digest.removeprefix('sha256:')}")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: blob {d.digest} is missing") from None
        if oci.digest_of(data) != d.digest:
            raise CorruptCheckpointError(f"{path}: blob {d.digest} does not match its digest")
        return data
    try:
        index = loads_json(small("index.json"))
        image_d = oci.Descriptor.from_json(index["manifests"][0], f"{path}/index.json")
    except FileNotFoundError:
        raise UsageError(f"{path} is not an OCI image layout (no index.json)") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise CorruptCheckpointError(f"{path}/index.json is not an OCI image index") from None
    image = oci.Manifest.parse(blob(image_d), f"{path}: {image_d.digest}")
    chunks_digest = image.chunk_artifact(str(path))
    art = None
    if chunks_digest:
        d = oci.Descriptor(oci.MANIFEST_TYPE, chunks_digest, 0)
        art = oci.Manifest.parse(blob(d), f"{path}: {chunks_digest}")
    return image_d, image, art


class _Uploads:
    """Uploads in progress, one file each under state_dir/registry-uploads: the Location to
    resume at and the bytes the registry had acknowledged there. An upload resumes only where
    the registry still stands at exactly that offset: a PATCH cut off midway leaves bytes that
    were never acknowledged (docker-registry then refuses or garbles the upload), and that
    blob starts over."""

    def __init__(self, state_dir: Path, client: Client) -> None:
        self.dir, self.client = state_dir / "registry-uploads", client

    def _file(self, digest: str) -> Path:
        key = f"{self.client.ref.host}/{self.client.ref.repository}@{digest}"
        return self.dir / hashlib.sha256(key.encode()).hexdigest()

    def resume(self, digest: str, client: Client) -> tuple[str, int] | None:
        try:
            saved = loads_json(self._file(digest).read_bytes())
            location, offset = saved["location"], saved["offset"]
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            return None
        if not isinstance(location, str) or not isinstance(offset, int) or offset <= 0:
            return None
        return (location, offset) if client.upload_offset(location) == offset else None

    def save(self, digest: str, location: str, offset: int) -> None:
        atomic_write(self._file(digest), oci.canonical({"location": location, "offset": offset}))

    def done(self, digest: str) -> None:
        self._file(digest).unlink(missing_ok=True)


def push(layout: Path, client: Client, state_dir: Path,
         say: Callable[[str], None] = lambda s: None, workers: int = WORKERS) -> PushResult:
    image_d, image, art = _read_layout(layout)
    blobs: dict[str, oci.Descriptor] = {}
    for m in ([art] if art else []) + [image]:
        for d in (m.config, *m.layers):
            blobs.setdefault(d.digest, d)
    client.ping()
    uploads = _Uploads(state_dir, client)
    private_dir(uploads.dir)   # once, before the workers write into it
    done = [0]

    def one(c: Client, d: oci.Descriptor) -> str:
        if c.has_blob(d.digest):
            return "skipped"
        path = layout / "blobs" / "sha256" / d.digest.removeprefix("sha256:")
        if os.path.getsize(path) != d.size:
            raise CorruptCheckpointError(f"{layout}: blob {d.digest} has "
                                         f"{os.path.getsize(path)} bytes, {d.size} expected")
        at = uploads.resume(d.digest, c)
        if at:
            say(f"resuming blob {d.digest[:19]} at byte {at[1]}")
        location, offset = at or (c.start_upload(), 0)
        with open(path, "rb") as f:
            f.seek(offset)
            while offset < d.size:
                data = f.read(PIECE)
                if not data:
                    raise CorruptCheckpointError(f"{layout}: blob {d.digest} ends early")
                location = c.patch(location, data, offset)
                offset += len(data)
                uploads.save(d.digest, location, offset)
        c.finish_upload(location, d.digest)
        uploads.done(d.digest)
        done[0] += 1
        if done[0] % 50 == 0:
            say(f"pushed {done[0]} blobs")
        return "resumed" if at else "uploaded"

    outcome = each(client, blobs.values(), one, workers)
    if art:
        client.put_manifest(image.annotation(oci.A_CHUNKS) or "", art.dump())
    client.put_manifest(client.ref.tag or "latest", _layout_bytes(layout, image_d))
    return PushResult(str(client.ref), image_d.digest, len(blobs),
                      len(outcome) - outcome.count("skipped"), outcome.count("skipped"),
                      outcome.count("resumed"), sum(d.size for d in blobs.values()), client.sent)


def _layout_bytes(layout: Path, d: oci.Descriptor) -> bytes:
    return (layout / "blobs" / "sha256" / d.digest.removeprefix("sha256:")).read_bytes()


# --- pull -------------------------------------------------------------------------------------

def _manifest(client: Client, ref: str, want: str | None) -> tuple[bytes, oci.Manifest]:
    data = client.get_manifest(ref)
    if want and oci.digest_of(data) != want:
        raise CorruptCheckpointError(f"registry {client.ref.host}: manifest {ref} does not "
                                     f"match its digest {want}: tampered, refused")
    return data, oci.Manifest.parse(data, f"{client.ref}")


def pull(client: Client, dest: Path, store: Store, layout_out: Path | None = None,
         archive_out: Path | None = None, workers: int = WORKERS,
         preflight: Callable[[dict[str, Any]], None] | None = None) -> PullResult:
    """Pull client.ref into dest (module docstring). preflight(torpor.json, validated) runs
    once the layer is unpacked, before any chunk is fetched: a node whose GPUs cannot take the
    checkpoint refuses it (PreflightError) before the bulk of it crosses the network."""
    for where in (dest, layout_out):   # every output refused before anything is fetched
        if where is not None and where.exists() and (not where.is_dir() or any(where.iterdir())):
            raise UsageError(f"{where} is not a new or empty directory")
    if archive_out is not None and os.path.lexists(archive_out):
        raise UsageError(f"{archive_out} exists already")
    opened = open_trusted_dir(dest, "directory", create=True, readable=False)
    os.close(opened.fd)
    dest = opened.path   # its real name: a failure removes what was written, not a link to it
    try:
        return _pull(client, dest, store, layout_out, archive_out, workers, preflight)
    except BaseException as e:
        shutil.rmtree(dest, ignore_errors=True)
        if layout_out is not None:   # new or empty when the pull began: nothing of it kept
            shutil.rmtree(layout_out, ignore_errors=True)
        if isinstance(e, Exception) and no_space(e):
            raise UsageError(f"pulling {client.ref}: no space left on the file system of "
                             f"{dest} or of the image store: nothing kept of the pull, free "
                             "some space and pull again") from e
        raise


def _pull(client: Client, dest: Path, store: Store, layout_out: Path | None,
          archive_out: Path | None, workers: int,
          preflight: Callable[[dict[str, Any]], None] | None) -> PullResult:
    ref = client.ref
    raw, image = _manifest(client, ref.ref, ref.digest)
    digest = oci.digest_of(raw)
    if len(image.layers) != 1 or image.layers[0].media_type not in LAYER_TYPES:
        raise CorruptCheckpointError(f"{ref} is not a checkpoint image (one tar layer)")
    config = io.BytesIO()
    if image.config.size > oci.MAX_CONFIG_BYTES:
        raise CorruptCheckpointError(f"{ref}: its config is implausibly large")
    client.get_blob(image.config, config)
    layer_d = image.layers[0]
    free = shutil.disk_usage(dest).free
    if layer_d.size > free:
        raise UsageError(f"{ref}: its layer has {layer_d.size} bytes, {dest} has {free} free")
    tmp = dest / ".layer.tmp"
    with open(tmp, "xb") as f:
        client.get_blob(layer_d, f)
    with open(tmp, "rb") as f:
        cap = layer_d.size if layer_d.media_type in LAYER_TYPES[:2] \
            else shutil.disk_usage(dest).free
        files = layer.unpack(f, dest, f"{ref} layer", cap)
    top = _checkpoint_dir(image, dest, files, str(ref))
    if preflight is not None and (top / MANIFEST).is_file():
        preflight(manifest.read(top))
    fetched = from_store = n = 0
    chunks_digest = image.chunk_artifact(str(ref))
    if (top / PACKED).exists():
        if not chunks_digest:
            raise CorruptCheckpointError(f"{ref}: a packed checkpoint without its chunk artifact")
        _d, art = _manifest(client, chunks_digest, chunks_digest)
        n, fetched, from_store = chunks.fetch(client, art, top, store, workers)
    if layout_out is not None:
        _write_layout(layout_out, image, raw, config.getvalue(), tmp, ref.tag or "latest")
    if archive_out is not None:   # the layer, verified and checked: an engine's archive
        try:
            os.link(tmp, archive_out)
        except FileExistsError:
            raise UsageError(f"{archive_out} exists already") from None
    tmp.unlink()
    return PullResult(str(ref), digest, str(dest), str(top), n, fetched, from_store,
                      client.received, (top / MANIFEST).is_file())


def _checkpoint_dir(image: oci.Manifest, dest: Path, files: list[str], where: str) -> Path:
    """The directory of torpor.json in the unpacked layer, checked against the annotation;
    dest itself for an engine's checkpoint image without torpor's manifest."""
    path = image.annotation(oci.A_PATH)
    if path is None:
        if any(k.startswith(("org.criu.checkpoint.", "io.podman.annotations.checkpoint."))
               for k, _v in image.annotations):
            return dest
        raise CorruptCheckpointError(f"{where} is not a checkpoint image (no checkpoint "
                                     "annotations)")
    if path not in files:
        raise CorruptCheckpointError(f"{where} holds no {path[:200]}: refused")
    safe_relpath(path)
    want = image.annotation(oci.A_MANIFEST)
    if want and "sha256:" + hashlib.sha256((dest / path).read_bytes()).hexdigest() != want:
        raise CorruptCheckpointError(f"{where}: {path} does not match the image's annotation "
                                     f"{oci.A_MANIFEST}: tampered, refused")
    return (dest / path).parent


def _write_layout(path: Path, image: oci.Manifest, raw: bytes, config: bytes, layer_tmp: Path,
                  tag: str) -> None:
    """The pulled image (manifest as the registry gave it, config, layer) as an OCI layout; the
    chunks stay in the checkpoint directory."""
    from .build import Layout
    lay = Layout(path)
    lay.add(config)
    os.link(layer_tmp, lay.blob_path(image.layers[0].digest))
    digest = lay.add(raw)
    lay.finish(oci.Descriptor(oci.MANIFEST_TYPE, digest, len(raw), ((oci.A_REF_NAME, tag),)), [])
