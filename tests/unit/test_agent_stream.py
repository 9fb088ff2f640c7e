"""The image store's stream (store/stream.py; agent/PROTOCOL.md "Streaming"), the agent on the
fake libcuda: a `prepare ... fp stream` puts the program's GPU data straight into the store
through the ring (the data files stay holes, a stream record says which chunk each part is),
and a `resume stream` brings it back from the store through the ring; every failure on either
side leaves the program its data. tests/gpu runs the same on an H200 (test_store_gpu.py)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from tests.unit.test_agent import gpu, probe  # noqa: F401  (fixtures)
from tests.unit.test_agent_mover import Files, ctl_fds
from torpor import agent_data
from torpor.agent import AgentClient, AgentError
from torpor.errors import CorruptCheckpointError
from torpor.store import fingerprints, stream
from torpor.store.store import Store

MIB = 1 << 20


def _program(p, sizes_mib=(24, 10)) -> list[tuple[int, int, int]]:
    """Allocations filled with patterns: (ptr, bytes, pattern)."""
    assert p.call("init dlsym")["rc"] == 0
    out = []
    for n, mib in enumerate(sizes_mib):
        ptr = p.call(f"@alloc {mib * MIB} dlsym")["ptr"]
        assert p.call(f"@fill {ptr} {mib * MIB} {n + 3}")["rc"] == 0
        out.append((ptr, mib * MIB, n + 3))
    return out


def _intact(p, mem) -> bool:
    return all(p.call(f"@check {ptr} {n} {pat}")["ok"] for ptr, n, pat in mem)


def _prepare_streamed(p, store: Store, data: Path, nfiles: int = 2, slots: int = 4,
                      known: tuple[str, ...] = ()) -> tuple[dict, stream.Intake]:
    """What the engine does: data files, an index, an Intake; the agent's reply. known: the
    fingerprints of parts the store has (skipped)."""
    files = Files(data, nfiles)
    fds = files.open(True)
    fds.append(os.open(data / agent_data.INDEX, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    fds.append(fingerprints.known_fd(known))
    intake = stream.Intake(store, data, nfiles, slots=slots)
    try:
        intake.start()
        with AgentClient(p.sock) as a:
            try:
                reply = a.prepare(fds[:nfiles], 5000, fingerprints=(fds[-1], fds[-2]),
                                  stream=intake.agent_fds())
            except AgentError as e:
                reply = {"error": str(e)}
    finally:
        for fd in fds:
            os.close(fd)
    return reply, intake


def _streamed_out(p, tmp_path: Path, sizes_mib: tuple[int, ...]):
    """A program holding sizes_mib, its data streamed into a new store through one data file:
    (its allocations, the store, the data directory, the agent's reply)."""
    mem = _program(p, sizes_mib)
    store = Store(tmp_path / "store", workers=2)
    data = tmp_path / "data"
    reply, intake = _prepare_streamed(p, store, data, nfiles=1)
    intake.finish()
    return mem, store, data, reply


def _resume_streamed(p, store: Store, data: Path, nfiles: int = 2, slots: int = 4,
                     skipped: dict[str, list] | None = None) -> dict:
    """What a restore does: the parts from the stream record (as a snapshot would name them)
    fed through a ring while the agent's `resume stream` runs; skipped: fingerprint -> chunk
    of the parts the agent skipped (as a snapshot names them too)."""
    sizes = [os.path.getsize(data / agent_data.file_name(k)) for k in range(nfiles)]
    parts = [stream.Source(s.file, s.offset, s.ref)
             for s in fingerprints.read_streamed(data, sizes)]
    parts += [stream.Source(x.file, x.offset, skipped[x.fp])
              for x in fingerprints.read(data, sizes) if x.skipped]
    ring = stream.Ring(slots)
    fed: list = []

    def feed():
        try:
            fed.append(stream.feed(store, ring, parts, "test"))
        except Exception as e:   # noqa: BLE001 - raised below, as the engine does
            fed.append(e)
    t = threading.Thread(target=feed)
    t.start()
    try:
        with AgentClient(p.sock) as a:
            reply = a.resume_stream(ring.agent_fds(), 30)
    except AgentError:
        ring.handed()
        ring.sock.shutdown(socket.SHUT_RDWR)   # as the engine does: the feed ends now
        t.join(10)
        if fed and isinstance(fed[0], Exception) and not isinstance(fed[0], stream.StreamError):
            raise fed[0] from None          # the feed's own failure says more than the agent's
        raise
    finally:
        ring.handed()
        t.join(10)
        ring.close()
    return reply


# the mover staging a chunk at a time or a part (the default, agent/src/mover_tune.c): a streamed
# save sends parts either way, a streamed load always stages chunks (the ring's records)
STAGES = [{"TORPOR_AGENT_MOVER_STAGE": "chunk"}, {}]


@pytest.mark.parametrize("stage", STAGES, ids=["chunk", "part"])
def test_a_streamed_prepare_stores_every_part_and_a_streamed_resume_brings_it_back(
        probe, tmp_path, stage):
    p = probe(env={"TORPOR_AGENT_FP_CHECK": "1", **stage})
    mem = _program(p)
    store = Store(tmp_path / "store", workers=3)
    data = tmp_path / "data"
    reply, intake = _prepare_streamed(p, store, data)
    stats = intake.finish()
    assert reply.get("bytes") == 34 * MIB, reply
    assert stats.bytes == 34 * MIB and stats.new_chunks == stats.parts >= 9
    # the data files are holes of their full sizes; the record names every part's chunk
    sizes = reply["files"]
    for k, size in enumerate(sizes):
        path = data / agent_data.file_name(k)
        assert path.stat().st_size == size and path.stat().st_blocks == 0
    parts = fingerprints.read_streamed(data, sizes)
    assert sum(s.length for s in parts) == 34 * MIB
    assert all(store.backend.has_blob(s.sha) for s in parts)
    assert fingerprints.has_skipped(data)             # holes to fill before a file resume
    assert ctl_fds(p.sock, "detach")["ok"]
    assert p.status()["state"] == "detached"

    back = _resume_streamed(p, store, data)
    assert back["bytes"] == 34 * MIB
    assert p.status()["state"] == "running" and _intact(p, mem)


@pytest.mark.parametrize("stage", STAGES, ids=["chunk", "part"])
def test_a_rollback_fills_the_holes_from_the_store_and_resumes_from_the_files(probe, tmp_path,
                                                                               stage):
    p = probe(env=stage)
    mem, store, data, reply = _streamed_out(p, tmp_path, (12,))
    assert reply.get("files"), reply
    fds = [os.open(data / agent_data.file_name(0), os.O_RDWR | os.O_CLOEXEC)]
    try:
        assert fingerprints.fill(store, data, fds, reply["files"], "uid:0") == 12 * MIB
    finally:
        os.close(fds[0])
    assert not fingerprints.has_skipped(data)
    assert ctl_fds(p.sock, "abort")["ok"]
    assert _intact(p, mem)


def test_a_store_that_fails_mid_stream_costs_the_program_nothing(probe, tmp_path):
    p = probe()
    mem = _program(p)
    store = Store(tmp_path / "store", workers=2)
    original = store.backend.put_blob
    calls = [0]

    def full(name, blob):
        calls[0] += 1
        if calls[0] > 3:
            raise OSError(28, "No space left on device")
        return original(name, blob)
    store.backend.put_blob = full
    data = tmp_path / "data"
    reply, intake = _prepare_streamed(p, store, data)
    assert "error" in reply, reply
    with pytest.raises(stream.StreamError, match="No space left"):
        intake.finish()
    assert not (data / agent_data.STREAMED).exists()
    stored = {b.name for b in store.backend.blobs()}
    assert stored and store.unnamed() == stored            # what it put before the disk filled
    assert sorted(store.discard_unnamed().removed) == sorted(stored)
    assert list(store.backend.blobs()) == []
    st = p.status()
    assert (st["state"], st["gate"]) == ("running", "open")   # nothing was released
    assert _intact(p, mem)


def test_a_torpor_that_dies_mid_stream_costs_the_program_nothing(probe, tmp_path):
    """Our end of the socket closes mid-stream (torpor killed): the agent's prepare fails at
    once, nothing is released, the gate opens."""
    p = probe()
    mem = _program(p)
    ring = stream.Ring(2)
    for n in range(2):
        ring.sock.send(stream.SLOT_NO.pack(n))
    data = tmp_path / "data"
    files = Files(data, 1)
    fds = files.open(True) + [os.open(data / agent_data.INDEX, os.O_RDWR | os.O_CREAT, 0o600),
                              fingerprints.known_fd([])]
    got = []

    def torpor_dies():
        got.append(ring.sock.recv(64))      # one part arrives, then torpor is gone
        ring.sock.close()
    t = threading.Thread(target=torpor_dies)
    t.start()
    try:
        r = ctl_fds(p.sock, "prepare 5000 fp stream", fds[:1] + [fds[2], fds[1]]
                    + ring.agent_fds())
    finally:
        for fd in fds:
            os.close(fd)
        ring.handed()
        t.join(10)
    assert got and not r["ok"], r
    assert "image store" in r["error"], r
    assert (p.status()["state"], p.status()["gate"]) == ("running", "open")
    assert _intact(p, mem)


def test_a_stream_that_ends_short_or_sends_damage_leaves_the_memory_out(probe, tmp_path):
    p = probe()
    mem, store, data, reply = _streamed_out(p, tmp_path, (12,))
    assert ctl_fds(p.sock, "detach")["ok"]
    # a stream of no parts at all: the resume fails, the gate stays closed
    ring = stream.Ring(2)
    try:
        ring.sock.shutdown(socket.SHUT_WR)
        r = ctl_fds(p.sock, "resume stream", ring.agent_fds())
    finally:
        ring.close()
    assert not r["ok"] and "part(s) short" in r["error"], r
    assert (p.status()["state"], p.status()["gate"]) == ("detached", "closed")
    # a part with other bytes: refused by its checksum
    ring = stream.Ring(2)
    try:
        first = fingerprints.read_streamed(data, reply["files"])[0]
        ring.map[0:first.length] = b"\x07" * first.length
        ring.sock.send(stream.RECORD.pack(0, first.file, first.offset, first.length,
                                          first.store_len))
        ring.sock.shutdown(socket.SHUT_WR)
        r = ctl_fds(p.sock, "resume stream", ring.agent_fds())
    finally:
        ring.close()
    assert not r["ok"] and "checksum" in r["error"], r
    assert p.status()["state"] == "detached"
    assert _resume_streamed(p, store, data, nfiles=1)["bytes"] == 12 * MIB
    assert _intact(p, mem)


# -- the engine's own paths -------------------------------------------------------------------

OWNER = "uid:0"


def _engine(gpu, tmp_path: Path, store: Store):
    from torpor import config
    from torpor.engine import Engine
    gpu.activate()
    return Engine(config.load(env={**gpu.env(), "TORPOR_STATE_DIR": str(tmp_path / "state"),
                                   "TORPOR_STORE_DIR": str(store.backend.root),
                                   "TORPOR_AGENT_FILES": "2"}))


def _images_dir(tmp_path: Path) -> Path:
    """A checkpoint directory with stand-ins for CRIU's images (the engine's part only)."""
    from torpor import manifest
    d = tmp_path / "ck"
    d.mkdir(mode=0o700)
    for image in ("pages-1.img", *manifest.REQUIRED_IMAGES):
        (d / image).write_bytes(f"a stand-in {image}".encode())
    return d


def test_the_engine_streams_a_checkpoint_into_the_store_and_restores_it_from_there(
        gpu, probe, tmp_path):
    from tests.unit.test_manifest import _manifest as sealed
    from torpor import manifest
    from torpor.engine import AgentTarget
    from torpor.store import images

    p = probe()
    mem = _program(p, (24, 10))
    store = Store(tmp_path / "store")
    engine = _engine(gpu, tmp_path, store)
    d = _images_dir(tmp_path)
    with store.backend.lock(False, 10), engine.begin("checkpoint", [p.pid]) as op:
        moved = engine.lock_and_checkpoint(
            op, [p.pid], data=agent_data.DataDir(d / agent_data.DATA_DIR), agent_dir=p.sock.parent,
            known_fingerprints=fingerprints.known(store, OWNER).gpu, owner=OWNER,
            stream_into=store)
    streamed = moved[p.pid]["streamed"]
    assert streamed["bytes"] == 34 * MIB and streamed["new_chunks"] >= 9, streamed
    prog = d / agent_data.DATA_DIR / str(p.pid)
    assert sum(f.stat().st_blocks for f in prog.glob("gpu-memory-*")) == 0   # holes only
    assert fingerprints.any_skipped(d)
    manifest.write(d, sealed(manifest.file_table(d, checksums=False)))
    assert not any(agent_data.STREAMED in rel for rel in manifest.read(d)["files"])  # not the images
    doc, st = images.pack(store, d, "one", OWNER)
    assert st.streamed == streamed["parts"] and st.new_bytes < MIB, st   # taken, not read
    assert not list(d.glob(f"{agent_data.DATA_DIR}/*/{agent_data.STREAMED}"))
    assert agent_data.STREAMED not in "".join(doc["files"])

    # the restore: nothing of the GPU data is unpacked; it streams from the store
    in_store = images.gpu_data_files(doc)
    assert len(in_store) == 2
    unpacked = images.unpack(store, d, leave_out=in_store)
    assert not list(unpacked.glob(f"{agent_data.DATA_DIR}/*/gpu-memory-*"))
    manifest.verify(unpacked, manifest.read(unpacked), checksums=False, elsewhere=in_store)
    target = AgentTarget(p.pid, p.sock, unpacked / agent_data.DATA_DIR, p.pid, 2, packed=str(d))
    with engine.begin("restore", [p.pid]) as op:
        back = engine.restore_and_unlock(op, [p.pid], agents={p.pid: target})
    assert back[p.pid]["streamed"] and back[p.pid]["bytes"] == 34 * MIB
    assert p.status()["state"] == "running" and _intact(p, mem)


def test_a_rollback_of_a_streamed_checkpoint_streams_the_memory_back(gpu, probe, tmp_path):
    from torpor.errors import RolledBackError

    p = probe()
    mem = _program(p, (16, 6))
    store = Store(tmp_path / "store")
    engine = _engine(gpu, tmp_path, store)
    data = agent_data.DataDir(tmp_path / "data")
    gpu.fail("lock", "CUDA_ERROR_UNKNOWN", p.pid)
    with store.backend.lock(False, 10), pytest.raises(RolledBackError):
        with engine.begin("checkpoint", [p.pid]) as op:
            engine.lock_and_checkpoint(op, [p.pid], data=data, agent_dir=p.sock.parent,
                                       known_fingerprints=(), owner=OWNER, stream_into=store)
    assert "fill" not in engine.progress.timings      # nothing written to the data files
    st = p.status()
    assert (st["state"], st["gate"]) == ("running", "open"), st
    assert _intact(p, mem)
    assert not data.root.exists()                      # the failed operation's files went


def test_a_failed_stream_fails_the_checkpoint_and_the_program_runs_on(gpu, probe, tmp_path):
    from torpor.errors import RolledBackError

    p = probe()
    mem = _program(p, (16,))
    store = Store(tmp_path / "store")
    engine = _engine(gpu, tmp_path, store)

    def full(name, blob):
        raise OSError(28, "No space left on device")
    store.backend.put_blob = full
    with store.backend.lock(False, 10), \
            pytest.raises(RolledBackError, match="No space left on device"):
        with engine.begin("checkpoint", [p.pid]) as op:
            engine.lock_and_checkpoint(op, [p.pid], data=agent_data.DataDir(tmp_path / "data"),
                                       agent_dir=p.sock.parent, known_fingerprints=(),
                                       owner=OWNER, stream_into=store)
    st = p.status()
    assert (st["state"], st["gate"]) == ("running", "open"), st
    assert _intact(p, mem)


def test_a_torpor_that_dies_between_a_streamed_checkpoint_and_its_pack_leaves_it_whole(
        gpu, probe, tmp_path):
    """The checkpoint is sealed (its program gone with the dump), its GPU data only in the
    store (holes, and the stream record), and its torpor dies before the pack begins: the next
    torpor's recovery fills the directory from the store, so it restores on its own."""
    from tests.unit.test_manifest import _manifest as sealed
    from torpor import manifest

    p = probe()
    _program(p, (12,))
    store = Store(tmp_path / "store")
    engine = _engine(gpu, tmp_path, store)
    d = _images_dir(tmp_path)
    op = engine.begin("checkpoint", [p.pid])
    with store.backend.lock(False, 10):
        engine.lock_and_checkpoint(op, [p.pid], data=agent_data.DataDir(d / agent_data.DATA_DIR),
                                   agent_dir=p.sock.parent, known_fingerprints=(),
                                   owner=OWNER, stream_into=store)
    op.phase("dump", images_dir=str(d))
    manifest.write(d, sealed(manifest.file_table(d, checksums=False)))   # sealed, then:
    p.proc.kill()                                      # the dump ended the program
    p.proc.wait()
    op.release()                                       # and its torpor died
    assert fingerprints.any_skipped(d)
    messages = _engine(gpu, tmp_path, store).recover()
    assert any("filled 12.00 MiB of GPU data" in m for m in messages), messages
    assert not fingerprints.any_skipped(d)
    prog = d / agent_data.DATA_DIR / str(p.pid)
    assert sum(f.stat().st_blocks for f in prog.glob("gpu-memory-*")) > 0
    manifest.verify(d, manifest.read(d))               # whole, with its checksums


def test_a_damaged_chunk_in_the_store_stops_the_stream_and_the_memory_stays_out(
        probe, tmp_path):
    p = probe()
    mem, store, data, reply = _streamed_out(p, tmp_path, (24,))
    assert ctl_fds(p.sock, "detach")["ok"]
    first = fingerprints.read_streamed(data, reply["files"])[0]
    blob = store.backend.blob_path(first.sha)
    damaged = bytearray(blob.read_bytes())
    damaged[-1] ^= 0xFF
    os.chmod(blob, 0o600)
    blob.write_bytes(bytes(damaged))
    with pytest.raises(CorruptCheckpointError, match="does not match its sha256 name"):
        _resume_streamed(p, store, data, nfiles=1)
    assert (p.status()["state"], p.status()["gate"]) == ("detached", "closed")
    damaged[-1] ^= 0xFF                                  # repaired: the retry brings it back
    blob.write_bytes(bytes(damaged))
    assert _resume_streamed(p, store, data, nfiles=1)["bytes"] == 24 * MIB
    assert _intact(p, mem)


def _streamed_checkpoint(gpu, probe, tmp_path):
    """A program's 12 MiB checkpointed by its agent, streamed into the store at tmp_path/store
    (its directory sealed, its GPU data holes): (program, store, engine, directory)."""
    from tests.unit.test_manifest import _manifest as sealed
    from torpor import manifest
    p = probe()
    _program(p, (12,))
    store = Store(tmp_path / "store")
    engine = _engine(gpu, tmp_path, store)
    d = _images_dir(tmp_path)
    with store.backend.lock(False, 10), engine.begin("checkpoint", [p.pid]) as op:
        engine.lock_and_checkpoint(op, [p.pid], data=agent_data.DataDir(d / agent_data.DATA_DIR),
                                   agent_dir=p.sock.parent, known_fingerprints=(),
                                   owner=OWNER, stream_into=store)
    manifest.write(d, sealed(manifest.file_table(d, checksums=False)))
    return p, store, engine, d


def test_a_pack_that_fails_after_a_streamed_checkpoint_fills_the_directory(
        gpu, probe, tmp_path, monkeypatch):
    """The stream put the GPU data into the store, the pack then fails (a full disk): the
    directory is filled from the store before the error, whole and checksummed on its own."""
    import errno

    from torpor import manifest, store_packing
    from torpor.errors import ExitCode, TorporError
    from torpor.store import images

    p, store, engine, d = _streamed_checkpoint(gpu, probe, tmp_path)
    assert fingerprints.any_skipped(d)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(images, "pack", full)
    with pytest.raises(TorporError, match="No space left on device; the checkpoint in .* is "
                                          "complete, not packed") as e:
        store_packing.pack(engine.journal, store, d, "one", OWNER)
    assert e.value.exit_code == ExitCode.ROLLED_BACK    # a full store: 8, as a full disk
    assert not fingerprints.any_skipped(d) and not images.is_packed(d)
    prog = d / agent_data.DATA_DIR / str(p.pid)
    assert sum(f.stat().st_blocks for f in prog.glob("gpu-memory-*")) > 0
    manifest.verify(d, manifest.read(d))               # with the checksums added
    # the streamed chunks: the directory is whole without them and no snapshot names them
    streamed = store.unnamed()
    assert streamed and {b.name for b in store.backend.blobs()} == streamed
    said: list[str] = []
    store_packing.discard_unnamed(engine.journal, store, d, said.append)
    assert list(store.backend.blobs()) == [] and said[-1].startswith(
        f"removed the {len(streamed)} chunk(s)"), said
    manifest.verify(d, manifest.read(d))


def test_a_failed_pack_takes_back_what_another_process_streamed(gpu, probe, tmp_path,
                                                                 monkeypatch):
    """A container's agents stream into the store through torpord's Store, its pack runs in
    torpor-runtime through another: when the pack failed (a full store), the runtime's
    discard_unnamed did not know the streamed chunks and left them, full store and all, for
    gc without a word. The directory filled, they are taken back as the pack's own are."""
    import errno

    from torpor import manifest, store_packing
    from torpor.errors import TorporError
    from torpor.store import images

    _p, torpord, engine, d = _streamed_checkpoint(gpu, probe, tmp_path)
    streamed = torpord.unnamed()
    assert streamed

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(images, "pack", full)
    runtime = Store(tmp_path / "store")               # torpor-runtime's, another process's
    with pytest.raises(TorporError, match="No space left on device"):
        store_packing.pack(engine.journal, runtime, d, "one", OWNER)
    assert not fingerprints.any_skipped(d)
    said: list[str] = []
    store_packing.discard_unnamed(engine.journal, runtime, d, said.append)
    assert list(runtime.backend.blobs()) == [] and said[-1].startswith(
        f"removed the {len(streamed)} chunk(s)"), said
    manifest.verify(d, manifest.read(d))


def test_a_streamed_restore_onto_a_full_gpu_fails_and_can_be_retried(probe, tmp_path):
    """The GPU has no room for the memory: the agent says so before it takes a part, the feed
    stops, nothing is lost (the data is in the store), and a retry once there is room works."""
    p = probe()
    mem, store, data, _reply = _streamed_out(p, tmp_path, (24,))
    assert ctl_fds(p.sock, "detach")["ok"]
    other = probe()                                   # takes what p released, and more
    assert other.call("init dlsym")["rc"] == 0
    hog = other.call(f"@alloc {other.call('meminfo')['free'] - 4 * MIB} dlsym")
    assert hog["rc"] == 0
    with pytest.raises(AgentError, match="no room"):
        _resume_streamed(p, store, data, nfiles=1)
    assert (p.status()["state"], p.status()["gate"]) == ("detached", "closed")
    assert other.call(f"@free {hog['ptr']} dlsym")["rc"] == 0
    assert _resume_streamed(p, store, data, nfiles=1)["bytes"] == 24 * MIB
    assert _intact(p, mem)


def test_records_outside_the_data_files_are_refused_before_the_commit(tmp_path):
    """The agent runs inside the program: a record a fill or a pack could not read later (a
    part beyond the files it sized) gets no commit, so the agent releases nothing."""
    import mmap
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    with open(data / agent_data.file_name(0), "wb") as f:
        f.truncate(4 * MIB)                                   # the one file, as sized
    intake = stream.Intake(Store(tmp_path / "store", workers=2), data, 1, slots=2)
    ring_fd, sock_fd = intake.agent_fds()
    ring = mmap.mmap(ring_fd, 2 * stream.PART)
    agent = socket.socket(fileno=os.dup(sock_fd))
    intake.start()
    try:
        slot = stream.SLOT_NO.unpack(agent.recv(4))[0]
        ring[slot * stream.PART:slot * stream.PART + MIB] = b"\x05" * MIB
        agent.send(stream.RECORD.pack(slot, 0, 8 * MIB, MIB, MIB))   # past the file's end
        agent.send(stream.RECORD.pack(stream.END, 0, 0, 0, 0))
        answers = []
        while msg := agent.recv(4):
            answers.append(stream.SLOT_NO.unpack(msg)[0])
        assert stream.END not in answers                      # no commit: EOF instead
        with pytest.raises(stream.StreamError, match="outside the data files"):
            intake.finish()
        assert not (data / agent_data.STREAMED).exists()
    finally:
        agent.close()
        ring.close()


def test_without_the_kernel_a_streamed_reload_takes_the_skipped_parts_as_torpor_checked_them(
        gpu, probe, tmp_path):
    """A second checkpoint whose agent skipped what the store had, restored through the stream
    on a GPU that cannot run the fingerprint kernel now: no files to check the skipped parts
    on the CPU, so they are taken as torpor checked them (sha256), not left held."""
    from tests.unit.test_agent_mover import failing
    p = probe()
    mem = _program(p, (16,))
    store = Store(tmp_path / "store", workers=2)
    one = tmp_path / "one"
    reply, intake = _prepare_streamed(p, store, one, nfiles=1)
    intake.finish()
    sizes = reply["files"]
    refs = {(s.file, s.offset): s.ref for s in fingerprints.read_streamed(one, sizes)}
    by_fp = {x.fp: refs[x.file, x.offset] for x in fingerprints.read(one, sizes)}
    assert _resume_streamed(p, store, one, nfiles=1)["bytes"] == 16 * MIB
    two = tmp_path / "two"
    reply, intake = _prepare_streamed(p, store, two, nfiles=1, known=tuple(by_fp))
    intake.finish()
    assert reply["fingerprints"]["skipped"] == len(by_fp) and reply["bytes"] == 0, reply
    assert ctl_fds(p.sock, "detach")["ok"]
    with failing(gpu, "cuModuleLoadData", "801"):     # CUDA_ERROR_NOT_SUPPORTED
        back = _resume_streamed(p, store, two, nfiles=1, skipped=by_fp)
    assert back["bytes"] == 16 * MIB
    assert p.status()["state"] == "running" and _intact(p, mem)


def test_the_feed_spreads_its_parts_over_the_programs_memory():
    """Parts in flight come from all over the agent's chunk order (sorted by GPU), each once."""
    parts = [stream.Source(k, i * fingerprints.PART, [None, 1]) for k in range(3)
             for i in range(10)]                  # 3 files of 10 parts: 30 in chunk order
    order = stream.spread(parts, 4)
    assert sorted(order, key=lambda p: (p.file, p.offset)) == parts
    chunk = [(p.offset // fingerprints.PART) * 3 + p.file for p in order]
    assert chunk[:4] == [0, 8, 16, 24] and chunk[4:8] == [1, 9, 17, 25], chunk
    assert stream.spread(parts, 1) == sorted(parts, key=lambda p: (p.offset, p.file))
    assert stream.spread([], 16) == []


def test_a_streamed_prepare_whose_release_fails_waits_for_its_stream_back(gpu, probe, tmp_path):
    """The second cuMemRelease fails after a streamed save: its data files are holes (the
    data is in the store), so no reload from them is tried; the agent stays prepared, its
    gate closed, and a `resume stream` brings every byte back."""
    from tests.unit.test_agent_mover import failing
    p = probe()
    mem = _program(p, (24, 10))
    store = Store(tmp_path / "store", workers=2)
    data = tmp_path / "data"
    with failing(gpu, "cuMemRelease", f"2 {p.pid} after=1"):
        reply, intake = _prepare_streamed(p, store, data, nfiles=1)
    intake.finish()
    assert "releasing GPU memory failed" in reply.get("error", ""), reply
    assert "reloading failed too" not in p.stderr()
    st = p.status()
    assert (st["state"], st["gate"]) == ("prepared", "closed"), st
    assert _resume_streamed(p, store, data, nfiles=1)["bytes"] > 0
    assert _intact(p, mem)


def test_a_streamed_prepare_with_nothing_to_move_after_a_failed_one(gpu, probe, tmp_path):
    """A failed mover run left its workers' failure set; a later streamed save with nothing
    to move runs no worker: it must not fail on that stale failure."""
    from tests.unit.test_agent_mover import failing
    p = probe()
    mem = _program(p, (8,))
    with failing(gpu, "cuMemcpyDtoHAsync_v2", f"2 {p.pid}"):
        r = Files(tmp_path / "d0", 1).send(p.sock, "prepare", write=True)
    assert r["ok"] is False, r
    assert p.call(f"@free {mem[0][0]} dlsym")["rc"] == 0
    assert p.status()["movable_bytes"] == 0
    store = Store(tmp_path / "store", workers=2)
    reply, intake = _prepare_streamed(p, store, tmp_path / "data", nfiles=1)
    try:
        assert "error" not in reply, reply
    finally:
        intake.abandon()
