"""A packed checkpoint's chunks from its chunk artifact into the node's store: one place for
`torpor image pull` (transfer.py) and for torpor-runtime's restore from a checkpoint image
(containerd 2's CRI restores from the image's layer, which names the chunks but holds none).

fetch(): only the chunks the store lacks cross the network, each checked against its blob
digest and then against its own sha256 name (chunk.decode) before it enters the store, which
puts it atomically (no half chunk is ever visible), under the store's shared lock (gc waits).
The checkpoint directory's torpor-chunks/ then hard-links the store's copies: a self-contained
packed directory that gc keeps, restored like any. A failure removes that torpor-chunks/; the
chunks already in the store stay there, each whole and verified.

for_restore(): torpor-runtime's part. containerd 2 passes the runtime nothing of the image but
its layer's files and, in the spec's annotations, the reference the pod restored from
(`checkpointImage`, set by its CRI restore; it reaches the spec when the runtime handler's
container_annotations lists it). The image's manifest, fetched by that reference, names the
chunk artifact (io.torpor.chunks) and must carry the sha256 of the very torpor.json being
restored (io.torpor.checkpoint.manifest): a tag moved since is refused. Credentials and TLS are
the node's (auth.node_auth_files, auth.node_tls_context); it all runs within
restore_fetch_timeout_s, inside the kubelet's StartContainer deadline (2 minutes by default),
or fails naming `torpor image pull`, which pre-fetches the chunks into the node's store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Mapping

from ..config import Config
from ..errors import CorruptCheckpointError, TorporError, UsageError
from ..files import private_dir, write_new
from ..layout import CHUNKS, MANIFEST
from ..store import Store, chunk, images, snapshot
from ..store.backend import BLOB_NAME
from . import auth, oci
from .client import Client, DeadlineError, each

log = logging.getLogger(__name__)
MAX_CHUNK_BLOB = chunk.HEADER.size + chunk.MAX_CHUNK + 1024
IMAGE_ANNOTATION = "checkpointImage"   # containerd 2's CRI restore: the pod's image reference
WORKERS = 4


def index(client: Client, art: oci.Manifest) -> dict[str, oci.Descriptor]:
    """The chunk artifact's blobs by chunk name, every entry checked."""
    if art.artifact_type != oci.CHUNKS_ARTIFACT:
        raise CorruptCheckpointError(f"{client.ref}: its chunk artifact has artifactType "
                                     f"{str(art.artifact_type)[:80]!r}")
    by_name: dict[str, oci.Descriptor] = {}
    for d in art.layers:
        name = d.annotation(oci.A_CHUNK) or ""
        if d.media_type != oci.CHUNK_TYPE or not BLOB_NAME.fullmatch(name) \
                or d.size > MAX_CHUNK_BLOB:
            raise CorruptCheckpointError(f"{client.ref}: its chunk artifact lists a blob that "
                                         "is no chunk: refused")
        by_name[name] = d
    return by_name


def fetch(client: Client, art: oci.Manifest, top: Path, store: Store, workers: int
          ) -> tuple[int, int, int]:
    """Every chunk top's snapshot names into the store and top/torpor-chunks (module
    docstring): (chunks, fetched, from the store)."""
    by_name = index(client, art)
    names = sorted(snapshot.chunk_names(images.packed_doc(top)))
    absent = [c for c in names if c not in by_name]
    if absent:
        raise CorruptCheckpointError(f"{client.ref}: chunk {absent[0]} of the checkpoint is not "
                                     f"in its chunk artifact ({len(absent)} missing)")
    if os.path.lexists(top / CHUNKS):
        raise CorruptCheckpointError(f"{client.ref}: its layer brings a {CHUNKS}/ of its own: "
                                     "chunks travel only in the chunk artifact, refused")

    def one(c: Client, name: str) -> bool:
        """Chunk name into the store (fetched and verified unless it is there): fetched?"""
        if store.backend.has_blob(name):   # one held damaged is fetched, and replaced
            return False
        buf = io.BytesIO()
        c.get_blob(by_name[name], buf)
        blob = buf.getvalue()
        chunk.decode(blob, name, f"{client.ref} chunk artifact")
        store.backend.put_blob(name, blob)
        return True

    try:
        with store.backend.lock(False, store.lock_timeout):   # gc waits: no chunk goes meanwhile
            try:
                got = each(client, names, one, workers)
            finally:
                store.backend.sync()
            out = private_dir(top / CHUNKS)
            for name in names:
                _link_from_store(store, name, out / name)
    except BaseException:
        shutil.rmtree(top / CHUNKS, ignore_errors=True)
        raise
    fetched = sum(got)
    return len(names), fetched, len(names) - fetched


def _link_from_store(store: Store, name: str, dest: Path) -> None:
    """dest as a hard link to the store's blob name (a copy where the store has no local file
    or another filesystem): the directory carries its chunks, and gc keeps them."""
    src = store.backend.blob_path(name)
    if src is not None:
        try:
            os.link(src, dest, follow_symlinks=False)   # a link's target is no chunk of ours
        except OSError:
            pass
        else:
            if stat.S_ISREG(os.lstat(dest).st_mode):
                return
            dest.unlink()
    write_new(dest, store.backend.read_blob(name))   # refuses what is no blob (a link)


@dataclasses.dataclass(frozen=True)
class Fetched:
    reference: str
    chunks: int
    fetched: int
    bytes_received: int
    seconds: float


def missing(store: Store, top: Path) -> list[str]:
    """The chunks of the packed checkpoint in top that neither the store (sound, as far as
    backend.has_blob tells: a damaged one is fetched again) nor top's own torpor-chunks/
    has."""
    have = top / CHUNKS
    return [c for c in sorted(snapshot.chunk_names(images.packed_doc(top)))
            if not store.backend.has_blob(c) and not os.path.lexists(have / c)]


