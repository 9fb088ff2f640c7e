"""torpor-runtime's resume of a GPU container (lifecycle.resume): ctr pauses a task around its
checkpoint, and torpor-runtime thaws it for the GPU step and pauses it again after
(checkpoint._Thaw). A torpor-runtime killed in between leaves it running, and the resume ctr
then sends got runc's "container not paused": containerd's shim kept the task as paused,
which runc would neither pause nor resume again (wedged until killed). A resume of a
container the runtime says is running succeeds; every other failure stays runc's."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from torpor.runtime import argv, lifecycle, main
from torpor.runtime.runc import Runtime

CID = "c0ffee0123456789"

FAKE = textwrap.dedent("""\
    #!/bin/sh
    # runc: `resume` fails as runc's does for a container that is not paused ({resume_rc});
    # `state` says {status}; records its argv
    echo "$@" >> {calls}
    for a in "$@"; do
        case "$a" in
            resume) [ {resume_rc} = 0 ] && exit 0
                    echo 'time="x" level=error msg="container not paused"' >&2; exit 1 ;;
            state) [ {status} = gone ] && {{ echo "container does not exist" >&2; exit 1; }}
                   echo '{{"id": "{cid}", "status": "{status}", "pid": 42}}'; exit 0 ;;
        esac
    done
    exit 3
""")


def fake_runc(tmp_path: Path, status: str, resume_rc: int = 1) -> Path:
    p = tmp_path / "runc"
    p.write_text(FAKE.format(calls=tmp_path / "calls", status=status, resume_rc=resume_rc,
                             cid=CID))
    p.chmod(0o755)
    return p


def _resume(cfg, tmp_path: Path, status: str, resume_rc: int = 1) -> int:
    inv = argv.parse(["--root", "/r", "--log", str(tmp_path / "log.json"), "--log-format",
                      "json", "resume", CID])
    return lifecycle.resume(cfg, Runtime(str(fake_runc(tmp_path, status, resume_rc)), inv), inv)


def test_resume_of_a_running_container_succeeds(cfg, tmp_path):
    assert _resume(cfg, tmp_path, "running") == 0
    assert (tmp_path / "calls").read_text().splitlines() == [
        f"--root /r --log {tmp_path / 'log.json'} --log-format json resume {CID}",
        f"--root /r state {CID}"]


@pytest.mark.parametrize("status", ["paused", "stopped", "created", "gone"])
def test_any_other_failed_resume_stays_the_runtimes(cfg, tmp_path, status):
    assert _resume(cfg, tmp_path, status) == 1


def test_a_resume_that_works_asks_nothing_more(cfg, tmp_path):
    assert _resume(cfg, tmp_path, "paused", resume_rc=0) == 0
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


def test_resume_goes_through_the_flow(monkeypatch, tmp_path, torpor_env):
    monkeypatch.setenv("TORPOR_OCI_RUNTIME", str(fake_runc(tmp_path, "running")))

    def exec_(self):
        raise AssertionError("resume handed to the runtime as is")
    monkeypatch.setattr(Runtime, "exec", exec_)
    assert main.main(["--root", "/r", "resume", CID]) == 0
