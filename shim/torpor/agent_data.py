"""Where the in-process agent moves GPU memory (agent/PROTOCOL.md, `prepare`): data files, or
for a suspend the program's own host memory (InProcess: no files at all).

One directory (0700) per operation, one subdirectory (0700) per program named after its PID
at checkpoint, N files (0600) in each:

    <root>/<pid>/gpu-memory-0.bin ... gpu-memory-<N-1>.bin
    <root>/<pid>/gpu-fingerprints.txt   (a checkpoint into the image store: the agent's index
                                         of GPU fingerprints, store/fingerprints.py)

root is `<images dir>/torpor-gpu` for a checkpoint (CRIU ignores what it does not know in its
images directory, the manifest's file table covers the files, podman's --export archive and
containerd's checkpoint carry them), and a private directory under `suspend_dir` (host memory:
/dev/shm) for `torpor suspend`.

Every name is made here from integers (a PID, a file index): none comes from a manifest or an
archive. Files are created with O_EXCL and opened through directory fds with O_NOFOLLOW, so a
symbolic link planted anywhere below root is refused rather than followed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Iterator

from .config import Config
from .errors import CorruptCheckpointError, TorporError, UsageError
from .files import TRUSTED_UIDS, private_dir, reclaim_shared_name, require_trusted_location

from .layout import DATA_DIR, INDEX, STREAMED  # noqa: F401  (names kept here for their users)
MAX_FILES = 16                       # the agent takes 1-16 files per prepare
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# suspend_tmpfs: a tmpfs of transparent huge pages. On the H200 host 16 staged writers filled
# one at 30-35 GB/s where /dev/shm (4 KiB pages) took 16-23 GB/s, and read it back at 29-34
# GB/s against 16-17 (bench/results/host_paths-h200-2026-12-03-*.json); the agent's resumes
# from it were 20 % faster (bench/README.md). within_size keeps small files in small pages.
# size=100%: the suspend checks available memory itself.
HUGE_TMPFS_OPTIONS = "huge=within_size,size=100%,mode=0700,nosuid,nodev,noexec"

SUSPEND_DIR_HINT = "set suspend_dir (TORPOR_SUSPEND_DIR) to a directory of your own"

log = logging.getLogger(__name__)


def file_name(k: int) -> str:
    return f"gpu-memory-{int(k)}.bin"


def file_count(cfg: Config) -> int:
    """Files per program: config agent_files, else one per CPU, 1 to 16 (the agent runs one
    writer thread per file; on the H200 host 16 threads wrote to /dev/shm 1.6 times faster
    than 8: the copy into the page cache, not the GPU, is what bounds them)."""
    if cfg.agent_files:
        return max(1, min(MAX_FILES, cfg.agent_files))
    return min(MAX_FILES, max(1, os.cpu_count() or 2))


def rel_paths(pid: int, count: int) -> list[str]:
    """The files of one program relative to an images directory (manifest file-table keys)."""
    return [f"{DATA_DIR}/{int(pid)}/{file_name(k)}" for k in range(count)]


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def mount_huge_tmpfs(base: Path) -> bool:
    """Mount a tmpfs of huge pages (HUGE_TMPFS_OPTIONS) on base unless it is one already.

    Only on an empty base (a mount must never hide a suspended program's data) and never from
    a mount namespace other than PID 1's (a mount made in a service's private namespace would
    vanish with it, and the data in it). It stays mounted, empty between suspends, costing nothing.
    Where it cannot be (no privilege, an old kernel), base stays a plain directory: slower,
    never wrong. True when base is such a mount now."""
    if _huge_mount(base):
        return True
    try:
        # Two suspends at once must not both mount (the second mount would hide the first
        # one's data): the directory's lock, then everything checked again under it.
        with DataDir._open(base) as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _huge_mount(base):
                return True
            if os.path.ismount(base):
                return False
            with os.scandir(base) as entries:
                if next(entries, None) is not None:
                    return False
            if _private_mount_namespace():
                log.info("suspend_dir %s: not in the host's mount namespace, no huge-page "
                         "tmpfs", base)
                return False
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", HUGE_TMPFS_OPTIONS,
                                "torpor-suspend", str(base)], capture_output=True, text=True,
                               timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        log.info("suspend_dir %s: no huge-page tmpfs: %s", base, e)
        return False
    if r.returncode != 0:
        log.info("suspend_dir %s: no huge-page tmpfs: %s", base, r.stderr.strip())
        return False
    os.chmod(base, 0o700)
    log.info("suspend_dir %s: mounted a tmpfs (%s)", base, HUGE_TMPFS_OPTIONS)
    return True


def claim_suspend_dir(base: Path) -> Path:
    """suspend_dir made (0700) or checked: in a location only root (or we) can change, a
    directory of ours, tightened to 0700. UsageError or TorporError otherwise.

    /dev/shm/torpor lies in a directory anyone may add to, emptied at boot: a user who made
    it first (their own, 0700) would make every suspend fail. Root takes the name back
    (files.reclaim_shared_name: the user's entry moved aside under a random name, untouched,
    a new directory of root's in its place in one atomic swap) and logs it; that holds for
    every name on the way that lies directly in such a directory. A user running torpor
    for their own programs uses their own directory there; someone else's is refused in
    one line naming its owner."""
    where = Path(os.path.abspath(base))
    try:
        for name in [*reversed(where.parents[:-1]), where]:
            moved = reclaim_shared_name(name, "suspend_dir", hint=SUSPEND_DIR_HINT)
            if moved is not None:
                who = (f"a file of uid {moved.uid} that torpor never made (a hard link to "
                       "it, where fs.protected_hardlinks is off, or the file renamed there)"
                       if moved.not_dir and moved.uid == 0
                       else f"uid {moved.uid} had put its own entry")
                log.warning("suspend_dir %s: %s at %s (which would deny every suspend): "
                            "moved aside to %s, untouched, and made torpor's own", base, who,
                            name, moved.moved_to)
        private_dir(base, "suspend_dir")  # made without following anyone's link but root's
        st = os.lstat(base)
    except OSError as e:
        raise TorporError(f"cannot make suspend_dir {base}: {e}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UsageError(f"suspend_dir {base} is not a directory of uid {os.geteuid()} "
                         f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})",
                         hint=SUSPEND_DIR_HINT)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(base, 0o700)
    return base


def _private_mount_namespace() -> bool:
    """Is this process in another mount namespace than PID 1's? (PID 1's unreadable, as in a
    sandbox whose PID 1 is not ours: taken as no, nothing says otherwise.)"""
    try:
        return os.readlink("/proc/self/ns/mnt") != os.readlink("/proc/1/ns/mnt")
    except OSError:
        return False


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, filesystem type, options) of every mount this process sees; [] when
    /proc/self/mounts cannot be read."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    return [(_unescape(f[1]), f[2], f[3].split(","))
            for f in map(str.split, lines) if len(f) >= 4]


def _huge_mount(base: Path) -> bool:
    """Is base a tmpfs mount point with huge pages on?"""
    want = os.path.realpath(base)
    return any(fstype == "tmpfs" and point == want
               and any(o.startswith("huge=") and o != "huge=never" for o in options)
               for point, fstype, options in _mounts())


def in_memory(path: Path) -> bool:
    """Is path on a tmpfs (host memory): is the mount holding it, the longest mount point
    above it, a tmpfs?"""
    want = os.path.realpath(path)
    holding = [(len(point), fstype) for point, fstype, _ in _mounts()
               if want == point or want.startswith(point.rstrip("/") + "/")]
    return bool(holding) and max(holding)[1] == "tmpfs"


def _unescape(field: str) -> str:
    """/proc/self/mounts writes space, tab, newline and backslash as octal escapes."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


