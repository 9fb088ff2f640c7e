"""torpor's side of the agent protocol (torpor.agent.AgentClient) against the Python fake agent
(tests/fakes/fake_agent.py), the data files (torpor.agent_data) and the manifest's "agent" entries."""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes.fake_agent import FakeAgent
from torpor import agent, agent_data, manifest, procs
from torpor.agent import AgentClient, AgentError, NoAgentError
from torpor.errors import CorruptCheckpointError, UsageError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def agents_dir(tmp_path: Path) -> Path:
    d = tmp_path / "agents"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def fake(agents_dir: Path):
    a = FakeAgent(agents_dir / f"agent-{procs.nspid(os.getpid())}.sock").start()
    yield a
    a.stop()


def data_dir(tmp_path: Path) -> agent_data.DataDir:
    return agent_data.DataDir(tmp_path / "images" / agent_data.DATA_DIR)


# -- the client ---------------------------------------------------------------------------------

def test_nspid_of_a_host_process_is_its_pid():
    assert procs.nspid(os.getpid()) == os.getpid()
    assert procs.nspid(2 ** 22 + 12345) is None


def test_socket_of_finds_the_agent_by_nspid_and_none_without(fake, agents_dir):
    assert agent.socket_of(os.getpid(), agents_dir) == fake.path
    assert agent.socket_of(os.getpid(), agents_dir / "nowhere") is None
    assert agent.container_dir(Path("/run/torpor"), "abc") == Path("/run/torpor/agents/abc")
    assert agent.container_dir(Path("/run/torpor"), f"abc@{'f' * 16}") == \
        Path(f"/run/torpor/agents/abc@{'f' * 16}")
    for bad in ("../abc", "abc@..", f"abc@{'f' * 16}/..", "a/b", f"@{'f' * 16}"):
        with pytest.raises(UsageError):
            agent.container_dir(Path("/run/torpor"), bad)


def test_an_agent_socket_longer_than_a_socket_address_is_reached(tmp_path):
    """A container's agent directory is <run_dir>/agents/<id>@<root key>: with podman's
    64-hex ids, /run/torpor/agents/<id>@<key>/agent-<nspid>.sock is over the 107 bytes a
    Unix socket address holds (connect: "AF_UNIX path too long")."""
    long = tmp_path / "run" / "torpor" / "agents" / f"{'c' * 64}@{'0' * 16}"
    long.mkdir(parents=True, mode=0o700)
    short = tmp_path / "s"
    short.symlink_to(long)     # the fake agent binds through a short name
    a = FakeAgent(short / f"agent-{procs.nspid(os.getpid())}.sock").start()
    try:
        assert len(os.fsencode(agent.socket_path(os.getpid(), long))) > agent.SUN_PATH_MAX
        with AgentClient.for_pid(os.getpid(), long) as c:
            assert c.state() == "running"
    finally:
        a.stop()


def test_prepare_detach_resume_round_trip(fake, tmp_path):
    d = data_dir(tmp_path)
    (tmp_path / "images").mkdir()
    d.make()
    fds = d.for_prepare(os.getpid(), 3)
    with AgentClient.for_pid(os.getpid(), fake.path.parent) as a:
        r = a.prepare(fds, 5000)
        for fd in fds:
            os.close(fd)
        assert r["bytes"] == len(fake.original) and r["chunks"] == 4
        assert sum(r["files"]) == len(fake.original) and len(r["files"]) == 3
        assert a.state() == "prepared" and fake.memory is None
        assert a.detach() == {"ok": True}
        assert a.status()["state"] == "detached"
        fds = d.for_resume(os.getpid(), 3)
        back = a.resume(fds)
        for fd in fds:
            os.close(fd)
    assert back["bytes"] == len(fake.original) and fake.intact
    prep, res = fake.seen
    assert all(f["access"] == os.O_RDWR and f["size"] == 0 and f["mode"] == 0o600
               and f["dir_mode"] == 0o700 for f in prep["fds"])
    assert all(f["access"] == os.O_RDONLY for f in res["fds"])
    assert [Path(f["path"]).name for f in prep["fds"]] == [agent_data.file_name(k) for k in range(3)]


def test_abort_resumes_from_the_kept_files(fake, tmp_path):
    (tmp_path / "images").mkdir()
    d = data_dir(tmp_path).make()
    fds = d.for_prepare(1, 2)
    with AgentClient(fake.path) as a:
        a.prepare(fds, 1000)
        for fd in fds:
            os.close(fd)
        assert a.abort()["bytes"] == len(fake.original)
    assert fake.intact


