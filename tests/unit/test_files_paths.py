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
@pytest.mark.parametrize("claim", [_claim_images, _claim_suspend_dir])
def test_a_directory_swapped_for_a_users_link_while_torpor_claims_it(
        sticky, root_only, unprotected_symlinks, claim):
    """A user's program swaps sticky/x between a directory, nothing and a link to root_only
    as fast as it can, while root claims sticky/x/ck again and again: whatever the timing,
    nothing is ever created in root_only, and each claim either refuses with one line or
    holds a directory that is really sticky/x/ck, made by root. For the images directory of
    a checkpoint and for suspend_dir."""

    def swap() -> None:
        while True:
            for step in (lambda: os.mkdir("x"), lambda: os.rmdir("x"),
                         lambda: os.symlink(root_only, "x"), lambda: os.unlink("x")):
                with contextlib.suppress(OSError):
                    step()

    child = _as_nobody(sticky, swap)
    outcomes = {"claimed": 0, "refused": 0}
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline or not all(outcomes.values()):
            assert time.monotonic() < deadline + 30, outcomes
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
            assert list(root_only.iterdir()) == [], outcomes
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


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
    """suspend_dir below a sticky directory (/dev/shm): a user's link in it, at any depth,
    steers nothing."""
    import dataclasses

    from torpor import agent_data
    _user_link(sticky, root_only, "shm")
    c = dataclasses.replace(cfg, suspend_dir=sticky / "shm" / "torpor")
    with pytest.raises(UsageError, match="shm is a symbolic link owned by uid 65534"):
        agent_data.DataDir.scratch(c, 7).make()
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
