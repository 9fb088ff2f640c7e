"""torpor-runtime's "the runtime no longer knows this container" (lifecycle._gone): delete
and a create's stale-marker check read it from the runtime's `state` error. runc and crun
word it differently; another error (a rootfs path that does not exist) must not read as it.
A fake runtime answers `state` as each one does, writing its error where each writes it."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

import pytest

from torpor.runtime import argv, lifecycle
from torpor.runtime.runc import Runtime, without_log

CID = "c0ffee0123456789"

# what each runtime prints when `state` finds no container of the id (and a few that are
# other errors); {cid}: the id asked about
WORDINGS = {
    "runc": ('time="2024-01-01T00:00:00Z" level=error msg="container does not exist"', True),
    "runc-1.0": ('time="2021-01-01T00:00:00Z" level=error msg="container \\"{cid}\\" does not '
                 'exist"', True),
    "runc-1.0-plain": ('container "{cid}" does not exist', True),
    "runc-1.0-another-id": ('level=error msg="container \\"x{cid}\\" does not exist"', False),
    "crun-1.22+": ("crun: container `{cid}` does not exist: open `/run/crun/{cid}/status`: "
                   "No such file or directory", True),
    "crun-older": ("crun: error opening file `/run/crun/{cid}/status`: No such file or "
                   "directory", True),
    "crun-rootless-older": ("crun: error opening file `/run/user/1000/crun/{cid}/status`: "
                            "No such file or directory", True),
    "crun-another-id": ("crun: container `other` does not exist: open "
                        "`/run/crun/other/status`: No such file or directory", False),
    "crun-another-id-older": ("crun: error opening file `/run/crun/x{cid}/status`: No such "
                              "file or directory", False),
    "crun-status-missing": ("crun: open `/run/crun/{cid}/status`: No such file or directory",
                            False),   # 1.22+: the state directory is there, its status not
    "rootfs": ("crun: the rootfs path `/var/lib/x/rootfs` does not exist: No such file or "
               "directory", False),
    "runc-other": ('time="x" level=error msg="open /run/runc/{cid}/state.json: permission '
                   'denied"', False),
    "config": ('time="x" level=error msg="config file /etc/foo.json does not exist"', False),
}


@pytest.mark.parametrize("wording", WORDINGS, ids=WORDINGS.keys())
def test_each_runtimes_words_for_a_missing_container_and_no_others(wording):
    text, missing = WORDINGS[wording]
    message = f"crun state {CID} failed: {text.format(cid=CID)}"
    assert lifecycle.says_missing(message, CID) is missing


def test_the_id_is_matched_as_a_string_not_a_pattern():
    assert not lifecycle.says_missing("crun: container `a_b` does not exist: x", "a.b")
    assert lifecycle.says_missing("crun: container `a.b` does not exist: x", "a.b")


FAKE = textwrap.dedent("""\
    #!/bin/sh
    # answers `state` as {name} does for an id it does not know; records its argv
    echo "$@" >> {calls}
    log=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --log) log="$2"; shift 2 ;;
            --log=*) log="${{1#--log=}}"; shift ;;
            --log-format) shift 2 ;;
            --root) shift 2 ;;
            state) shift; break ;;
            *) shift ;;
        esac
    done
    msg={msg}
    if [ -n "$log" ] && [ {name} = crun ]; then
        echo "$msg" >> "$log"      # crun: the error only into --log where one is given
    else
        echo "$msg" >&2
    fi
    exit 1
""")


def fake_runtime(tmp_path: Path, name: str, msg: str) -> Path:
    p = tmp_path / name
    p.write_text(FAKE.format(name=name, calls=tmp_path / "calls", msg=shlex.quote(msg)))
    p.chmod(0o755)
    return p


@pytest.mark.parametrize("name, wording", [("runc", "runc"), ("crun", "crun-1.22+"),
                                           ("crun", "crun-older")])
def test_a_delete_under_containerds_log_options_finds_the_container_gone(tmp_path, name,
                                                                         wording):
    """containerd's shim gives every call --log <bundle>/log.json --log-format json; crun
    then writes its error there only, and the question must still be answered (and leave
    nothing in the engine's log)."""
    log = tmp_path / "log.json"
    path = fake_runtime(tmp_path, name, WORDINGS[wording][0].format(cid=CID))
    inv = argv.parse(["--root", "/r", "--log", str(log), "--log-format=json", "delete", CID])
    assert lifecycle._gone(Runtime(str(path), inv), CID)
    assert (tmp_path / "calls").read_text() == f"--root /r state {CID}\n"
    assert not log.exists()


def test_another_error_is_not_a_missing_container(tmp_path):
    path = fake_runtime(tmp_path, "crun", WORDINGS["rootfs"][0])
    inv = argv.parse(["--root", "/r", "delete", CID])
    assert not lifecycle._gone(Runtime(str(path), inv), CID)


@pytest.mark.parametrize("given, kept", [
    (["--log", "/l", "--root", "/r"], ["--root", "/r"]),
    (["--log=/l", "-log-format", "json", "--systemd-cgroup"], ["--systemd-cgroup"]),
    (["-log", "/l", "--log-format=text", "--root=/r", "--debug"], ["--root=/r", "--debug"]),
    (["--root", "/r", "--criu", "/c"], ["--root", "/r", "--criu", "/c"]),
])
def test_without_log_leaves_every_other_global_option(given, kept):
    inv = argv.parse([*given, "state", CID])
    assert inv.global_args == given
    assert without_log(inv.global_args) == kept