@pytest.mark.parametrize("raw,match", [
    (b"not json\n", "non-JSON reply"),
    (b"[1, 2]\n", "sent \\[1, 2\\]"),
    (b'{"ok": false, "error": "no\\nway"}\n', "agent 'prepare': no way"),
    (b'{"ok": true, "bytes": -1, "chunks": 1, "allocations": 1, "seconds": 0.1, '
     b'"files": [1]}\n', "no valid 'bytes'"),
    (b'{"ok": true, "bytes": 1, "chunks": 1, "allocations": 1, "seconds": 0.1, '
     b'"files": [1, 2]}\n', "no valid 'files' for 1 file"),
    (b'{"ok": true, "bytes": 1, "chunks": 1, "allocations": 1, "seconds": true, '
     b'"files": [1]}\n', "no valid 'seconds'"),
])
def test_bad_replies_are_one_clear_error(fake, tmp_path, raw, match):
    fake.raw["prepare"] = raw
    with open(tmp_path / "f", "w+") as f, AgentClient(fake.path) as a:
        with pytest.raises(AgentError, match=match):
            a.prepare([f.fileno()], 1000)


def _commands(fake: FakeAgent) -> list[str]:
    return [e.rsplit(" ", 1)[0] for e in fake.log()]


def test_an_agent_older_than_the_host_budget_is_checked_by_all_it_could_move(fake, tmp_path):
    """An agent preloaded before `prepare ... host=N` takes "T host=N" for its timeout and
    refuses it, doing nothing: what it could move at most (its status) is checked against the
    budget instead, refused in the newer agent's words, or the prepare goes again without it."""
    fake.before_host_budget = True
    need = len(fake.original)
    with open(tmp_path / "f", "w+") as f, AgentClient(fake.path) as a:
        with pytest.raises(AgentError, match=f"needs up to {need} bytes of host memory .*; "
                                             f"{need - 1} bytes are available for it"):
            a.prepare([f.fileno()], 1000, host_budget=need - 1)
        assert _commands(fake) == ["agent prepare", "agent status"]
        assert fake.state == "running" and fake.memory == fake.original
        assert os.fstat(f.fileno()).st_size == 0                # nothing copied
        fake.log.clear()
        r = a.prepare([f.fileno()], 1000, host_budget=need)
    assert _commands(fake) == ["agent prepare", "agent status", "agent prepare"]
    assert r["bytes"] == need and fake.state == "prepared" and fake.host_budget is None
    assert [len(s["fds"]) for s in fake.seen] == [1, 1, 1]   # the file every time


@pytest.mark.parametrize("host_budget,error", [(None, "bad timeout"),
                                               (1 << 30, "out of memory")])
def test_only_the_refusal_of_host_n_falls_back(fake, tmp_path, host_budget, error):
    """The fallback is for an agent that refuses the host=N word, not for any failure."""
    fake.fail["prepare"] = error
    with open(tmp_path / "f", "w+") as f, AgentClient(fake.path) as a, \
            pytest.raises(AgentError, match=f"agent 'prepare': {error}$"):
        a.prepare([f.fileno()], 1000, host_budget=host_budget)
    assert _commands(fake) == ["agent prepare"]


def test_a_hung_agent_is_a_timeout_error(fake):
    fake.hang.add("status")
    with AgentClient(fake.path, timeout=0.3) as a, \
            pytest.raises(AgentError, match="did not answer 'status' within"):
        a.status()
    with AgentClient(fake.path) as a:     # the next connection is served
        assert a.state() == "running"


def test_an_unknown_state_is_refused(fake):
    fake.raw["status"] = b'{"pid": 1, "state": "confused"}\n'
    with AgentClient(fake.path) as a, pytest.raises(AgentError, match="unknown state"):
        a.state()


def test_a_stale_socket_is_no_agent(agents_dir):
    path = agents_dir / f"agent-{os.getpid()}.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))           # bound, never listening: what a killed program leaves
    try:
        with pytest.raises(NoAgentError, match="stale"):
            AgentClient.for_pid(os.getpid(), agents_dir)
    finally:
        s.close()


