"""`torpor checkpoint/restore/suspend/resume/ps/inspect/demo` with real CRIU and a fake GPU.

CI has no GPU: the driver and NVML are the fakes of tests/fakes (the GPU host runs the same
behaviour for real in tests/gpu). Every failure case checks that the program keeps running.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes.fakegpu import CHECKPOINTED, LOCKED, RUNNING
from tests.integration.conftest import (COUNTER, TICKING, alive, checkpointed_and_reaped,
                                        needs_criu, read_count, wait_for)

pytestmark = needs_criu


_count = read_count


def _live_criu(since: float = 0.0) -> list[int]:
    """CRIU processes started since `since` (time.time()) that are not zombies: another
    test's CRIU, left to finish a restore on its own, is not this test's, and one reparented
    to PID 1 may never be reaped here."""
    from torpor import procs
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
            if comm == "criu" and not rest.startswith("Z") \
                    and (procs.started_at(int(name)) or 0) >= since - 1:
                found.append(int(name))
    return found


def _journal(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "state" / "journal").glob("*.json"))


def test_cpu_process_tree_roundtrip(torpor, tmp_path, reaper):
    status = tmp_path / "tree.txt"
    code = COUNTER + ("import os, time\n"
                      "child = os.fork()\n"
                      "n = 0\n"
                      "while True:\n"
                      f"    n += 1\n    tick('{status}' + ('.c' if child == 0 else '.p'), n)\n"
                      "    time.sleep(0.02)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    reaper.append(parent.pid)
    wait_for(lambda: Path(f"{status}.c").exists() and Path(f"{status}.p").exists())
    child = int(Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()[0])
    reaper.append(child)
    images = tmp_path / "ck"
    out = torpor.json("checkpoint", str(parent.pid), "-D", str(images))
    parent.wait(timeout=10)
    assert not alive(child)
    m = out["manifest"]
    assert {p["pid"] for p in m["processes"]} == {parent.pid, child}
    assert not any(p["cuda"] for p in m["processes"]) and "lock" not in m["timings"]
    assert oct(images.stat().st_mode & 0o777) == "0o700"
    assert oct((images / "torpor.json").stat().st_mode & 0o777) == "0o600"
    before = _count(Path(f"{status}.c"))
    r = torpor.json("restore", "-D", str(images))
    assert r["root_pid"] == parent.pid and sorted(r["pids"]) == sorted([parent.pid, child])
    wait_for(lambda: _count(Path(f"{status}.c")) > before + 5, what="child ticking")
    assert alive(parent.pid) and alive(child)


TCP_PROGRAM = COUNTER + """
import socket, sys, time
srv = socket.create_server(("127.0.0.1", 0))
a = socket.create_connection(srv.getsockname())
b, _ = srv.accept()
n = 0
while True:                      # a counter around a loopback connection, as NCCL's bootstrap
    n += 1
    a.sendall(n.to_bytes(8, "little"))
    got = int.from_bytes(b.recv(8, socket.MSG_WAITALL), "little")
    assert got == n, (got, n)
    tick(sys.argv[1], n)
    time.sleep(0.02)
"""


def test_established_tcp_connections_go_along_only_when_asked(torpor, tmp_path, reaper):
    """CRIU refuses a program holding an established TCP connection: the checkpoint fails,
    says how to take it along, and the program runs on; with tcp_established it goes along,
    and the restored program goes on talking over it."""
    status = tmp_path / "tcp.txt"
    prog = subprocess.Popen([sys.executable, "-c", TCP_PROGRAM, str(status)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    reaper.append(prog.pid)
    wait_for(lambda: status.exists() and _count(status) > 3, what="the program ticking")
    r = torpor.run("checkpoint", str(prog.pid), "-D", str(tmp_path / "refused"))
    # no skip for "Can't get 1:34 opt": that is CRIU < 4.2 on Linux >= 6.16, which
    # install-criu.sh replaces (its warning says so where it cannot)
    assert r.returncode == 8 and "Connected TCP socket" in r.stderr \
        and "TORPOR_TCP_ESTABLISHED=1" in r.stderr, r.stderr
    before = _count(status)
    wait_for(lambda: _count(status) > before + 3, what="the program ticking on")

    images = tmp_path / "ck"
    asked = type(torpor)(dict(torpor.env, TORPOR_TCP_ESTABLISHED="1"))
    m = asked.json("checkpoint", str(prog.pid), "-D", str(images))["manifest"]
    prog.wait(timeout=10)
    assert m["tcp_established"] is True
    before = _count(status)
    r = torpor.json("restore", "-D", str(images))   # the manifest says so: no setting needed
    assert r["root_pid"] == prog.pid
    wait_for(lambda: _count(status) > before + 5, what="the restored program ticking")


LISTEN_PROGRAM = COUNTER + """
import os, socket, sys
srv = socket.create_server(("127.0.0.1", 0))
srv.settimeout(0.02)
open(sys.argv[2] + ".tmp", "w").write(str(srv.getsockname()[1]))
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
n = 0
while True:                      # a counter, told to whoever connects, as a server's state
    n += 1
    tick(sys.argv[1], n)
    try:
        c, _ = srv.accept()
    except (TimeoutError, InterruptedError):
        continue
    with c:
        c.sendall(b"%d\\n" % n)
