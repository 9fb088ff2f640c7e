"""OCI image-spec values for checkpoint images: media types, annotations, descriptors, and the
manifests read back from a layout or a registry, which are untrusted (every field checked).

The image the engines restore from is the standard checkpoint image: one layer holding the
checkpoint, annotated as podman's `--create-image`, CRI-O and checkpointctl do
(org.criu.checkpoint.*, io.kubernetes.cri-o.annotations.checkpoint.*). torpor adds:

    io.torpor.checkpoint.manifest   sha256 of torpor.json in the layer
    io.torpor.checkpoint.path       where torpor.json is in the layer
    io.torpor.checkpoint.gpus       the GPUs the checkpoint used, JSON [{uuid, name, memory_total}]
    io.torpor.chunks                the digest of the chunk artifact (a packed checkpoint)

The chunk artifact (artifactType application/vnd.torpor.chunks.v1) is an OCI manifest in the
same repository whose layers are the store's chunks, one blob each (the store's blob format,
store/chunk.py), each annotated io.torpor.chunk = the sha256 of the chunk's raw data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from ..errors import CorruptCheckpointError
from ..files import loads_json

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
CHUNKS_ARTIFACT = "application/vnd.torpor.chunks.v1"
CHUNK_TYPE = "application/vnd.torpor.chunk.v1"
EMPTY_JSON = b"{}"

A_CHUNK = "io.torpor.chunk"
A_CHUNKS = "io.torpor.chunks"
A_MANIFEST = "io.torpor.checkpoint.manifest"
A_PATH = "io.torpor.checkpoint.path"
A_GPUS = "io.torpor.checkpoint.gpus"
A_REF_NAME = "org.opencontainers.image.ref.name"

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
MAX_MANIFEST_BYTES = 4 << 20      # the distribution spec's usual limit on a manifest
MAX_CONFIG_BYTES = 4 << 20
MAX_ANNOTATION = 64 << 10


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical(obj: Any) -> bytes:
    """The bytes of a JSON document as torpor writes them: sorted keys, no spaces (so a build
    of the same checkpoint yields the same digests)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclasses.dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest,
                             "size": self.size}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d

    def annotation(self, key: str) -> str | None:
        return dict(self.annotations).get(key)

    @classmethod
    def of(cls, media_type: str, data: bytes, annotations: dict[str, str] | None = None
           ) -> "Descriptor":
        return cls(media_type, digest_of(data), len(data), tuple(sorted((annotations or {}).items())))

    @classmethod
    def from_json(cls, d: Any, where: str) -> "Descriptor":
        if not isinstance(d, dict):
            raise _bad(where, "a descriptor is not an object")
        mt, digest, size = d.get("mediaType"), d.get("digest"), d.get("size")
        if not isinstance(mt, str) or len(mt) > 255:
            raise _bad(where, "a descriptor has no media type")
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise _bad(where, "a descriptor's digest is not sha256:<64 hex>")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < 1 << 50:
            raise _bad(where, "a descriptor's size is not a plausible byte count")
        ann = d.get("annotations", {})
        if not isinstance(ann, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in ann.items()) \
                or sum(len(k) + len(v) for k, v in ann.items()) > MAX_ANNOTATION:
            raise _bad(where, "a descriptor's annotations are not short strings")
        return cls(mt, digest, size, tuple(sorted(ann.items())))


def _bad(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: not a valid checkpoint image manifest: {why}")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """An OCI image manifest (a checkpoint image or the chunk artifact), checked."""

    config: Descriptor
    layers: tuple[Descriptor, ...]
    annotations: tuple[tuple[str, str], ...]
    artifact_type: str | None = None

    def annotation(self, key: str) -> str | None:
        return dict(self.annotations).get(key)

    def chunk_artifact(self, where: str) -> str | None:
        """The digest of the image's chunk artifact (A_CHUNKS), checked before it names a
        request or a file (it comes from the registry or a layout: untrusted); None when the
        image names none."""
        digest = self.annotation(A_CHUNKS)
        if not digest:
            return None
        if not DIGEST.fullmatch(digest):
            raise CorruptCheckpointError(f"{where}: its chunk artifact ({A_CHUNKS}) is no "
                                         "sha256 digest: refused")
        return digest

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                             "config": self.config.to_json(),
                             "layers": [x.to_json() for x in self.layers]}
        if self.artifact_type:
            d["artifactType"] = self.artifact_type
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d

    def dump(self) -> bytes:
        return canonical(self.to_json())

    @classmethod
    def parse(cls, data: bytes, where: str) -> "Manifest":
        if len(data) > MAX_MANIFEST_BYTES:
            raise _bad(where, f"{len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
        try:
            d = loads_json(data)
        except ValueError as e:
            raise _bad(where, f"not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("schemaVersion") != 2:
            raise _bad(where, "schemaVersion is not 2")
        if d.get("mediaType", MANIFEST_TYPE) not in (MANIFEST_TYPE, DOCKER_MANIFEST_TYPE):
            raise _bad(where, f"media type {str(d.get('mediaType'))[:80]!r} is no image manifest")
        layers = d.get("layers")
        if not isinstance(layers, list):
            raise _bad(where, "no list of layers")
        ann = Descriptor.from_json({"mediaType": "x", "digest": "sha256:" + "0" * 64, "size": 0,
                                    "annotations": d.get("annotations", {})}, where).annotations
        at = d.get("artifactType")
        if at is not None and not isinstance(at, str):
            raise _bad(where, "artifactType is not a string")
        return cls(Descriptor.from_json(d.get("config"), where),
                   tuple(Descriptor.from_json(x, where) for x in layers), ann, at)


def empty_config() -> Descriptor:
    return Descriptor.of(EMPTY_TYPE, EMPTY_JSON)
