"""torpor-criu-helper's pieces that need no CRIU: the manifest it reads back from an images
directory (untrusted: an archive from elsewhere), the GPU placement it derives, its command
line's contract with the plugin (one result line on success, one error line and an ExitCode
otherwise)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torpor import criu_plugin
from torpor.errors import CorruptCheckpointError, ExitCode, PreflightError
from torpor.flows.container import CudaProcess
from torpor.gpus import Gpu, Inventory

A, B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
H200 = "NVIDIA H200"


def _manifest(**over) -> dict:
    m = {"format": criu_plugin.FORMAT, "version": criu_plugin.VERSION, "op_id": "op-1",
         "root_pid": 42, "pids": [42],
         **criu_plugin.gpu_entries([CudaProcess(42, "RUNNING", (A,), 1 << 30, {A: 1 << 30})],
                                   Inventory("570", [Gpu(0, A, H200, 80 << 30, 80 << 30)], [])),
         "agents": {"42": {"nspid": 1, "files": [4096], "bytes": 4096}}}
    m.update(over)
    return m


def _write(tmp_path: Path, m: object) -> Path:
    (tmp_path / criu_plugin.MANIFEST).write_text(json.dumps(m))
    return tmp_path


def test_a_manifest_written_by_lock_reads_back(tmp_path: Path) -> None:
    m = criu_plugin.read_manifest(_write(tmp_path, _manifest()))
    assert m["gpus"] == [{"uuid": A, "name": H200}]
    assert [(a.pid, a.nspid, a.files) for a in m["agents"]] == [(42, 1, (4096,))]


@pytest.mark.parametrize("bad", [
    {"format": "torpor"}, {"version": 2}, {"op_id": 7}, {"agents": []},
    {"agents": {"42": {"nspid": 0, "files": [1]}}},
    {"agents": {"42": {"nspid": 1, "files": [-1]}}},
    {"agents": {"x": {"nspid": 1, "files": [1]}}},
    {"gpus": [{"uuid": A}]}, {"gpus": "A"},
    {"processes": [{"pid": 42, "gpus": [B], "gpu_memory": 0, "gpu_memory_by_gpu": {}}]},
    {"processes": [{"pid": 42, "gpus": [A], "gpu_memory": -1, "gpu_memory_by_gpu": {}}]},
    {"processes": [{"pid": "42", "gpus": [A], "gpu_memory": 0, "gpu_memory_by_gpu": {}}]},
    # the same rules as torpor.json's (manifest_types): NVML's UUIDs, Linux PIDs
    *({"gpus": [{"uuid": u, "name": H200}],
       "processes": [{"pid": 42, "gpus": [u], "gpu_memory": 0, "gpu_memory_by_gpu": {}}]}
      for u in ("nope", A + "\n")),
    {"processes": [{"pid": 1 << 22, "gpus": [A], "gpu_memory": 0, "gpu_memory_by_gpu": {}}]},
    {"agents": {str(1 << 22): {"nspid": 1, "files": [1]}}},
], ids=lambda d: f"{next(iter(d))}-{json.dumps(d)[:40]}")
def test_a_tampered_manifest_is_corrupt(tmp_path: Path, bad: dict) -> None:
    with pytest.raises(CorruptCheckpointError):
        criu_plugin.read_manifest(_write(tmp_path, _manifest(**bad)))


def test_not_json_a_symlink_or_a_huge_manifest_is_corrupt(tmp_path: Path) -> None:
    (tmp_path / criu_plugin.MANIFEST).write_text("{")
    with pytest.raises(CorruptCheckpointError):
        criu_plugin.read_manifest(tmp_path)
    (tmp_path / criu_plugin.MANIFEST).unlink()
    other = tmp_path / "elsewhere.json"
    other.write_text(json.dumps(_manifest()))
    (tmp_path / criu_plugin.MANIFEST).symlink_to(other)
    with pytest.raises(CorruptCheckpointError, match="cannot open"):
        criu_plugin.read_manifest(tmp_path)
    (tmp_path / criu_plugin.MANIFEST).unlink()
    (tmp_path / criu_plugin.MANIFEST).write_text(" " * (criu_plugin.MAX_MANIFEST + 1))
    with pytest.raises(CorruptCheckpointError, match="larger"):
        criu_plugin.read_manifest(tmp_path)


def test_placement_same_gpu_another_of_its_model_or_refused(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.delenv("TORPOR_GPU_MAP", raising=False)
    m = criu_plugin.read_manifest(_write(tmp_path, _manifest()))
    here = Inventory("570", [Gpu(0, A, H200, 80 << 30, 80 << 30)], [])
    assert criu_plugin.gpu_map(m, here) == {}                       # same GPU: no pairs
    elsewhere = Inventory("570", [Gpu(0, B, H200, 80 << 30, 80 << 30)], [])
    assert criu_plugin.gpu_map(m, elsewhere) == {A: B}
    full = Inventory("570", [Gpu(0, B, H200, 80 << 30, 1 << 20)], [])
    with pytest.raises(PreflightError):
        criu_plugin.gpu_map(m, full)
    monkeypatch.setenv("TORPOR_GPU_MAP", f"{A}={B}")
    assert criu_plugin.gpu_map(m, None) == {A: B}                   # no NVML: the map given


def test_without_nvml_at_the_dump_only_the_explicit_map(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORPOR_GPU_MAP", raising=False)
    entries = criu_plugin.gpu_entries([CudaProcess(42, "RUNNING", (A,), 0, {})], None)
    m = criu_plugin.read_manifest(_write(tmp_path, _manifest(**entries)))
    assert m["gpus"] == [{"uuid": A, "name": ""}]
    assert criu_plugin.gpu_map(m, Inventory("570", [], [])) == {}


@pytest.mark.parametrize("argv", [["restore", "--images", "/", "--pids", "1,x"],
                                  ["restore", "--images", "/", "--pids", "0"],
                                  ["lock", "--pid", "1", "--images", "relative", "--criu-pid", "2"],
                                  ["check", "--images", "/nonexistent-dir"]])
def test_bad_arguments_are_one_line_and_no_result(argv: list[str], capsys) -> None:
    try:
        rc = criu_plugin.main(argv)
    except SystemExit as e:     # argparse's own usage errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == ExitCode.USAGE and criu_plugin.RESULT not in out
    assert err.strip() and (err.count("\n") == 1 or "usage:" in err)


def test_check_of_a_corrupt_manifest_says_so_and_exits_corrupt(tmp_path: Path, capsys) -> None:
    (tmp_path / criu_plugin.MANIFEST).write_text("[]")
    assert criu_plugin.main(["check", "--images", str(tmp_path)]) == ExitCode.CORRUPT
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and criu_plugin.MANIFEST in err
    assert os.path.exists(tmp_path / criu_plugin.MANIFEST)


class _Exec(Exception):
    pass


def test_torpor_runtime_hands_runc_the_marker_that_keeps_the_plugin_out(
        monkeypatch: pytest.MonkeyPatch, torpor_env) -> None:
    """torpor-runtime locks the GPU itself: the CRIU its runc starts (runc hands CRIU its
    environment) must see TORPOR_CRIU_PLUGIN=off, for every command it passes on."""
    from torpor.runtime import main as rt_main

    monkeypatch.delenv("TORPOR_CRIU_PLUGIN", raising=False)
    monkeypatch.setenv("TORPOR_OCI_RUNTIME", "/bin/true")
    seen: dict[str, str | None] = {}

    def execv(path: str, argv: list[str]) -> None:
        seen["marker"] = os.environ.get("TORPOR_CRIU_PLUGIN")
        raise _Exec()
    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(_Exec):
        rt_main.main(["--root", "/r", "state", "c1"])
    assert seen == {"marker": "off"}


def test_the_clis_criu_environment_carries_the_marker() -> None:
    from torpor import criu
    assert criu.CLEAN_ENV["TORPOR_CRIU_PLUGIN"] == "off"


def test_held_by_torpor_never_twice_and_not_for_a_running_tree() -> None:
    from torpor.sidecar.convert import ProcessStatus
    running = ProcessStatus(42, True, True, "RUNNING")
    plain = ProcessStatus(41, True, False)
    assert criu_plugin.held_by_torpor([plain, running]) is None
    assert "operation op-7" in criu_plugin.held_by_torpor(
        [plain, ProcessStatus(42, True, True, "RUNNING", op_id="op-7")])
    assert "already CHECKPOINTED" in criu_plugin.held_by_torpor(
        [plain, ProcessStatus(42, True, True, "CHECKPOINTED")])
    assert "already LOCKED" in criu_plugin.held_by_torpor([ProcessStatus(42, True, True, "LOCKED")])


def test_a_manifest_that_cannot_be_written_rolls_the_lock_back_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The lock happened, the manifest write failed (a full disk): torpord rolls back, the
    helper says one line and gives no result, so the plugin refuses the dump."""
    from torpor.sidecar.convert import Checkpointed, ProcessStatus
    calls: list[str] = []

    class Fake:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def status(self, pids):
            return type("S", (), {"processes": (ProcessStatus(os.getpid(), True, True,
                                                              "RUNNING"),)})()

        def lock_and_checkpoint(self, pids, **kw):
            calls.append("lock")
            return Checkpointed("op-9", (os.getpid(),), (), {}, 0.0)

        def rollback(self, op_id, timeout=None):
            calls.append(f"rollback {op_id}")

    def full(path, obj):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(criu_plugin, "_client", Fake)
    monkeypatch.setattr(criu_plugin, "write_json", full)
    rc = criu_plugin.main(["lock", "--pid", str(os.getpid()), "--images", str(tmp_path),
                           "--criu-pid", "1"])
    out, err = capsys.readouterr()
    assert rc == ExitCode.ERROR and calls == ["lock", "rollback op-9"]
    assert criu_plugin.RESULT not in out and err.count("\n") == 1 and "No space" in err