"""


def _ask(port: int) -> int:
    """The counter of the program listening on 127.0.0.1:port, as it answers a connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.settimeout(10)
        data = b""
        while not data.endswith(b"\n"):
            chunk = c.recv(64)
            assert chunk, f"127.0.0.1:{port} closed without an answer"
            data += chunk
    return int(data)


def test_a_listening_tcp_socket_goes_along_and_answers_after_restore(torpor, tmp_path, reaper):
    """A server's listening socket needs no setting: it is checkpointed with the program,
    the port is free while the program is stopped in its images, and the restored program
    answers on the same port, its state intact."""
    status, port_file = tmp_path / "listen.txt", tmp_path / "port"
    prog = subprocess.Popen([sys.executable, "-c", LISTEN_PROGRAM, str(status), str(port_file)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    reaper.append(prog.pid)
    wait_for(lambda: port_file.exists() and status.exists() and _count(status) > 3,
             what="the server ticking")
    port = int(port_file.read_text())
    assert _ask(port) > 3
    images = tmp_path / "ck"
    m = torpor.json("checkpoint", str(prog.pid), "-D", str(images))["manifest"]
    prog.wait(timeout=10)
    assert m["tcp_established"] is False
    with pytest.raises(ConnectionRefusedError):       # the listener went with the program
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    at_checkpoint = _count(status)
    r = torpor.json("restore", "-D", str(images))
    assert r["root_pid"] == prog.pid
    assert _ask(port) >= at_checkpoint                  # the same counter, not a new program's
    wait_for(lambda: _count(status) > at_checkpoint + 5, what="the restored server ticking")
    assert _ask(port) > at_checkpoint + 5


def test_a_restore_criu_refuses_says_why_and_what_to_do_and_leaves_nothing(torpor, tmp_path,
                                                                           reaper):
    """A file the program holds open has changed size since its checkpoint: CRIU refuses the
    restore and cleans up after itself. torpor quotes why, says what to do, claims no
    half-restored process it did not stop, and leaves the checkpoint to restore once the file
    is put back."""
    status = tmp_path / "n.txt"
    prog = subprocess.Popen([sys.executable, "-c", TICKING, str(status)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    reaper.append(prog.pid)
    wait_for(lambda: _count(status) > 3, what="the program ticking")
    images = tmp_path / "ck"
    torpor.json("checkpoint", str(prog.pid), "-D", str(images))
    prog.wait(timeout=10)
    kept = status.read_bytes()
    status.write_bytes(kept + b"more")
    r = torpor.run("restore", "-D", str(images))
    assert r.returncode == 5, r.stderr
    assert "has bad size" in r.stderr and "must be as it was" in r.stderr, r.stderr
    assert "stopped" not in r.stderr, r.stderr
    assert not alive(prog.pid)
    assert not list((tmp_path / "state" / "journal").glob("*.json"))
    status.write_bytes(kept)
    r = torpor.run("restore", "-D", str(images))
    assert r.returncode == 0, r.stderr
    n = _count(status)
    wait_for(lambda: _count(status) > n + 3, what="the restored program ticking")


def test_gpu_process_roundtrip_with_device_map(torpor, gpu, tmp_path, reaper):
    prog = gpu.spawn(gpu_index=0, mem=3 << 30)
    reaper.append(prog.pid)
    prog.wait_tick(2)
    images = tmp_path / "ck"
    out = torpor.run("--json", "checkpoint", str(prog.pid), "-D", str(images), check=True)
    m = json.loads(out.stdout)["manifest"]
    checkpointed_and_reaped(prog)
    # not under the agent: its progress says so, and how to get the agent's path
    assert f"driver path for PID {prog.pid}" in out.stderr and "torpor run --" in out.stderr
    (proc,) = m["processes"]
    assert proc["cuda"] and proc["gpus"] == [gpu.uuid(0)] and proc["gpu_memory"] == 3 << 30
    assert proc["gpu_memory_by_gpu"] == {gpu.uuid(0): 3 << 30}      # per GPU: restore's pre-flight
    assert m["gpus"][0]["uuid"] == gpu.uuid(0) and {"lock", "checkpoint", "dump"} <= set(m["timings"])
    assert [c.call for c in gpu.calls() if c.pid == prog.pid][-2:] == ["lock", "checkpoint"]
    tick = prog.tick()
    r = torpor.json("restore", "-D", str(images), "--device-map", f"{gpu.uuid(0)}={gpu.uuid(1)}")
    assert r["gpu_map"] == {gpu.uuid(0): gpu.uuid(1)} and r["cuda_pids"] == [prog.pid]
    st = gpu.state(prog.pid)
    assert st["state"] == RUNNING and st["gpu"] == gpu.uuid(1)
    assert st["restored_pairs"] == [(gpu.uuid(0), gpu.uuid(1))]
    prog.wait_tick(tick + 3)


def test_leave_running(torpor, gpu, tmp_path):
    with gpu.spawn() as prog:
        out = torpor.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"), "--leave-running")
        assert out["manifest"]["leave_running"]
        assert gpu.state(prog.pid)["state"] == RUNNING
        prog.wait_tick(prog.tick() + 3)


def _assert_rolled_back(gpu, prog, tmp_path, proc):
    assert proc.returncode == 8, proc.stderr
    assert "rolled back to running" in proc.stderr and proc.stderr.count("\n") <= 12
    assert gpu.state(prog.pid)["state"] == RUNNING
    prog.wait_tick(prog.tick() + 3)
    assert _journal(tmp_path) == []


def test_dump_failure_on_full_disk_rolls_back(torpor, gpu, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        with gpu.spawn() as prog:
            proc = torpor.run("checkpoint", str(prog.pid), "-D", str(small / "ck"))
            assert "criu dump failed" in proc.stderr
            _assert_rolled_back(gpu, prog, tmp_path, proc)
            assert [c.call for c in gpu.calls() if c.call != "get_state"][-4:] == \
                ["lock", "checkpoint", "restore", "unlock"]
            leftovers = [p.name for p in (small / "ck").iterdir()]
            assert leftovers in ([], ["dump.log"])  # partial images removed, CRIU's log kept
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_lock_timeout_rolls_back(torpor, gpu, tmp_path):
    with gpu.spawn() as prog:
        gpu.hang_lock()
        torpor.env["TORPOR_LOCK_TIMEOUT"] = "0.5"
        start = time.monotonic()
        proc = torpor.run("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"))
        assert time.monotonic() - start < 30
        assert "CUDA_ERROR_TIMEOUT" in proc.stderr
        gpu.clear_faults()
        _assert_rolled_back(gpu, prog, tmp_path, proc)


def test_driver_checkpoint_failure_rolls_back(torpor, gpu, tmp_path):
    with gpu.spawn() as prog:
        gpu.fail("checkpoint", "CUDA_ERROR_UNKNOWN")
        proc = torpor.run("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"))
        assert "CUDA_ERROR_UNKNOWN" in proc.stderr
        gpu.clear_faults()
        _assert_rolled_back(gpu, prog, tmp_path, proc)


@pytest.mark.parametrize("slow_call,args,state_when_killed", [
    ("checkpoint", [], LOCKED),                      # killed in the checkpoint phase
    ("restore", ["--leave-running"], CHECKPOINTED),  # killed after the dump, GPU state on host
    ("unlock", ["--leave-running"], LOCKED),         # killed just before the unlock
])
def test_sigkill_of_torpor_mid_phase_is_recovered(torpor, gpu, tmp_path, slow_call, args,
                                                  state_when_killed):
    with gpu.spawn() as prog:
        gpu.delay(slow_call, 20000)
        t = torpor.start("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"), *args)
        wait_for(lambda: any(c.call == slow_call for c in gpu.calls())
                 or (gpu.state_dir / "delay" / slow_call).exists() and
                 gpu.state(prog.pid)["state"] == state_when_killed and _journal(tmp_path)
                 and time.sleep(0.3) is None, timeout=30, what=f"torpor to reach {slow_call}")
        t.kill()
        t.wait()
        gpu.clear_faults()
        assert gpu.state(prog.pid)["state"] == state_when_killed
        ps = torpor.run("ps")  # any command first rolls back what a dead torpor left
        assert ps.returncode == 0, ps.stderr
        assert "recovered" in ps.stderr and str(prog.pid) in ps.stderr
        assert gpu.state(prog.pid)["state"] == RUNNING
        prog.wait_tick(prog.tick() + 3)
        assert _journal(tmp_path) == []


def test_second_request_for_same_pids_is_refused(torpor, gpu, tmp_path):
    with gpu.spawn() as prog:
        gpu.delay("checkpoint", 3000)
        first = torpor.start("checkpoint", str(prog.pid), "-D", str(tmp_path / "a"), "--leave-running")
        wait_for(lambda: gpu.state(prog.pid)["state"] == LOCKED, what="first lock")
        second = torpor.run("checkpoint", str(prog.pid), "-D", str(tmp_path / "b"))
        assert second.returncode == 6 and "busy" in second.stderr
        assert first.wait(timeout=60) == 0, first.stderr.read()
        assert gpu.state(prog.pid)["state"] == RUNNING


def test_suspend_resume_and_ps(torpor, gpu):
    with gpu.spawn(mem=2 << 30) as prog:
        r = torpor.json("suspend", str(prog.pid))
        assert r["pids"] == [prog.pid] and r["gpu_memory_released"] == 2 << 30
        assert gpu.state(prog.pid)["state"] == CHECKPOINTED
        t = prog.tick()
        time.sleep(0.3)
        assert prog.tick() == t  # its CUDA calls wait while suspended
        rows = {r["pid"]: r for r in torpor.json("ps")["processes"]}
        assert rows[prog.pid]["state"] == "CHECKPOINTED" and rows[prog.pid]["suspended"]
        again = torpor.run("suspend", str(prog.pid))
        assert again.returncode == 2 and "already CHECKPOINTED" in again.stderr, again.stderr
        torpor.json("resume", str(prog.pid))
        assert gpu.state(prog.pid)["state"] == RUNNING
        prog.wait_tick(t + 3)
        rows = {r["pid"]: r for r in torpor.json("ps")["processes"]}
        assert rows[prog.pid]["state"] == "RUNNING" and not rows[prog.pid]["suspended"]


def test_restore_refused_when_gpu_too_small(torpor, gpu, tmp_path, reaper):
    prog = gpu.spawn(mem=8 << 30)
    reaper.append(prog.pid)
    torpor.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"))
    checkpointed_and_reaped(prog)
    gpu.set_gpus([(gpu.uuid(0), "NVIDIA H200", 4 << 30)])  # "another host": too little memory
    proc = torpor.run("restore", "-D", str(tmp_path / "ck"))
    assert proc.returncode == 7, proc.stderr
    assert "no GPU here can take" in proc.stderr and not alive(prog.pid)


def test_gpu_restore_failure_stops_restored_processes(torpor, gpu, tmp_path, reaper):
    prog = gpu.spawn()
    reaper.append(prog.pid)
    torpor.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"))
    checkpointed_and_reaped(prog)
    gpu.fail("restore", "CUDA_ERROR_UNKNOWN")
    proc = torpor.run("restore", "-D", str(tmp_path / "ck"))
    assert proc.returncode == 1 and "restored processes were stopped" in proc.stderr
    wait_for(lambda: not alive(prog.pid), what="restored process stopped")
    gpu.clear_faults()
    torpor.json("restore", "-D", str(tmp_path / "ck"))  # the checkpoint is still good
    assert gpu.state(prog.pid)["state"] == RUNNING


def test_a_manifest_that_hides_a_cuda_process_is_refused_not_left_frozen(torpor, gpu, tmp_path,
                                                                          reaper):
    """The manifest is untrusted: one that says a CUDA process is none would have had the
    restore end well (exit 0) with that process CHECKPOINTED for good."""
    import json as _json
    prog = gpu.spawn()
    reaper.append(prog.pid)
    images = tmp_path / "ck"
    torpor.json("checkpoint", str(prog.pid), "-D", str(images))
    checkpointed_and_reaped(prog)
    path = images / "torpor.json"
    m = _json.loads(path.read_text())
    for proc in m["processes"]:
        proc["cuda"] = False
    path.write_text(_json.dumps(m))
    path.chmod(0o600)
    r = torpor.run("restore", "-D", str(images))
    assert r.returncode == 9, r.stderr
    assert "the manifest is wrong" in r.stderr and "restored processes were stopped" in r.stderr
    wait_for(lambda: not alive(prog.pid), what="restored process stopped")


def test_corrupted_checkpoints_are_refused(torpor, gpu, tmp_path, reaper):
    prog = gpu.spawn()
    reaper.append(prog.pid)
    images = tmp_path / "ck"
    torpor.json("checkpoint", str(prog.pid), "-D", str(images))
    checkpointed_and_reaped(prog)
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))
    proc = torpor.run("restore", "-D", str(images))
    assert proc.returncode == 9 and "checksum mismatch" in proc.stderr and not alive(prog.pid)
    m = json.loads((images / "torpor.json").read_text())
    m["files"]["../../etc/shadow"] = {"size": 1, "sha256": None}
    (images / "torpor.json").write_text(json.dumps(m))
    proc = torpor.run("restore", "-D", str(images))
    assert proc.returncode == 9 and "unsafe path" in proc.stderr
    (images / "torpor.json").write_text("{")
    assert torpor.run("inspect", str(images)).returncode == 9