def test_the_socket_of_another_live_process_is_refused(agents_dir, tmp_path):
    """A program in another pid namespace may have our program's nspid: the process listening
    on the socket must be the one we mean."""
    other = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fakes" / "fake_agent.py"),
                              str(agents_dir), str(tmp_path / "events")],
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        sock = agents_dir / f"agent-{other.pid}.sock"
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        with AgentClient.for_pid(other.pid, agents_dir) as a:   # its own: fine
            assert a.state() == "running"
        mine = agents_dir / f"agent-{os.getpid()}.sock"
        os.link(sock, mine)
        with pytest.raises(AgentError, match=f"agent socket of PID {other.pid}, not of PID "
                                             f"{os.getpid()}"):
            AgentClient.for_pid(os.getpid(), agents_dir)
    finally:
        other.kill()
        other.wait()


# -- the data files -----------------------------------------------------------------------------

def test_file_count(cfg):
    assert 1 <= agent_data.file_count(cfg) <= 8
    assert agent_data.file_count(dataclasses.replace(cfg, agent_files=12)) == 12


def test_data_files_are_private_and_never_follow_links(tmp_path):
    (tmp_path / "images").mkdir()
    d = data_dir(tmp_path).make()
    assert stat.S_IMODE(d.root.stat().st_mode) == 0o700
    with pytest.raises(UsageError, match="exists already"):
        data_dir(tmp_path).make()
    fds = d.for_prepare(42, 2)
    for fd in fds:
        os.close(fd)
    assert stat.S_IMODE((d.root / "42").stat().st_mode) == 0o700
    assert [stat.S_IMODE((d.root / "42" / agent_data.file_name(k)).stat().st_mode)
            for k in range(2)] == [0o600, 0o600]
    with pytest.raises(Exception, match="File exists"):
        d.for_prepare(42, 2)                              # O_EXCL: never reuses a file
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (d.root / "43").symlink_to(elsewhere)                 # a planted link instead of a dir
    with pytest.raises(Exception):
        d.for_prepare(43, 1)
    with pytest.raises(Exception):
        d.for_resume(43, 1)
    assert not list(elsewhere.iterdir())
    os.unlink(d.root / "42" / agent_data.file_name(1))
    (d.root / "42" / agent_data.file_name(1)).symlink_to(tmp_path / "secret")
    (tmp_path / "secret").write_text("x")
    with pytest.raises(Exception, match="Too many levels|symbolic"):
        d.for_resume(42, 2)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        d.for_resume(44, 1)
    with pytest.raises(CorruptCheckpointError, match="1 to 16"):
        d.for_resume(42, 17)
    os.chmod(d.root / "42" / agent_data.file_name(0), 0o666)
    with pytest.raises(CorruptCheckpointError, match="not a private regular file"):
        d.for_resume(42, 1)
    d.remove()
    assert not d.root.exists() and (tmp_path / "secret").exists()


def test_scratch_dirs_are_private_and_unique(cfg, tmp_path):
    c = dataclasses.replace(cfg, suspend_dir=tmp_path / "shm" / "torpor")
    a, b = agent_data.DataDir.scratch(c, 7).make(), agent_data.DataDir.scratch(c, 7).make()
    assert a.root != b.root and a.root.name.startswith("7-")
    assert stat.S_IMODE((tmp_path / "shm" / "torpor").stat().st_mode) == 0o700
    os.chown(tmp_path / "shm" / "torpor", 65534, 65534)
    with pytest.raises(UsageError, match="can be changed by uid 65534"):
        agent_data.DataDir.scratch(c, 7).make()
    c = dataclasses.replace(cfg, suspend_dir=tmp_path / "shm2")
    agent_data.DataDir.scratch(c, 7)
    assert not (tmp_path / "shm2").exists()         # nothing made before an agent needs it


# -- the manifest -------------------------------------------------------------------------------

def _manifest(agents: dict) -> dict:
    m = {"schema": 1, "kind": "torpor-checkpoint", "created": "x", "torpor_version": "x",
         "criu_version": "x", "host": "h", "kernel": "k", "driver": {}, "root_pid": 5,
         "shell_job": False, "leave_running": False, "gpus": [], "timings": {},
         "processes": [{"pid": 5, "cuda": True, "gpus": [], "gpu_memory": 0}],
         "sizes": {"total": 0, "gpu_memory": 0}, "files": {}}
    if agents is not None:
        m["agent"] = agents
    return m


