"""Checkpoint paths are resolved without following links anyone but root could have placed
(issue 18, item 4), whatever fs.protected_symlinks says, and without a window between the
check and the use."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from torpor import files
from torpor.flows import checkpoint as checkpoint_flow
from torpor.errors import UsageError

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, setuid)")
SYSCTL = Path("/proc/sys/fs/protected_symlinks")


@pytest.fixture
def unprotected_symlinks():
    """fs.protected_symlinks=0 for the test where we can set it (the kernel then follows
    anyone's link in a sticky directory: torpor must not), restored after."""
    try:
        before = SYSCTL.read_text().strip()
        SYSCTL.write_text("0")
    except OSError:
        before = None
    yield
    if before is not None:
        SYSCTL.write_text(before)


@pytest.fixture
def sticky(tmp_path: Path) -> Path:
    """A world-writable sticky directory, like /tmp."""
    d = tmp_path / "sticky"
    d.mkdir()
    os.chmod(d, 0o1777)
    return d


@pytest.fixture
def root_only(tmp_path: Path) -> Path:
    d = tmp_path / "root-only"
    d.mkdir(mode=0o700)
    return d


def _as_nobody(cwd: Path, action) -> int:
    """Fork a child that runs action() as nobody in cwd; returns its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.chdir(cwd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
        finally:
            os._exit(0)
    return pid


def _user_link(sticky: Path, target: Path, name: str = "x") -> Path:
    """`ln -s target sticky/name` as nobody."""
    pid = _as_nobody(sticky, lambda: os.symlink(target, name))
    os.waitpid(pid, 0)
    link = sticky / name
    assert link.is_symlink() and os.lstat(link).st_uid == NOBODY
    return link


@needs_root
def test_a_users_link_in_a_sticky_directory_does_not_steer_roots_writes(
        sticky, root_only, unprotected_symlinks):
    link = _user_link(sticky, root_only)
    for call in (lambda: checkpoint_flow._claim_images_dir(link / "ck"),
                 lambda: files.private_dir(link / "ck"),
                 lambda: files.require_trusted_location(link / "ck", "checkpoint"),
                 lambda: files.open_trusted_dir(link, "store")):
        with pytest.raises(UsageError, match=r"x is a symbolic link owned by uid 65534; "
                                             r"torpor follows only root's links") as e:
            call()
        assert "\n" not in str(e.value)
    assert list(root_only.iterdir()) == []


@needs_root
def test_roots_own_links_are_followed_and_resolved(tmp_path, root_only):
    (tmp_path / "via").symlink_to(root_only)
    (root_only / "rel").symlink_to("../root-only/sub")
    fd = checkpoint_flow._claim_images_dir(tmp_path / "via" / "rel" / "ck")
    try:
        assert os.fstat(fd).st_ino == (root_only / "sub" / "ck").stat().st_ino
    finally:
        os.close(fd)
    assert stat.S_IMODE((root_only / "sub").stat().st_mode) == 0o700
    assert files.require_trusted_location(tmp_path / "via" / "rel" / "new" / "x", "checkpoint") \
        == root_only.resolve() / "sub" / "new" / "x"
    found = files.open_trusted_dir(tmp_path / "via" / ".." / "via" / "rel", "store")
    os.close(found.fd)
    assert found.path == root_only.resolve() / "sub"


@needs_root
def test_directories_on_the_way_are_checked_as_held(tmp_path, sticky):
    (sticky / "mine").mkdir()
    os.chown(sticky / "mine", NOBODY, NOBODY)
    with pytest.raises(UsageError, match="mine can be changed by uid 65534"):
        files.private_dir(sticky / "mine" / "ck")
    assert not (sticky / "mine" / "ck").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="exists and is not a directory"):
        checkpoint_flow._claim_images_dir(tmp_path / "file")
    with pytest.raises(NotADirectoryError):
        files.require_trusted_location(tmp_path / "file" / "ck", "checkpoint")


def _claim_images(path: Path) -> os.stat_result:
    fd = checkpoint_flow._claim_images_dir(path)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _claim_suspend_dir(path: Path) -> os.stat_result:
    from torpor import agent_data
    return os.lstat(agent_data.claim_suspend_dir(path))


@needs_root
def _flipping(name: str, target: Path):
    """A user's loop (for _as_nobody): name, in the current directory, made a directory,
    removed, made a link to target and removed, as fast as it goes, for ever."""
    def flip() -> None:
        while True:
            for step in (lambda: os.mkdir(name), lambda: os.rmdir(name),
                         lambda: os.symlink(target, name), lambda: os.unlink(name)):
                with contextlib.suppress(OSError):
                    step()
    return flip


@pytest.mark.parametrize("claim", [_claim_images, _claim_suspend_dir])
def test_a_directory_swapped_for_a_users_link_while_torpor_claims_it(
        sticky, root_only, unprotected_symlinks, claim):
    """A user's program swaps sticky/x between a directory, nothing and a link to root_only
    as fast as it can, while root claims sticky/x/ck again and again: whatever the timing,
    nothing is ever created in root_only, and each claim either refuses with one line or
    holds a directory that is really sticky/x/ck, made by root. For the images directory of
    a checkpoint and for suspend_dir."""

    child = _as_nobody(sticky, _flipping("x", root_only))
    outcomes = {"claimed": 0, "refused": 0}
    # suspend_dir takes back what the user put at sticky/x (agent_data.claim_suspend_dir): a
    # refusal there is rare (the user wins _MAX_SQUATS races in a row), not to be waited for;
    # an entry of the user's taken back is (checked below)
    needed = ("claimed", "refused") if claim is _claim_images else ("claimed", "taken back")
    outcomes["taken back"] = 0
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline or not all(outcomes[k] for k in needed):
            assert time.monotonic() < deadline + 30, outcomes
            outcomes["taken back"] = len(list(sticky.glob("x.squatted-*")))
            try:
                st = claim(sticky / "x" / "ck")
            except UsageError as e:
                assert "\n" not in str(e)
                outcomes["refused"] += 1
            else:
                assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
                assert os.lstat(sticky / "x").st_uid == 0   # root's now: the user cannot swap it
                assert st.st_ino == os.stat(sticky / "x" / "ck").st_ino
                outcomes["claimed"] += 1
                os.rmdir(sticky / "x" / "ck")
                os.rmdir(sticky / "x")
                if claim is _claim_suspend_dir and not outcomes["taken back"] \
                        and outcomes["claimed"] % 8 == 0:
                    _until_the_user_has(sticky / "x")
            assert list(root_only.iterdir()) == [], outcomes
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    moved = list(sticky.glob("x.squatted-*"))          # the user's entries, taken back
    assert all(os.lstat(m).st_uid == NOBODY for m in moved)
    assert bool(moved) == (claim is _claim_suspend_dir)


def _until_the_user_has(name: Path, timeout: float = 0.1) -> None:
    """Wait (a little) until the user's loop has an entry at name. Its entries last only
    between two of its calls, so with both cores busy root's look seldom falls on one: under
    load the race test above took back no entry in 4 s in 3 runs of 5 (a 5 ms pause after
    every 16th claim still left none in 34 s once in 6). The claim after this still races the
    loop, which may have moved on meanwhile."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(name).st_uid == NOBODY:
                return


@needs_root
def test_a_non_root_callers_own_link_in_their_own_directory_is_followed(tmp_path, sticky):
    """A user running torpor on their own files may use their links in their own directories
    (they could write there anyway); not their link in /tmp, nor anyone else's."""
    for d in [tmp_path, *tmp_path.parents]:   # pytest's 0700 base: let others pass
        if d != Path("/") and not d.stat().st_mode & 0o001:
            os.chmod(d, d.stat().st_mode | 0o001)

    def as_user() -> None:
        os.makedirs("home/real", mode=0o700)
        os.symlink("real", "home/link")
        os.symlink("home/real", "tmp-link")
        ok = files.open_trusted_dir(Path("home/link"), "checkpoint")
        assert ok.path == sticky / "home" / "real", ok.path
        try:
            files.open_trusted_dir(Path("tmp-link"), "checkpoint")
        except UsageError as e:
            assert "tmp-link is a symbolic link owned by uid 65534" in str(e), e
        else:
            raise AssertionError("their link in a sticky directory of root's was followed")
        os._exit(0)

    def run() -> None:
        try:
            as_user()
        except BaseException as e:   # the parent sees the exit code
            print(repr(e), file=sys.stderr)
            os._exit(1)
    pid = _as_nobody(sticky, run)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    os.symlink(sticky / "home" / "real", tmp_path / "roots-link")
    with pytest.raises(UsageError, match="home can be changed by uid 65534"):
        files.open_trusted_dir(tmp_path / "roots-link", "checkpoint")  # root: not into theirs


@needs_root
def test_suspend_dir_is_made_without_following_a_users_link(cfg, sticky, root_only,
                                                             unprotected_symlinks):
    """suspend_dir below a sticky directory (/dev/shm): a user's link in it steers nothing:
    it is moved aside (agent_data.claim_suspend_dir), and root makes its own directory
    there."""
    import dataclasses

    from torpor import agent_data
    _user_link(sticky, root_only, "shm")
    c = dataclasses.replace(cfg, suspend_dir=sticky / "shm" / "torpor")
    data = agent_data.DataDir.scratch(c, 7).make()
    assert os.lstat(sticky / "shm").st_uid == 0 and stat.S_ISDIR(os.lstat(sticky / "shm").st_mode)
    assert data.root.parent.parent == sticky / "shm" and data.root.is_dir()
    [moved] = sticky.glob("shm.squatted-*")
    assert os.lstat(moved).st_uid == NOBODY and os.readlink(moved) == str(root_only)
    assert list(root_only.iterdir()) == []


@needs_root
def test_private_dir_needs_no_read_permission_and_tightens_what_is_ours(tmp_path):
    """A user's `torpor run` makes its agent socket dir under a root directory it may only
    pass through (mode 0711), as before."""
    for d in [tmp_path, *tmp_path.parents]:   # pytest's 0700 base: let others pass
        if d != Path("/") and not d.stat().st_mode & 0o001:
            os.chmod(d, d.stat().st_mode | 0o001)
    base = tmp_path / "run"
    base.mkdir(mode=0o711)
    loose = base / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    assert files.private_dir(loose) == loose and stat.S_IMODE(loose.stat().st_mode) == 0o700
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    os.chown(mine, NOBODY, NOBODY)

    def make() -> None:
        files.private_dir(base / "agents-of-nobody")
    # nobody cannot write base: a permission error, not a refusal of the walk itself
    pid = _as_nobody(tmp_path, lambda: os._exit(_exit_code_of(make)))
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 13     # EACCES at mkdirat
    os.chmod(base, 0o1733)   # a sticky drop box nobody may read: mkdirat works, O_RDONLY would not
    pid = _as_nobody(tmp_path, lambda: os._exit(_exit_code_of(make)))
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert os.stat(base / "agents-of-nobody").st_uid == NOBODY


def _exit_code_of(fn) -> int:
    try:
        fn()
    except OSError as e:
        return e.errno or 1
    except Exception:
        return 99
    return 0


def _squat(sticky: Path, kind: str, target: Path) -> None:
    """As nobody: sticky/torpor made first, a directory of theirs (0700, a file in it), a
    link to target, or a file."""
    def make() -> None:
        if kind == "directory":
            os.mkdir("torpor", 0o700)
            Path("torpor/theirs").write_text("nobody's")
        elif kind == "link":
            os.symlink(target, "torpor")
        else:
            Path("torpor").write_text("nobody's")
    pid = _as_nobody(sticky, make)
    os.waitpid(pid, 0)
    assert os.lstat(sticky / "torpor").st_uid == NOBODY


@needs_root
@pytest.mark.parametrize("kind", ["directory", "link", "file"])
def test_root_takes_back_a_name_a_user_took_first_in_a_shared_directory(
        sticky, root_only, unprotected_symlinks, kind, caplog):
    """/dev/shm/torpor made first by a user (any kind of entry) would deny every suspend:
    root swaps in a directory of its own and leaves the user's entry, untouched and theirs,
    beside it; nothing is read, followed or written through it; the log names the user."""
    import logging

    from torpor import agent_data
    _squat(sticky, kind, root_only)
    before = os.lstat(sticky / "torpor")
    with caplog.at_level(logging.WARNING, logger="torpor.agent_data"):
        assert agent_data.claim_suspend_dir(sticky / "torpor") == sticky / "torpor"
    st = os.lstat(sticky / "torpor")
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    assert list((sticky / "torpor").iterdir()) == []
    [moved] = sticky.glob("torpor.squatted-*")
    after = os.lstat(moved)
    assert (after.st_ino, after.st_uid, after.st_mode, after.st_mtime_ns) == \
        (before.st_ino, NOBODY, before.st_mode, before.st_mtime_ns)
    if kind == "directory":
        assert [p.name for p in moved.iterdir()] == ["theirs"]
    assert list(root_only.iterdir()) == []
    assert "\n" not in caplog.text.strip() and f"uid {NOBODY} had put its own entry" in caplog.text
    assert str(moved) in caplog.text
    # again: root's own directory now, nothing to take back
    agent_data.claim_suspend_dir(sticky / "torpor")
    assert os.lstat(sticky / "torpor").st_ino == st.st_ino
    assert len(list(sticky.glob("torpor.squatted-*"))) == 1


@needs_root
def test_root_takes_back_a_name_held_by_a_hard_link_to_a_file_of_roots(sticky, root_only,
                                                                       caplog):
    """With fs.protected_hardlinks=0 anyone may hard-link a file of root's (a secret) to
    sticky/torpor: owned by root, it passed as root's own entry, and every suspend failed on
    it. Root moves the link aside like any squatter; the file is neither read nor changed."""
    import logging

    from torpor import agent_data
    secret = root_only / "secret"
    secret.write_text("root's")
    os.chmod(secret, 0o600)
    os.link(secret, sticky / "torpor")       # what such a user could do; root makes it here
    with caplog.at_level(logging.WARNING, logger="torpor.agent_data"):
        assert agent_data.claim_suspend_dir(sticky / "torpor") == sticky / "torpor"
    st = os.lstat(sticky / "torpor")
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    [moved] = sticky.glob("torpor.squatted-*")
    assert os.lstat(moved).st_ino == os.lstat(secret).st_ino and secret.read_text() == "root's"
    assert stat.S_IMODE(os.lstat(secret).st_mode) == 0o600
    assert "a file of uid 0 that torpor never made (a hard link to it" in caplog.text


@needs_root
def test_root_takes_back_a_name_held_by_a_file_of_roots_renamed_there(sticky, root_only):
    """A file of root's with one link, left in a directory a user may write on the same
    filesystem, can be renamed by that user to sticky/torpor: no link count gives it away,
    but torpor makes only directories there."""
    from torpor import agent_data
    (sticky / "torpor").write_text("root's")
    assert agent_data.claim_suspend_dir(sticky / "torpor") == sticky / "torpor"
    assert stat.S_ISDIR(os.lstat(sticky / "torpor").st_mode)
    [moved] = sticky.glob("torpor.squatted-*")
    assert moved.read_text() == "root's"


@needs_root
def test_a_user_who_keeps_taking_the_name_is_named_in_one_line(sticky, monkeypatch):
    from torpor import agent_data
    _squat(sticky, "directory", sticky)
    monkeypatch.setattr(files, "_move_aside", lambda *a: None)    # they win every race
    with pytest.raises(UsageError, match=rf"suspend_dir {sticky}/torpor: uid {NOBODY} put its "
                                         r"own entry there again each of the "
                                         rf"{files._MAX_SQUATS} times") as e:
        agent_data.claim_suspend_dir(sticky / "torpor")
    assert "\n" not in e.value.line() and "TORPOR_SUSPEND_DIR" in e.value.line()


@needs_root
def test_a_race_for_the_name_never_hands_root_a_users_entry(sticky, root_only,
                                                            unprotected_symlinks):
    """A user's program makes, removes and links sticky/torpor as fast as it can while root
    claims it again and again: each claim ends with a directory of root's there, never
    anything written through the user's entries (before, most were refused: the user's
    directory or link was there)."""
    from torpor import agent_data

    child = _as_nobody(sticky, _flipping("torpor", root_only))
    claimed, refused = 0, []
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                agent_data.claim_suspend_dir(sticky / "torpor")
            except UsageError as e:
                refused.append(str(e))
                continue
            st = os.lstat(sticky / "torpor")
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0, st
            claimed += 1
            os.rmdir(sticky / "torpor")
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert claimed > 10 and refused == [] and list(root_only.iterdir()) == []
    assert all(os.lstat(m).st_uid == NOBODY for m in sticky.glob("torpor.squatted-*"))


@needs_root
def test_a_non_root_torpor_uses_its_own_suspend_dir_and_names_anyone_elses(tmp_path, sticky):
    """A user running torpor for their own programs: their own directory in /dev/shm is
    theirs to use (made if missing); someone else's is one line naming its owner and what
    to do, and is left as it is (only root may move it aside)."""
    from torpor import agent_data
    for d in [tmp_path, *tmp_path.parents]:   # pytest's 0700 base: let others pass
        if d != Path("/") and not d.stat().st_mode & 0o001:
            os.chmod(d, d.stat().st_mode | 0o001)
    (sticky / "theirs").mkdir(mode=0o700)
    os.chown(sticky / "theirs", 12345, 12345)          # a third user's

    def as_user() -> None:
        mine = agent_data.claim_suspend_dir(sticky / "mine")
        assert os.lstat(mine).st_uid == NOBODY
        agent_data.claim_suspend_dir(sticky / "mine")   # again: still theirs, fine
        try:
            agent_data.claim_suspend_dir(sticky / "theirs")
        except UsageError as e:
            line = e.line()
            assert f"suspend_dir {sticky}/theirs belongs to uid 12345, not to uid {NOBODY}" \
                in line and "TORPOR_SUSPEND_DIR" in line and "\n" not in line, line
        else:
            raise AssertionError("another user's suspend_dir was used")

    def run() -> None:
        try:
            as_user()
        except BaseException as e:   # the parent sees the exit code
            print(repr(e), file=sys.stderr)
            os._exit(1)
        os._exit(0)
    pid = _as_nobody(sticky, run)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert os.lstat(sticky / "theirs").st_uid == 12345 and not list(sticky.glob("*.squatted-*"))


@needs_root
def test_a_name_outside_a_shared_directory_is_not_taken_back(tmp_path):
    """Only where anyone may add a name (root's, world-writable, sticky) is another user's
    entry a squatter's; elsewhere an admin gave it to them, and the usual refusal stands."""
    from torpor import agent_data
    base = tmp_path / "srv"
    base.mkdir(mode=0o755)
    (base / "torpor").mkdir(mode=0o700)
    os.chown(base / "torpor", NOBODY, NOBODY)
    with pytest.raises(UsageError, match="can be changed by uid 65534"):
        agent_data.claim_suspend_dir(base / "torpor")
    assert os.lstat(base / "torpor").st_uid == NOBODY and list(base.iterdir()) == [base / "torpor"]