def test_bad_input_is_one_line_and_nonzero(torpor, gpu, tmp_path):
    cases = [(["checkpoint", "999999", "-D", str(tmp_path / "x")], 3),
             (["checkpoint", "abc", "-D", str(tmp_path / "x")], 2),
             (["restore", "-D", str(tmp_path / "nothing")], 3),
             (["resume", "1"], 2),
             (["inspect", str(tmp_path / "nothing.tar")], 3)]
    with gpu.spawn() as prog:
        full = tmp_path / "full"
        full.mkdir()
        (full / "f").write_text("x")
        cases.append((["checkpoint", str(prog.pid), "-D", str(full)], 2))
        cases.append((["restore", "-D", str(full), "--device-map", "nonsense"], 2))
        for args, code in cases:
            proc = torpor.run(*args)
            assert proc.returncode == code, (args, proc.stderr)
            assert proc.stderr.strip().splitlines()[-1].startswith("torpor: error: "), proc.stderr
            assert "Traceback" not in proc.stderr
        assert gpu.state(prog.pid)["state"] == RUNNING
        prog.wait_tick(prog.tick() + 2)


def test_demo_on_cpu(torpor):
    r = torpor.json("demo", "--cpu", "--mib", "16", timeout=300)
    assert r["mode"] == "cpu" and r["restored_pid"] == r["pid"]
    assert r["tick_verified_after"] > r["tick_at_checkpoint"]