@pytest.mark.parametrize("agents,match", [
    ({"5x": {"nspid": 5, "bytes": 1, "files": [1]}}, "is not a PID"),
    ({"05": {"nspid": 5, "bytes": 1, "files": [1]}}, "is not a PID"),
    ({"5": {"nspid": 5, "bytes": 1, "files": []}}, "'agent.5.files' does not list 1 to 16"),
    ({"5": {"nspid": 5, "bytes": 1, "files": [1] * 17}}, "'agent.5.files' does not list 1 to"),
    ({"5": {"nspid": 0, "bytes": 1, "files": [1]}}, "'agent.5.nspid' is missing or not"),
    ({"5": {"nspid": 5, "files": [1]}}, "'agent.5.bytes' is missing"),
    ({"5": {"nspid": 1, "bytes": 1, "files": [1]}, "6": {"nspid": 1, "bytes": 1,
                                                        "files": [1]}}, "share"),
    ([], "not an object"),
])
def test_bad_agent_entries_are_refused(agents, match):
    with pytest.raises(CorruptCheckpointError, match=match):
        manifest.validate(_manifest(agents))


def test_verify_wants_the_agents_files_as_they_wrote_them(tmp_path):
    m = _manifest({"5": {"nspid": 5, "bytes": 10, "files": [6, 4]}})
    for rel, size in zip(agent_data.rel_paths(5, 2), [6, 4]):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x" * size)
    for name in manifest.REQUIRED_IMAGES:
        (tmp_path / name).write_bytes(b"img")
    m["files"] = manifest.file_table(tmp_path, checksums=True)
    manifest.verify(tmp_path, m)
    assert manifest.agents(m)[5]["files"] == [6, 4]
    del m["files"][agent_data.rel_paths(5, 2)[1]]
    (tmp_path / agent_data.rel_paths(5, 2)[1]).unlink()
    with pytest.raises(CorruptCheckpointError, match="GPU memory of PID 5"):
        manifest.verify(tmp_path, m)



# -- settings -----------------------------------------------------------------------------------

def test_agent_settings(tmp_path):
    from torpor import config
    f = tmp_path / "c.toml"
    f.write_text('use_agent = false\nagent_files = 4\nagent_timeout_s = 30\n'
                 'suspend_dir = "/srv/shm"\n')
    c = config.load(f, env={"TORPOR_SUSPEND_DIR": str(tmp_path / "s")})
    assert (c.use_agent, c.agent_files, c.agent_timeout_s, c.suspend_dir) == \
        (False, 4, 30.0, tmp_path / "s")
    d = config.load(env={"TORPOR_CONFIG": str(tmp_path / "absent.toml")})
    assert (d.use_agent, d.agent_files, d.suspend_dir) == (True, 0, Path("/dev/shm/torpor"))
    for text, match in [("agent_files = 17", "agent_files"), ("agent_timeout_s = 0",
                                                                "agent_timeout_s")]:
        f.write_text(text)
        with pytest.raises(UsageError, match=match):
            config.load(f, env={})


# -- held descriptors (agent/PROTOCOL.md `detach hold`) --------------------------------------------

def _prepared_to_hold(fake: FakeAgent, tmp_path: Path, a: AgentClient, export: int) -> None:
    (tmp_path / "images").mkdir()
    d = data_dir(tmp_path).make()
    fds = d.for_prepare(1, 2)
    fake.export = export
    try:
        assert a.prepare(fds, 1000)["held"] == export
    finally:
        for fd in fds:
            os.close(fd)


def _open_fds(agent: FakeAgent) -> set[str]:
    """This process's descriptors once the fake agent (a thread of it) closed its side of
    every connection."""
    agent.wait_idle()
    return set(os.listdir("/proc/self/fd"))


def test_held_descriptors_are_not_inherited_by_what_torpor_runs(fake, tmp_path):
    """recvmsg's SCM_RIGHTS descriptors are inheritable unless asked otherwise: a child
    started while torpor holds them (CRIU, a runtime started with close_fds=False) would
    keep the program's GPU memory after torpor closed its own."""
    with AgentClient(fake.path) as a:
        _prepared_to_hold(fake, tmp_path, a, 2)
        held = a.detach_hold()
        try:
            assert len(held) == 2 and not any(map(os.get_inheritable, held))
        finally:
            for fd in held:
                os.close(fd)


def test_more_held_descriptors_than_a_message_takes_are_none_kept(fake, tmp_path):
    """An agent that sends (and says) more than HOLD_DIRECT in its reply itself, not in a bag:
    none are kept (never more than one message's worth open), and the resume copies from the
    files."""
    real = fake._do_detach

    def detach(arg, fds):   # says and sends HOLD_DIRECT + 1
        reply = real(arg, fds)
        for fd in fake._out_fds:
            os.close(fd)
        fake._out_fds = [os.memfd_create("extra") for _ in range(agent.HOLD_DIRECT + 1)]
        return {**reply, "held": len(fake._out_fds)}

    fake._do_detach = detach
    before = _open_fds(fake)
    with AgentClient(fake.path) as a:
        _prepared_to_hold(fake, tmp_path, a, 1)
        assert a.detach_hold() == []
    assert _open_fds(fake) == before