def for_restore(cfg: Config, top: Path, store: Store, annotations: Mapping[str, Any],
                env: dict[str, str] | None = None) -> Fetched | None:
    """The chunks the store lacks for the packed checkpoint in top, fetched from the image the
    container is restored from (module docstring); None when nothing is missing. Refused
    with one line (nothing fetched half, nothing restored) when it cannot be done."""
    lacking = missing(store, top)
    if not lacking:
        return None
    what = (f"{len(lacking)} chunk(s) of the packed checkpoint are in neither {CHUNKS}/ nor "
            f"store {store.where}")
    prefetch = ("pre-fetch them into this node's store with: torpor image pull {ref} -D DIR, "
                "then restore again")
    if os.path.lexists(top / CHUNKS):   # a checkpoint that brings its chunks brings them all
        raise CorruptCheckpointError(f"{what}: its {CHUNKS}/ lacks them, e.g. {lacking[0]}")
    ref = _reference(annotations.get(IMAGE_ANNOTATION) if isinstance(annotations, Mapping)
                     else None)
    if ref is None:
        raise CorruptCheckpointError(
            f"{what}, and the container was restored from no image reference to fetch them from "
            f"(containerd 2 passes it as the annotation {IMAGE_ANNOTATION} when the runtime "
            f"handler's container_annotations lists it); {prefetch.format(ref='REFERENCE')}")
    if cfg.restore_fetch_timeout_s <= 0:
        raise CorruptCheckpointError(f"{what}, and fetching at restore is off "
                                     f"(restore_fetch_timeout_s = 0); {prefetch.format(ref=ref)}")
    if cfg.registry_auth_file and not Path(cfg.registry_auth_file).is_file():
        raise UsageError(f"{what}; fetching them needs the registry_auth_file of torpor's config, "
                         f"{cfg.registry_auth_file}, which does not exist")
    t0 = time.monotonic()
    client = Client(ref, auth.node_tls_context(ref.host, cfg.registry_hosts_dir),
                    auth.credentials(ref, files=auth.node_auth_files(cfg.registry_auth_file,
                                                                     env)),
                    deadline=t0 + cfg.restore_fetch_timeout_s)
    client.auth_advice = (f"check registry_auth_file ({cfg.registry_auth_file or 'not set'}) "
                          "in torpor's config", "none in torpor's registry_auth_file ("
                          f"{cfg.registry_auth_file or 'not set'}) nor the node's auth files")
    client.tls_advice = (f"give its CA in {cfg.registry_hosts_dir}/{{host}}/hosts.toml (ca = ...) "
                         "as containerd has it (registry_hosts_dir)")
    log.info("restore: %d chunk(s) missing from the store: fetching them from %s", len(lacking),
             ref)
    try:
        n, fetched = _fetch_from(client, top, store)
    except DeadlineError:
        raise TorporError(f"fetching the chunks of {ref} into store {store.where} did not end "
                          f"within restore_fetch_timeout_s ({cfg.restore_fetch_timeout_s:g} s, "
                          f"inside the kubelet's StartContainer deadline): nothing restored, "
                          f"the chunks fetched so far are kept; pre-fetch the rest with: "
                          f"torpor image pull {ref} -D DIR") from None
    except TorporError as e:
        raise TorporError(f"fetching the chunks of {ref} for the restore: {e.line()}; nothing "
                          f"restored; {prefetch.format(ref=ref)}", exit_code=e.exit_code) from e
    finally:
        client.close()
    return Fetched(str(ref), n, fetched, client.received, time.monotonic() - t0)


def _reference(text: object) -> auth.Reference | None:
    """The image reference containerd restored from; None for none, for a checkpoint archive's
    path (containerd sets the annotation to that too) or an image ID."""
    if not isinstance(text, str) or not text or text.startswith(("/", ".", "sha256:")) \
            or oci.DIGEST.fullmatch("sha256:" + text):
        return None
    try:
        return auth.parse_reference(text)
    except UsageError:
        return None


def _fetch_from(client: Client, top: Path, store: Store) -> tuple[int, int]:
    """(chunks, fetched) from the chunk artifact of client.ref's image, once that image is
    shown to be the checkpoint in top."""
    raw = client.get_manifest(client.ref.ref)
    if client.ref.digest and oci.digest_of(raw) != client.ref.digest:
        raise CorruptCheckpointError(f"manifest {client.ref.ref} does not match its digest: "
                                     "tampered, refused")
    image = oci.Manifest.parse(raw, str(client.ref))
    want = image.annotation(oci.A_MANIFEST)
    have = "sha256:" + hashlib.sha256((top / MANIFEST).read_bytes()).hexdigest()
    if want != have:
        raise CorruptCheckpointError(f"the image {client.ref} is not the checkpoint being "
                                     f"restored (its {oci.A_MANIFEST} is {str(want)[:80]}, the "
                                     f"restored {MANIFEST} hashes to {have}): a tag moved since "
                                     "the pull? refused")
    art_digest = image.chunk_artifact(str(client.ref))
    if not art_digest:
        raise CorruptCheckpointError(f"the image {client.ref} names no chunk artifact "
                                     f"({oci.A_CHUNKS})")
    art_raw = client.get_manifest(art_digest)
    if oci.digest_of(art_raw) != art_digest:
        raise CorruptCheckpointError(f"the chunk artifact {art_digest} does not match its "
                                     "digest: tampered, refused")
    n, fetched, _from_store = fetch(client, oci.Manifest.parse(art_raw, art_digest), top,
                                    store, WORKERS)
    return n, fetched