def test_sigkill_of_torpor_mid_dump_lets_criu_finish_and_seals_the_checkpoint(torpor, tmp_path,
                                                                              reaper):
    """CRIU outlives torpor (killed half-way it could end the program, its tracees inside its
    parasite): the dump finishes and ends the program, and the next torpor, having waited for
    CRIU, seals the checkpoint, which restores and ticks on."""
    status = tmp_path / "n"
    code = COUNTER + ("import os, time\n"
                      "b = bytearray(os.urandom(1 << 20)) * 800\n"   # pages for a dump of ~1 s
                      "n = 0\n"
                      "while True:\n"
                      f"    n += 1\n    tick('{status}', n)\n    time.sleep(0.02)\n")
    prog = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    reaper.append(prog.pid)
    wait_for(lambda: status.exists(), timeout=60, what="program start")
    images = tmp_path / "ck"
    began = time.time()
    t = torpor.start("checkpoint", str(prog.pid), "-D", str(images))
    wait_for(lambda: any('"phase": "dump"' in p.read_text() for p in _journal(tmp_path)),
             timeout=30, what="dump phase")
    wait_for(lambda: _live_criu(began), timeout=10, what="CRIU dumping")
    t.kill()
    t.wait()
    assert _live_criu(began), "CRIU died with torpor"
    ps = torpor.run("ps")        # recovery waits for CRIU's outcome
    assert "sealed the checkpoint" in ps.stderr, ps.stderr
    assert not _live_criu(began)
    prog.wait(timeout=10)        # ended by CRIU's dump, as a checkpoint does
    assert _journal(tmp_path) == []
    assert not (images / "dump.out").exists()
    out = torpor.json("inspect", str(images), "--verify")
    assert out["verified"], out
    r = torpor.run("restore", "-D", str(images))
    assert r.returncode == 0, r.stderr
    n = _count(status)
    wait_for(lambda: _count(status) > n + 5, timeout=20, what="restored program ticking")