class InProcess:
    """A suspend's GPU data kept by the agent in the program's own host memory (config
    suspend_in_process): no files, nothing for torpor to make, protect or remove. The
    program's memory grows by what moved out, as it does when the driver checkpoints it."""

    root = None

    def __repr__(self) -> str:
        return "InProcess()"


class DataDir:
    """The root of one operation's data files (see the module's docstring)."""

    def __init__(self, root: Path, private_parent: bool = False, huge_tmpfs: bool = False):
        self.root = Path(os.path.abspath(root))
        self.private_parent = private_parent   # make() makes the parent too, 0700 and ours
        self.huge_tmpfs = huge_tmpfs           # ... and mounts a huge-page tmpfs on it

    def __repr__(self) -> str:
        return f"DataDir({str(self.root)!r})"

    # -- the root -------------------------------------------------------------------------------
    def make(self) -> "DataDir":
        """Create the root (0700, empty) in an existing directory only root (or we) can change."""
        if self.private_parent:
            claim_suspend_dir(self.root.parent)
            if self.huge_tmpfs:
                mount_huge_tmpfs(self.root.parent)
        require_trusted_location(self.root, "GPU data directory")
        try:
            with self._open(self.root.parent, follow=True) as parent:
                os.mkdir(self.root.name, 0o700, dir_fd=parent)
                with self._open(self.root.name, dir_fd=parent) as fd:
                    os.fchmod(fd, 0o700)
        except FileExistsError:
            raise UsageError(f"{self.root} exists already: the GPU data of an operation goes "
                             "into a new directory") from None
        except OSError as e:
            raise TorporError(f"cannot make the GPU data directory {self.root}: {e}") from e
        return self

    @classmethod
    def scratch(cls, cfg: Config, pid: int) -> "DataDir":
        """Where a suspended program's data goes, in host memory: <suspend_dir>/<pid>-<random>,
        suspend_dir made 0700 and checked ours (by make(): nothing is made before)."""
        base = Path(os.path.abspath(cfg.suspend_dir))
        return cls(base / f"{int(pid)}-{secrets.token_hex(6)}", private_parent=True,
                   huge_tmpfs=cfg.suspend_tmpfs)

    def remove(self, background: bool = False) -> None:
        """Remove the root and everything under it (never following a link out of it).
        background: renamed away at once, deleted by a detached `rm` (giving back tens of GB of
        /dev/shm takes seconds, and the program is running again already)."""
        try:
            if not stat.S_ISDIR(os.lstat(self.root).st_mode):
                return
            if background:
                trash = self.root.with_name(f".{self.root.name}.removed-{secrets.token_hex(4)}")
                os.rename(self.root, trash)
                subprocess.Popen(["rm", "-rf", "--one-file-system", "--", str(trash)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
                return
            shutil.rmtree(self.root)
        except FileNotFoundError:
            pass

    # -- one program's files --------------------------------------------------------------------
    def for_prepare(self, pid: int, count: int) -> list[int]:
        """Make <root>/<pid>/ and its `count` empty files; fds open read-write (close them)."""
        if not 1 <= count <= MAX_FILES:
            raise ValueError(f"{count} data files: 1 to {MAX_FILES} allowed")
        fds: list[int] = []
        try:
            with self._open(self.root) as root:
                os.mkdir(str(int(pid)), 0o700, dir_fd=root)
                with self._open(str(int(pid)), dir_fd=root) as d:
                    os.fchmod(d, 0o700)
                    for k in range(count):
                        fd = os.open(file_name(k), os.O_RDWR | os.O_CREAT | os.O_EXCL
                                     | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=d)
                        fds.append(fd)
                        os.fchmod(fd, 0o600)
        except OSError as e:
            _close_all(fds)
            raise TorporError(f"cannot make the GPU data files of PID {pid} in {self.root}: "
                              f"{e}") from e
        return fds

    def for_resume(self, pid: int, count: int, write: bool = False) -> list[int]:
        """The `count` files of <root>/<pid>/, opened read-only (write: read-write; close
        them). Each must be a regular file no other user could have written."""
        if not 1 <= count <= MAX_FILES:
            raise CorruptCheckpointError(f"{count} GPU data files for PID {pid}: 1 to "
                                         f"{MAX_FILES} expected")
        fds: list[int] = []
        try:
            with self._open(self.root) as root, self._open(str(int(pid)), dir_fd=root) as d:
                for k in range(count):
                    fd = os.open(file_name(k), (os.O_RDWR if write else os.O_RDONLY)
                                 | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
                    fds.append(fd)
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode) or st.st_uid not in TRUSTED_UIDS \
                            or st.st_mode & 0o022:
                        raise CorruptCheckpointError(
                            f"{self.root}/{pid}/{file_name(k)} is not a private regular file "
                            f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        except FileNotFoundError as e:
            _close_all(fds)
            raise CorruptCheckpointError(f"GPU data of PID {pid} missing in {self.root}: "
                                         f"{e.filename or e}") from e
        except OSError as e:
            _close_all(fds)
            raise TorporError(f"cannot open the GPU data files of PID {pid} in {self.root}: "
                              f"{e}") from e
        except BaseException:
            _close_all(fds)
            raise
        return fds

    def new_index(self, pid: int) -> int:
        """<root>/<pid>/INDEX (after for_prepare), new and empty; an fd open read-write."""
        try:
            with self._open(self.root) as root, self._open(str(int(pid)), dir_fd=root) as d:
                fd = os.open(INDEX, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=d)
                os.fchmod(fd, 0o600)
                return fd
        except OSError as e:
            raise TorporError(f"cannot make the GPU fingerprint index of PID {pid} in "
                              f"{self.root}: {e}") from e

    def for_fill(self, pid: int, count: int) -> list[int]:
        """for_resume()'s files opened read-write: the holes of skipped parts get written."""
        return self.for_resume(pid, count, write=True)

    def path(self, pid: int) -> Path:
        return self.root / str(int(pid))

    # -- internals ------------------------------------------------------------------------------
    @staticmethod
    @contextlib.contextmanager
    def _open(path: str | Path, dir_fd: int | None = None, follow: bool = False
              ) -> Iterator[int]:
        flags = _DIR_FLAGS & ~os.O_NOFOLLOW if follow else _DIR_FLAGS
        fd = os.open(path, flags, dir_fd=dir_fd)
        try:
            yield fd
        finally:
            os.close(fd)
