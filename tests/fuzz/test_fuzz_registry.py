"""A registry's answers, generated: image manifests (any JSON, near misses of a real one) and
layers (odd member names and types, truncated, with trailing garbage) end in torpor's one-line
error or a valid result; an unpacked layer never writes outside its directory."""

from __future__ import annotations

import io
import json
import os
import tarfile

from hypothesis import given, strategies as st

from torpor.errors import TorporError
from torpor.registry import layer, oci
from tests.fuzz.test_fuzz_inputs import _one_line, deep, json_values

_D = {"mediaType": oci.LAYER_TYPE, "digest": "sha256:" + "a" * 64, "size": 10}
_REAL = {"schemaVersion": 2, "mediaType": oci.MANIFEST_TYPE, "config": _D, "layers": [_D],
         "annotations": {oci.A_CHUNKS: "sha256:" + "b" * 64}}
near = st.builds(lambda k, v: {**_REAL, k: v},
                 st.sampled_from(["schemaVersion", "mediaType", "config", "layers",
                                  "annotations", "artifactType"]), json_values) | \
    st.builds(lambda k, v: {**_REAL, "layers": [{**_D, k: v}]},
              st.sampled_from(["mediaType", "digest", "size", "annotations"]), json_values)


@given(st.one_of(json_values.map(lambda v: json.dumps(v).encode()),
                 near.map(lambda m: json.dumps(m).encode()), deep, st.binary(max_size=300)))
def test_manifest_parse(data: bytes):
    try:
        m = oci.Manifest.parse(data, "fuzz")
    except TorporError as e:
        _one_line(e)
        return
    assert all(oci.DIGEST.fullmatch(d.digest) and d.size >= 0 for d in (m.config, *m.layers))


KINDS = [tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE,
         tarfile.FIFOTYPE, tarfile.GNUTYPE_SPARSE]
member_names = st.sampled_from(["checkpoint", "checkpoint/torpor.json", "./a", "a/", "a//b",
                                "../x", "/etc/x", "a/../../x", "a/b/c", "x" * 300, "a\0b", "."])


def _layer(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, kind, data in members:
            ti = tarfile.TarInfo(name)
            ti.type = kind
            ti.linkname = "/etc/passwd" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            ti.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


@given(st.lists(st.tuples(member_names, st.sampled_from(KINDS), st.binary(max_size=64)),
                max_size=6), st.integers(0, 3), st.binary(max_size=32))
def test_layer_unpack(tmp_path_factory, members, cut, junk):
    try:
        data = _layer(members)
    except (ValueError, tarfile.TarError):
        return   # a name tarfile itself cannot write
    if cut:
        data = data[: len(data) * cut // 4] + junk
    base = tmp_path_factory.mktemp("layer")
    dest = base / "d"
    dest.mkdir(mode=0o700)
    try:
        layer.unpack(io.BytesIO(data), dest, "fuzz", cap=1 << 20)
    except TorporError as e:
        _one_line(e)
    assert os.listdir(base) == ["d"]                      # nothing written beside it
    for root, dirs, files in os.walk(dest):
        for n in dirs + files:
            p = os.path.join(root, n)
            assert not os.path.islink(p) and (os.path.isdir(p) or os.path.isfile(p)), p