@pytest.mark.parametrize("slow_call", ["unlock"])
def test_killed_after_dump_the_next_torpor_seals_the_checkpoint(torpor, gpu, tmp_path, reaper,
                                                                 slow_call):
    """Killed after a successful dump (here: in the leave-running unlock): the program runs
    again and the images, all that is left of the dump, become a sealed checkpoint."""
    with gpu.spawn() as prog:
        images = tmp_path / "ck"
        gpu.delay(slow_call, 20000)
        t = torpor.start("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
        wait_for(lambda: any(c.call == "restore" for c in gpu.calls()) and
                 gpu.state(prog.pid)["state"] == LOCKED, timeout=30, what="the unlock")
        t.kill()
        t.wait()
        gpu.clear_faults()
        assert not (images / "torpor.json").exists() and (images / ".torpor.json.draft").exists()
        ps = torpor.run("ps")
        assert "sealed the checkpoint" in ps.stderr, ps.stderr
        assert gpu.state(prog.pid)["state"] == RUNNING
        out = torpor.json("inspect", str(images), "--verify")
        assert out["verified"] and out["manifest"]["processes"][0]["pid"] == prog.pid


def test_killed_during_gpu_restore_the_next_torpor_finishes_the_restore(torpor, gpu, tmp_path,
                                                                        reaper):
    """CRIU restored the program (CHECKPOINTED on the GPU), then torpor died: the journal
    names the restored PIDs and the GPU map, and recovery completes the restore."""
    prog = gpu.spawn()
    reaper.append(prog.pid)
    images = tmp_path / "ck"
    torpor.json("checkpoint", str(prog.pid), "-D", str(images))
    checkpointed_and_reaped(prog)
    tick = prog.tick()
    gpu.delay("restore", 20000)
    t = torpor.start("restore", "-D", str(images), "--device-map", f"{gpu.uuid(0)}={gpu.uuid(1)}")
    wait_for(lambda: alive(prog.pid) and gpu.state(prog.pid)["state"] == CHECKPOINTED
             and time.sleep(0.3) is None, timeout=30, what="CRIU restore done")
    t.kill()
    t.wait()
    gpu.clear_faults()
    ps = torpor.run("ps")
    assert "recovered" in ps.stderr and str(prog.pid) in ps.stderr, ps.stderr
    st = gpu.state(prog.pid)
    assert st["state"] == RUNNING and st["gpu"] == gpu.uuid(1)  # the map survived the crash
    prog.wait_tick(tick + 3)


def test_checkpoint_locations_other_users_can_change_are_refused(torpor, gpu, tmp_path, reaper):
    """A directory another user can rename in could be swapped for a symlink mid-dump; images
    another user can write could make root restore anything."""
    nobody = 65534
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, nobody, nobody)
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    with gpu.spawn() as prog:
        for target in (home / "ck", open_dir / "ck"):
            proc = torpor.run("checkpoint", str(prog.pid), "-D", str(target))
            assert proc.returncode == 2 and "only root can change" in proc.stderr, proc.stderr
        assert gpu.state(prog.pid)["state"] == RUNNING
        images = tmp_path / "ck"
        torpor.json("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
        assert {oct(p.stat().st_mode & 0o777) for p in images.iterdir()} == {"0o600"}
        pstree = images / "pstree.img"
        os.chown(pstree, nobody, nobody)
        proc = torpor.run("inspect", str(images), "--verify")
        assert proc.returncode == 9 and "pstree.img is owned by uid 65534" in proc.stderr


def test_two_checkpoints_never_share_a_directory(torpor, gpu, tmp_path):
    with gpu.spawn() as a, gpu.spawn() as b:
        gpu.delay("checkpoint", 2000, pid=a.pid)
        first = torpor.start("checkpoint", str(a.pid), "-D", str(tmp_path / "ck"), "--leave-running")
        wait_for(lambda: gpu.state(a.pid)["state"] == LOCKED, what="first lock")
        second = torpor.run("checkpoint", str(b.pid), "-D", str(tmp_path / "ck"))
        assert second.returncode == 6 and "another torpor is checkpointing" in second.stderr
        assert first.wait(timeout=60) == 0
        assert gpu.state(b.pid)["state"] == RUNNING


def test_sigterm_after_a_successful_dump_keeps_the_checkpoint(torpor, gpu, tmp_path, reaper):
    """The dump ended the program; a SIGTERM arriving before CRIU exits must not make torpor
    throw the images away (they are all that is left of the program)."""
    real = subprocess.run(["sh", "-c", "command -v criu || echo /usr/local/sbin/criu"],
                          capture_output=True, text=True).stdout.strip()
    slow = tmp_path / "slow-criu"
    slow.write_text(f'#!/bin/sh\n{real} "$@"; rc=$?\n[ "$1" = dump ] && sleep 2\nexit $rc\n')
    slow.chmod(0o755)
    torpor.env["TORPOR_CRIU"] = str(slow)
    prog = gpu.spawn()
    reaper.append(prog.pid)
    images = tmp_path / "ck"
    t = torpor.start("checkpoint", str(prog.pid), "-D", str(images))
    wait_for(lambda: (images / "dump.log").exists() and
             "Dumping finished successfully" in (images / "dump.log").read_text(),
             timeout=30, what="the dump")
    t.send_signal(signal.SIGTERM)
    assert t.wait(timeout=60) in (0, 130), t.stderr.read()
    checkpointed_and_reaped(prog)
    assert torpor.json("inspect", str(images), "--verify")["verified"]
    torpor.json("restore", "-D", str(images))
    assert gpu.state(prog.pid)["state"] == RUNNING


def test_run_preloads_the_agent(torpor, gpu, tmp_path):
    """torpor run execs the command (same PID) with the agent, which wraps the program's
    driver calls and answers on its socket; bad input is one line and exit 2 / 3."""
    from tests.fakes.fakegpu import PROGRAM
    from torpor.agent import AgentClient
    agents = tmp_path / "agents"
    status = tmp_path / "status.json"
    proc = torpor.start("run", "--agent-dir", str(agents), "--", sys.executable, str(PROGRAM),
                        "--mem", str(3 << 20), "--status", str(status))
    try:
        wait_for(lambda: status.exists(), 20, "the program's first status")
        assert json.loads(status.read_text())["pid"] == proc.pid        # exec'd, not a child
        assert stat_mode(agents) == 0o700
        with AgentClient.for_pid(proc.pid, agents) as a:
            st = a.status()
        assert (st["pid"], st["allocations"], st["bytes"]) == (proc.pid, 1, 3 << 20)
    finally:
        proc.kill()
        proc.wait()
    r = torpor.run("run")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no command" in r.stderr
    r = torpor.run("run", "--", "no-such-command-here")
    assert r.returncode == 3 and "command not found" in r.stderr


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_jax_program_without_agent_is_not_checkpointed_into_images_nothing_restores(
        torpor, gpu, tmp_path):
    """The driver cannot restore a JAX program after CRIU (workloads.py): `torpor checkpoint`
    refuses before touching it (exit 7) and says how to start it under the agent; the program
    runs on, untouched. Left running, the checkpoint goes ahead with a warning."""
    lib = tmp_path / "site-packages" / "jaxlib" / "xla_extension.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\0" * 4096)
    with gpu.spawn(env={"FAKE_PROGRAM_MAP": str(lib)}) as prog:
        images = tmp_path / "ck"
        r = torpor.run("checkpoint", str(prog.pid), "-D", str(images))
        assert r.returncode == 7, r.stderr
        assert "JAX" in r.stderr and "torpor run" in r.stderr
        assert not any(c.call == "lock" for c in gpu.calls())
        assert not images.exists() or not any(images.iterdir())
        tick = prog.tick()
        prog.wait_tick(tick + 3)
        r = torpor.run("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
        assert r.returncode == 0 and "will not restore" in r.stderr, r.stderr
        assert gpu.state(prog.pid)["state"] == RUNNING


# --- issue 18 items 2, 5, 6, 7: what inspect and restore read from a checkpoint ---------------

def _one_line_exit_9(proc) -> None:
    assert proc.returncode == 9, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()   # progress lines aside (restore's phases)
    assert [ln for ln in lines if "error" in ln] == lines[-1:], proc.stderr
    assert lines[-1].startswith("torpor: error: "), proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr


def test_inspect_of_a_users_planted_directory_reads_nothing_else(torpor, tmp_path):
    """A user's directory, inspected by root: links are not followed, a FIFO does not hang,
    /dev/zero does not grow torpor, a directory or deep JSON or a wrong type is one line."""
    nobody = 65534
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$planted-secret:19000:0:99999:7:::\n")
    os.chmod(secret, 0o600)
    deep = "[" * 200000 + "]" * 200000
    good = {"schema": 1, "kind": "torpor-checkpoint", "created": "c", "torpor_version": "t",
            "criu_version": "4", "host": "h", "kernel": "k",
            "driver": {"version": None, "cuda": None}, "root_pid": 10, "shell_job": False,
            "leave_running": False, "gpus": [],
            "processes": [{"pid": 10, "cuda": True, "gpus": [], "gpu_memory": 0}],
            "timings": {}, "sizes": {"total": 0, "gpu_memory": 0}, "files": {},
            "agent": {"10": {"nspid": 10, "bytes": 1, "files": [1], "seconds": "x"}}}
    plants = {
        "damaged-link": lambda ck: ((ck / "torpor.json").write_text("{}"),
                                    (ck / "torpor-damaged.txt").symlink_to(secret)),
        "manifest-link": lambda ck: (ck / "torpor.json").symlink_to(secret),
        "dev-zero": lambda ck: (ck / "torpor.json").symlink_to("/dev/zero"),
        "fifo": lambda ck: os.mkfifo(ck / "torpor.json"),
        "directory": lambda ck: (ck / "torpor.json").mkdir(),
        "deep": lambda ck: (ck / "torpor.json").write_text(deep),
        "long-path": lambda ck: (ck / "torpor.json").write_text(
            json.dumps(dict(good, agent={}, files={"a" * 5000: {"size": 1, "sha256": None}}))),
        "wrong-type": lambda ck: (ck / "torpor.json").write_text(json.dumps(good)),
    }
    for name, plant in plants.items():
        home = tmp_path / name
        home.mkdir()
        ck = home / "ck"
        ck.mkdir()
        plant(ck)
        for p in (home, ck, *ck.iterdir()):
            os.lchown(p, nobody, nobody)
        start = time.monotonic()
        proc = torpor.run("inspect", str(ck), timeout=30)
        assert time.monotonic() - start < 20, name
        _one_line_exit_9(proc)
        assert "planted-secret" not in proc.stdout + proc.stderr, name
        assert torpor.run("--json", "inspect", str(ck), timeout=30).stdout == ""
    assert "agent.10.seconds" in torpor.run("inspect", str(tmp_path / "wrong-type" / "ck")).stderr
    # root may still inspect a user's own directory holding a well-formed manifest
    ck = tmp_path / "fine"
    ck.mkdir()
    (ck / "torpor.json").write_text(json.dumps({k: v for k, v in good.items() if k != "agent"}))
    for p in (ck, ck / "torpor.json"):
        os.chown(p, nobody, nobody)
    proc = torpor.run("inspect", str(ck))
    assert proc.returncode == 0 and "PID      10" in proc.stdout, proc.stderr


def test_checkpoint_strings_are_printed_sanitized_and_torpor_json_trusted_like_images(
        torpor, gpu, tmp_path, reaper):
    with gpu.spawn() as prog:
        images = tmp_path / "ck"
        torpor.json("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
    m = json.loads((images / "torpor.json").read_text())
    m["host"] = "h\x1b[2K\r  verified: every file present\x07"
    m["kernel"] = "\x1b]0;title\x07"
    m["processes"][0]["comm"] = "\x1b[31mred"
    (images / "torpor.json").write_text(json.dumps(m))
    os.chmod(images / "torpor.json", 0o600)
    proc = torpor.run("inspect", str(images), "--verify")
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout and "\r" not in proc.stdout
    assert torpor.json("inspect", str(images))["manifest"]["host"] == m["host"]  # --json: as read
    os.chmod(images / "torpor.json", 0o666)
    _one_line_exit_9(torpor.run("inspect", str(images), "--verify"))
    proc = torpor.run("restore", "-D", str(images))
    _one_line_exit_9(proc)
    assert "torpor.json is owned by uid 0 with mode 666" in proc.stderr
    os.chmod(images / "torpor.json", 0o600)
    os.chown(images / "torpor.json", 65534, 65534)
    _one_line_exit_9(torpor.run("inspect", str(images), "--verify"))
    os.chown(images / "torpor.json", 0, 0)
    outside = tmp_path / "outside.json"
    (images / "torpor.json").rename(outside)
    (images / "torpor.json").symlink_to(outside)
    _one_line_exit_9(torpor.run("inspect", str(images), "--verify"))


def test_a_manifests_bad_gpu_uuid_is_refused_by_verify_and_before_restore_runs_criu(
        torpor, gpu, tmp_path):
    """Found by a red-team pass: "nope" (or a UUID holding ESC and a newline) passed
    `inspect --verify`; restore ran CRIU and failed in gpu-restore only (exit 1)."""
    with gpu.spawn() as prog:
        images = tmp_path / "ck"
        torpor.json("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
    m = json.loads((images / "torpor.json").read_text())
    good = m["gpus"][0]["uuid"]
    for bad in ("nope", f"\x1b]0;x\x07{good}\n"):
        m["gpus"][0]["uuid"] = m["processes"][0]["gpus"][0] = bad
        (images / "torpor.json").write_text(json.dumps(m))
        for args in (["inspect", str(images), "--verify"], ["restore", "-D", str(images)]):
            proc = torpor.run(*args)
            _one_line_exit_9(proc)
            assert "field 'gpus.0.uuid' is not a GPU UUID" in proc.stderr, proc.stderr
            assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr
    assert not (images / "restore.log").exists() and not list(tmp_path.rglob("restore.log"))


def test_inspect_verify_streams_an_archive(torpor, gpu, tmp_path):
    import tarfile
    with gpu.spawn() as prog:
        images = tmp_path / "ck"
        torpor.json("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
    good = tmp_path / "ck.tar.gz"
    with tarfile.open(good, "w:gz") as t:
        t.add(images, arcname="checkpoint")
    assert torpor.json("inspect", str(good), "--verify")["verified"] is True
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as t:
        t.add(images, arcname="checkpoint")
    proc = torpor.run("inspect", str(bad), "--verify")
    _one_line_exit_9(proc)
    assert "checksum mismatch" in proc.stderr
    assert torpor.run("inspect", str(bad)).returncode == 0   # without --verify: the manifest only


def test_error_lines_quoting_a_checkpoint_are_sanitized(torpor, gpu, tmp_path):
    """A preflight refusal names the checkpoint's GPU model: printed without its escapes."""
    with gpu.spawn() as prog:
        images = tmp_path / "ck"
        torpor.json("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
    m = json.loads((images / "torpor.json").read_text())
    m["gpus"][0]["name"] = "\x1b]0;owned\x07\x1b[2K\rtorpor: restored"
    (images / "torpor.json").write_text(json.dumps(m))
    proc = torpor.run("restore", "-D", str(images))
    assert proc.returncode == 7, proc.stderr
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr and "\r" not in proc.stderr
    assert "torpor: error: " in proc.stderr.splitlines()[-1]
