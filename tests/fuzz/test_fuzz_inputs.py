"""Untrusted inputs, generated: each reader answers with a TorporError (one line, an exit code
of errors.ExitCode) or a result, whatever it is given."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from torpor import archive, manifest, oci
from torpor.errors import ExitCode, TorporError
from torpor.runtime import argv as runc_argv
from torpor.store import chunk, snapshot

CODES = {v for k, v in vars(ExitCode).items() if k.isupper()}

# JSON of every shape, deep nesting included (a RecursionError once crashed torpor)
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | \
    st.floats(allow_nan=False) | st.text(max_size=40)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=5) |
                           st.dictionaries(st.text(max_size=12), kids, max_size=6),
                           max_leaves=40)
KEYS = ["schema", "kind", "created", "torpor_version", "criu_version", "host", "kernel",
        "driver", "root_pid", "shell_job", "leave_running", "tcp_established", "gpus",
        "processes", "timings", "sizes", "files", "agent", "container"]


UUID = "GPU-00000001-0000-4000-8000-000000000000"


def _sample_manifest() -> dict:
    return {"schema": manifest.SCHEMA, "kind": "torpor-checkpoint", "created": "2026-01-01",
            "torpor_version": "0.1.0", "criu_version": "4.2.1", "host": "h", "kernel": "6",
            "driver": {"version": "580", "cuda": 13000}, "root_pid": 10, "shell_job": False,
            "leave_running": False, "gpus": [{"uuid": UUID, "name": "H200",
                                               "memory_total": 1 << 30, "index": 0}],
            "processes": [{"pid": 10, "comm": "python3", "cuda": True, "gpus": [UUID],
                           "gpu_memory": 1, "state": "RUNNING"}],
            "timings": {"dump": 1.0}, "sizes": {"total": 1, "gpu_memory": 1},
            "files": {"pstree.img": {"size": 1}}}


# a valid manifest with one field replaced by anything: the near misses a fuzzer most needs
mutated = st.builds(lambda key, value: {**_sample_manifest(), key: value},
                    st.sampled_from(KEYS), json_values)
deep = st.integers(100, 5000).map(lambda n: b"[" * n + b"]" * n) | \
    st.integers(100, 5000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)


def _one_line(e: TorporError) -> None:
    assert e.exit_code in CODES
    assert "\n" not in e.line()


@given(st.one_of(json_values.map(lambda v: json.dumps(v).encode()),
                 mutated.map(lambda m: json.dumps(m).encode()), deep, st.binary(max_size=300)))
def test_manifest_parse(data: bytes):
    try:
        m = manifest.parse(data, "fuzz")
    except TorporError as e:
        _one_line(e)
        return
    assert isinstance(m, dict)
    manifest.agents(m)      # what restore reads next must hold too


@given(st.one_of(json_values, mutated))
def test_manifest_validate(value):
    try:
        manifest.validate(value)
    except TorporError as e:
        _one_line(e)


@given(st.one_of(json_values.map(lambda v: json.dumps(v).encode()), deep,
                 st.binary(max_size=300)))
def test_store_snapshot_parse(data: bytes):
    try:
        doc = snapshot.parse(data, "fuzz")
    except TorporError as e:
        _one_line(e)
        return
    snapshot.chunk_names(doc)


@given(st.binary(max_size=600), st.sampled_from(["a" * 64, "0" * 64]))
def test_chunk_decode(blob: bytes, name: str):
    try:
        chunk.decode(blob, name, "fuzz")
    except TorporError as e:
        _one_line(e)


@given(st.binary(max_size=200))
def test_chunk_decode_of_a_real_chunk_damaged(noise: bytes):
    data = os.urandom(256) * 8
    blob = bytearray(chunk.encode(data))
    for i, b in enumerate(noise[: len(blob)]):
        blob[(i * 7919) % len(blob)] ^= b
    try:
        out = chunk.decode(bytes(blob), chunk.name_of(data), "fuzz")
    except TorporError as e:
        _one_line(e)
        return
    assert out == data      # anything it returns is what was stored


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


names = st.sampled_from(["torpor.json", "checkpoint/torpor.json", "a/b/torpor.json",
                         "../torpor.json", "/etc/torpor.json", "x" * 300 + "/torpor.json",
                         "pstree.img"])
members = st.lists(st.tuples(names, st.one_of(
    mutated.map(lambda m: json.dumps(m).encode()), deep, st.binary(max_size=200))),
    max_size=4)


@given(members, st.integers(0, 3), st.binary(max_size=64))
def test_archive_manifest(tmp_path_factory, parts, cut, junk):
    data = _tar(parts)
    if cut:
        data = data[: len(data) * cut // 4] + junk     # truncated or trailing garbage
    path = tmp_path_factory.mktemp("arch") / "ck.tar"
    path.write_bytes(data)
    try:
        archive.manifest_from_archive(path)
    except TorporError as e:
        _one_line(e)


@given(st.dictionaries(st.sampled_from(["linux", "process", "annotations", "root", "x"]),
                       json_values, max_size=4))
def test_oci_spec_detect(spec):
    try:
        use = oci.detect(spec)
    except TorporError as e:
        _one_line(e)
        return
    bool(use)


@given(st.one_of(json_values.map(lambda v: json.dumps(v).encode()), deep,
                 st.binary(max_size=200)))
def test_oci_spec_load(tmp_path_factory, data: bytes):
    bundle = tmp_path_factory.mktemp("bundle")
    (bundle / "config.json").write_bytes(data)
    try:
        spec = oci.load(bundle)
    except TorporError as e:
        _one_line(e)
        return
    try:
        oci.detect(spec)
        oci.has_agent(spec)
        oci.wants_store(spec, False)
    except TorporError as e:
        _one_line(e)


flags = st.sampled_from(["--root", "/run/runc", "--log", "x", "--log-format", "json",
                         "checkpoint", "restore", "create", "delete", "start", "state",
                         "--image-path", "--work-path", "--leave-running", "--bundle", "-b",
                         "--pid-file", "--", "-d", "--detach", "--tcp-established", "ctr1",
                         "--console-socket", "=", "--image-path=/x", ""])


@given(st.lists(st.one_of(flags, st.text(max_size=12)), max_size=12))
def test_runc_argv_parse(args):
    try:
        runc_argv.parse(args)
    except TorporError as e:
        _one_line(e)