@pytest.mark.parametrize("bag", ["two fds", "not a bag", "one more", "past HOLD_MAX"])
def test_an_agent_whose_bag_is_not_what_it_says_gets_none_kept(fake, tmp_path, bag):
    """Past HOLD_DIRECT the descriptors come in one bag (fdbag.py), which an agent in a
    container makes: a reply that says "bag" with anything but one bag of exactly "held"
    descriptors (at most HOLD_MAX) keeps none open, and the resume copies from the files."""
    from torpor import fdbag
    real = fake._do_detach
    held = agent.HOLD_DIRECT + 50

    def detach(arg, fds):
        reply = real(arg, fds)
        for fd in fake._out_fds:
            os.close(fd)
        said = agent.HOLD_MAX + 1 if bag == "past HOLD_MAX" else held
        inside = [os.memfd_create("held") for _ in range(held + (bag == "one more"))]
        try:
            fake._out_fds = (inside[:2] if bag == "two fds" else
                             [os.open("/dev/null", os.O_RDONLY)] if bag == "not a bag" else
                             [fdbag.pack(inside)])
        finally:
            if bag != "two fds":
                for fd in inside:
                    os.close(fd)
            else:
                for fd in inside[2:]:
                    os.close(fd)
        return {**reply, "held": said, "bag": True}

    fake._do_detach = detach
    before = _open_fds(fake)
    with AgentClient(fake.path) as a:
        _prepared_to_hold(fake, tmp_path, a, 1)
        assert a.detach_hold() == []
    assert _open_fds(fake) == before


def test_an_agent_that_floods_detach_hold_with_descriptors_gets_none_kept(fake, tmp_path):
    """A hostile agent (in a container: untrusted) sends its descriptors over many messages
    before its reply line: torpor never has more than one message's worth open, keeps none,
    and the resume copies from the files."""
    real = fake._do_detach

    def detach(arg, fds):
        reply = real(arg, fds)
        for fd in fake._out_fds:
            os.close(fd)
        fake._out_fds = []
        for _ in range(5):   # 5 x 150 descriptors, no newline yet
            extra = [os.memfd_create("flood") for _ in range(150)]
            socket.send_fds(fake.conn, [b" "], extra)
            for fd in extra:
                os.close(fd)
        return {**reply, "held": 2}

    fake._do_detach = detach
    before = _open_fds(fake)
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # room for the fake's 150 and one message's worth more than HOLD_MAX, not for all 750
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(before) + 600, hard))
    try:
        with AgentClient(fake.path) as a:
            _prepared_to_hold(fake, tmp_path, a, 1)
            assert a.detach_hold() == []
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _open_fds(fake) == before


def test_held_descriptors_past_the_fd_limit_are_said_so(tmp_path):
    """A torpor whose limit on open files is too low for every program's held descriptors:
    the kernel cuts the message (MSG_CTRUNC); the error names the limit, not only "more than
    200" (a review's demonstration, scaled down: limit 96, 60 held)."""
    import resource
    import threading
    path = tmp_path / "agent.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(60)]

    def agent_side():
        c, _ = srv.accept()
        c.recv(64)
        socket.send_fds(c, [b'{"ok":true,"held":60}\n'], held)
        time.sleep(1)
        c.close()
    threading.Thread(target=agent_side, daemon=True).start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with AgentClient(path) as a:
            resource.setrlimit(resource.RLIMIT_NOFILE, (96, hard))
            with pytest.raises(AgentError, match=r"past this process's limit on open files \(96\)"):
                a.detach_hold(5)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in held:
            os.close(fd)
        srv.close()


def test_raise_fd_limit_lifts_the_soft_limit_to_the_hard_one():
    """torpor checkpoint --leave-running (and torpord) raise their own soft limit first."""
    code = ("import resource; h = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, h)); "
            "from torpor import procs; assert procs.raise_fd_limit() is None; "
            "s, h2 = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "print(s == (h if h != resource.RLIM_INFINITY else 1 << 20), s > 64)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.stdout.split() == ["True", "True"], r.stderr
