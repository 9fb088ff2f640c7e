"""Private files and atomic writes: checkpoints hold process memory, secrets included.

Every checkpoint location (images, store, suspend and scratch directories, torpor-runtime's
image path, the state dirs) is reached through open_trusted_dir: walked from / one name at
a time, following only root's links, through directories only trusted uids can change, and
made where missing under the descriptor just checked. So what was checked is what is used,
and a link another user placed, in /tmp or anywhere, steers none of root's writes."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpointError, UsageError

TRUSTED_UIDS = {0, os.geteuid()}


def private_dir(path: Path, what: str = "directory") -> Path:
    """Create path (and parents) as 0700 without following a link anyone but root could have
    placed (open_trusted_dir); tighten an existing one we own. Returns path."""
    os.close(open_trusted_dir(path, what, create=True, readable=False).fd)
    return path


def _writable_by_others(st: os.stat_result) -> bool:
    """Can anyone but a trusted uid add, remove or rename entries (or write the file)?"""
    if st.st_uid not in (0, os.geteuid()):   # TRUSTED_UIDS, as of now
        return True
    open_to_others = st.st_mode & 0o022
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    return bool(open_to_others) and not sticky_dir


def _link_allowed(link: os.stat_result, holder: os.stat_result) -> bool:
    """A symbolic link may be followed if root placed it, or, for a non-root caller, if the
    caller placed it in a directory of their own (they could point it anywhere anyway)."""
    me = os.geteuid()
    return link.st_uid == 0 or (me != 0 and link.st_uid == me and holder.st_uid == me)


@dataclasses.dataclass(frozen=True)
class TrustedDir:
    """A directory reached without following anyone's link but root's: path is its canonical
    name (no links, no ".."), fd an open O_RDONLY descriptor of it (the caller closes it)."""

    path: Path
    fd: int


_MAX_LINKS = 40          # the kernel's own limit (ELOOP)
_MAX_RETRIES = 100       # a name swapped under us this often: give up
_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Walk:
    """The state of one walk: the descriptors of the directories reached, their names."""

    def __init__(self, shown: str, what: str) -> None:
        self.shown, self.what = shown, what
        self.fds: list[int] = []
        self.names: list[str] = []

    def refuse(self, why: str) -> UsageError:
        return UsageError(f"{self.what} {self.shown}: {why}; checkpoints hold process memory: "
                          "use a directory only root can change")

    def where(self, name: str | None = None) -> str:
        return "/" + "/".join(self.names + ([name] if name else []))

    def enter(self, fd: int, name: str | None) -> None:
        st = os.fstat(fd)   # what we hold, not what the name means now
        if _writable_by_others(st):
            os.close(fd)
            raise self.refuse(f"{self.where(name)} can be changed by uid {st.st_uid} "
                              f"(mode {stat.S_IMODE(st.st_mode):o})")
        self.fds.append(fd)
        if name is not None:
            self.names.append(name)

    def follow(self, name: str, st: os.stat_result, todo: list[str]) -> None:
        """Put the target of link name (st: its lstat) on todo, if it may be followed."""
        if not _link_allowed(st, os.fstat(self.fds[-1])):
            raise self.refuse(f"{self.where(name)} is a symbolic link owned by uid {st.st_uid}; "
                              "torpor follows only root's links")
        target = os.readlink(name, dir_fd=self.fds[-1])
        if target.startswith("/"):
            while len(self.fds) > 1:
                os.close(self.fds.pop())
            self.names.clear()
        todo.extend(_components(target))

    def up(self) -> None:
        if self.names:
            os.close(self.fds.pop())
            self.names.pop()

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.pop())


def _components(path: str) -> list[str]:
    """path's names, last first (a stack), "." and empty ones dropped."""
    return [c for c in reversed(path.split("/")) if c not in ("", ".")]


def _absolute(path: Path | str) -> str:
    text = os.fspath(path)
    return text if text.startswith("/") else os.getcwd() + "/" + text  # ".." stays the kernel's


def open_trusted_dir(path: Path, what: str, *, create: bool = False, mode: int = 0o700,
                     readable: bool = True) -> TrustedDir:
    """Open directory path, walking it one name at a time from / with
    openat(O_PATH|O_NOFOLLOW|O_DIRECTORY), whatever fs.protected_symlinks says.

    Every directory reached must be changeable by trusted uids only (root, or us; sticky
    ones like /tmp are fine), as sshd's StrictModes: torpor runs as root, a checkpoint holds
    process memory and CRIU restores credentials from images. A symbolic link is followed
    only if root placed it (or, for a non-root caller, the caller in their own directory);
    anyone else's is refused: it could steer root's writes anywhere. create: missing
    directories are made (mode) with mkdirat under the descriptor just checked, so nothing
    can be slipped in between the check and the use; an existing last one we own is
    tightened to mode. Refusals are UsageError, one line; a missing directory (without
    create) FileNotFoundError, a name that is not a directory NotADirectoryError. The fd is
    O_RDONLY (flock, listdir, fchmod), or O_PATH where not readable."""
    return _open(_absolute(path), str(path), what, create, mode, readable)


def _open(text: str, shown: str, what: str, create: bool, mode: int,
          readable: bool) -> TrustedDir:
    walk = _Walk(shown, what)
    todo = _components(text)
    links = retries = 0
    try:
        walk.enter(os.open("/", _PATH_DIR), None)
        while todo:
            name = todo.pop()
            if name == "..":
                walk.up()
                continue
            try:
                walk.enter(os.open(name, _PATH_DIR, dir_fd=walk.fds[-1]), name)
                continue
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory",
                                            walk.where(name)) from None
                try:
                    os.mkdir(name, mode, dir_fd=walk.fds[-1])
                except FileExistsError:
                    pass                          # someone was first: look at what it is
                except OSError as e:
                    raise type(e)(e.errno, e.strerror, walk.where(name)) from None
            except OSError as e:
                if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise type(e)(e.errno, e.strerror, walk.where(name)) from None
                try:
                    st = os.stat(name, dir_fd=walk.fds[-1], follow_symlinks=False)
                except FileNotFoundError:
                    st = None                     # gone meanwhile: look again
                if st is not None and stat.S_ISLNK(st.st_mode):
                    links += 1
                    if links > _MAX_LINKS:
                        raise walk.refuse("too many levels of symbolic links") from None
                    walk.follow(name, st, todo)
                    continue
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, "Not a directory",
                                             walk.where(name)) from None
            retries += 1
            if retries > _MAX_RETRIES:
                raise walk.refuse(f"{walk.where(name)} keeps changing while torpor opens it")
            todo.append(name)                     # look at it again
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC if readable else _PATH_DIR
        fd = os.open(".", flags, dir_fd=walk.fds[-1])
        try:
            st = os.fstat(fd)
            if create and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & ~mode:
                os.chmod(f"/proc/self/fd/{fd}", mode)   # the directory held (fd may be O_PATH)
        except BaseException:
            os.close(fd)
            raise
        return TrustedDir(Path(walk.where()), fd)
    finally:
        walk.close()


# A name taken back this often, and taken again each time: give up. A user flipping the name
# as fast as it can wins about two races in three on a 2-core machine, so 20 gave up about
# once in 2,500 claims; a try costs tens of microseconds, so a thousand is still quick.
_MAX_SQUATS = 1000
_RENAME_EXCHANGE = 2     # renameat2's flag (linux/fs.h)


@dataclasses.dataclass(frozen=True)
class Squatter:
    """What reclaim_shared_name moved out of the way: whose it was, where it lies now."""

    uid: int
    moved_to: Path
    not_dir: bool = False   # root's own-looking entry that no torpor made: not a directory


def _exchange(dir_fd: int, a: str, b: str) -> None:
    """Swap names a and b of directory dir_fd atomically (renameat2 RENAME_EXCHANGE): neither
    is followed, and at no moment is either name missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", b)
    if fn(dir_fd, a.encode(), dir_fd, b.encode(), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), b)


def _shared(st: os.stat_result) -> bool:
    """A directory like /tmp or /dev/shm: root's, writable by all, sticky."""
    return st.st_uid == 0 and bool(st.st_mode & 0o002) and bool(st.st_mode & stat.S_ISVTX)


def reclaim_shared_name(path: Path, what: str, hint: str | None = None) -> Squatter | None:
    """Make sure path, where it lies directly in a directory like /dev/shm or /tmp (root's,
    world-writable, sticky), is not another user's entry put there first so that torpor
    could not use the name (a directory of theirs would make every suspend fail).

    Root takes the name back: a new 0700 directory of its own is made beside it under a
    random name and the two names are swapped in one step (renameat2 RENAME_EXCHANGE; root
    may, CAP_FOWNER), so the name is never missing and the user cannot slip in between. The
    user's entry, whatever it is (a directory, a link, a file), keeps its owner and content
    under that random name (path.name + ".squatted-<hex>"); nothing in it is read, followed
    or written. A missing name is made (0700). Returns who it was and where it is now; None
    when there was nothing to take back. An entry of root's there that is neither a directory
    nor a link is none torpor made: a user's hard link to a file of root's (where
    fs.protected_hardlinks=0 lets anyone make one), or such a file renamed there from a
    directory of theirs. Root moves it aside the same way (not_dir set; the file itself is not
    touched). A user who takes the name
    again each time
    (_MAX_SQUATS) is refused in one line naming them. A caller who is not root cannot take
    back another's entry: refused in one line naming its owner (hint: what to do instead).
    Elsewhere (no such parent, or one that is not shared) nothing happens; root's entries are
    left as they are. Either way open_trusted_dir's checks follow."""
    path = Path(_absolute(path))
    me = os.geteuid()
    try:
        parent = open_trusted_dir(path.parent, what, readable=False)
    except FileNotFoundError:
        return None
    try:
        if not _shared(os.fstat(parent.fd)):
            return None
        shown = f"{what} {path}"
        for _ in range(_MAX_SQUATS):
            try:
                st = os.stat(path.name, dir_fd=parent.fd, follow_symlinks=False)
            except FileNotFoundError:
                try:
                    os.mkdir(path.name, 0o700, dir_fd=parent.fd)
                    return None
                except FileExistsError:
                    continue                      # someone was first: look at what it is
            if st.st_uid in (0, me) and not (me == 0 and _not_dir(st)):
                return None                       # ours, or root's: open_trusted_dir decides
            if me != 0:
                raise UsageError(f"{shown} belongs to uid {st.st_uid}, not to uid {me}: torpor "
                                 "can neither use it nor move it aside", hint=hint)
            moved = _move_aside(parent.fd, path.name, st, shown)
            if moved is not None:
                return Squatter(moved[0].st_uid, parent.path / moved[1], _not_dir(moved[0]))
        raise UsageError(f"{shown}: uid {st.st_uid} put its own entry there again each of the "
                         f"{_MAX_SQUATS} times torpor took the name back", hint=hint)
    finally:
        os.close(parent.fd)


def _not_dir(st: os.stat_result) -> bool:
    """An entry that is neither a directory nor a link: at a name in a shared directory where
    torpor only ever makes directories, a file of root's is someone's plant (a hard link, or
    a file renamed there), not root's own entry."""
    return not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode)


def _move_aside(dir_fd: int, name: str, seen: os.stat_result, shown: str
                ) -> tuple[os.stat_result, str] | None:
    """Swap name (seen: its lstat, another user's) with a new 0700 directory of ours: what was
    moved aside (its lstat) and its name now, or None to look again (name went meanwhile, or
    a torpor running beside this one took it back first: its directory is given back)."""
    aside = f"{name}.squatted-{secrets.token_hex(6)}"
    os.mkdir(aside, 0o700, dir_fd=dir_fd)         # root's: no user can rename or enter it
    try:
        _exchange(dir_fd, aside, name)
    except FileNotFoundError:
        os.rmdir(aside, dir_fd=dir_fd)
        return None
    except OSError as e:
        os.rmdir(aside, dir_fd=dir_fd)
        raise UsageError(f"{shown} belongs to uid {seen.st_uid} and cannot be moved aside: "
                         f"{e.strerror}") from None
    moved = os.stat(aside, dir_fd=dir_fd, follow_symlinks=False)
    if moved.st_uid == 0 and stat.S_ISDIR(moved.st_mode):
        # another torpor took the name back between our look and our swap: its directory
        # (its data may be in it already) goes back where it was, ours (empty) goes
        _exchange(dir_fd, aside, name)
        os.rmdir(aside, dir_fd=dir_fd)
        return None
    return moved, aside


def trusted_path(path: Path, what: str) -> Path:
    """path's canonical name if open_trusted_dir would open it; its missing tail (created
    later, by private_dir, with the same checks) appended as given. A last name that is a
    file is checked as an image file is (require_trusted_file), its directory as above; a
    file on the way is NotADirectoryError."""
    parts = Path(_absolute(path)).parts
    for n in range(len(parts), 0, -1):
        try:
            found = _open("/".join(parts[:n]), str(path), what, False, 0o700, False)
        except FileNotFoundError:
            continue
        except NotADirectoryError as e:
            if n != len(parts):
                raise NotADirectoryError(e.errno, e.strerror, os.fspath(path)) from None
            continue
        os.close(found.fd)
        real = found.path.joinpath(*parts[n:])
        if n == len(parts) - 1:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(real)
                if stat.S_ISLNK(st.st_mode) and not _link_allowed(st, os.stat(found.path)) \
                        or not stat.S_ISLNK(st.st_mode) and _writable_by_others(st):
                    raise UsageError(f"{what} {path}: {real} is owned by uid {st.st_uid} with "
                                     f"mode {stat.S_IMODE(st.st_mode):o}; checkpoints hold "
                                     "process memory: use a directory only root can change")
        return real
    raise UsageError(f"{what} {path}: not a directory")  # not reached: / is a directory


def require_trusted_location(path: Path, what: str) -> Path:
    """Refuse a checkpoint location that someone other than root (or us) could swap or steer
    through a link (open_trusted_dir says which); returns its canonical name. What is missing
    of it yet is fine: private_dir creates it, 0700, with the same checks."""
    return trusted_path(path, what)


def remove_lone_file(dir_fd: int, name: str, unless: bytes) -> bool:
    """Remove name if it is the only entry of directory dir_fd and a regular file whose last
    4 KiB lack unless (a failed dump's log, not a good one); True if it was removed."""
    if os.listdir(dir_fd) != [name]:
        return False
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return False     # a link, or gone
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        f.seek(max(0, st.st_size - 4096))
        if unless in f.read(4096):
            return False
    os.unlink(name, dir_fd=dir_fd)
    return True


def require_trusted_file(path: Path) -> str | None:
    """Why path (an image file) could have been written by someone else, or None."""
    st = os.lstat(path)
    if _writable_by_others(st):
        return f"{path.name} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}"
    return None


def _open_in(directory: Path, rel: str) -> int:
    """fd of rel inside directory, read-only, never through a link below directory."""
    parts = rel.split("/")
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                       dir_fd=dfd)
    finally:
        os.close(dfd)


def open_untrusted(directory: Path, rel: str) -> tuple[int, os.stat_result]:
    """Open rel (a file torpor reads from a checkpoint directory) safely: no link followed
    below directory (openat from its fd, O_NOFOLLOW), no blocking open (O_NONBLOCK: a FIFO
    cannot hang torpor), a regular file only (fstat after the open). Returns (fd, its stat).
    FileNotFoundError when it is not there; CorruptCheckpointError (exit 9) for anything else
    that is wrong."""
    where = f"{directory}/{rel}"
    try:
        fd = _open_in(directory, rel)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CorruptCheckpointError(f"{where} is a symbolic link or lies under one: "
                                         "refused") from None
        raise CorruptCheckpointError(f"cannot read {where}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{where} is not a regular file: refused")
    return fd, st


def read_small_file(path: Path | str, cap: int) -> bytes:
    """The bytes of a small file a user names (a config, an OCI spec, an auth file): a regular
    file (a link to one is fine) of at most cap bytes, opened without blocking, so that a FIFO,
    /dev/zero or a tty there is refused, never waited on or read forever. FileNotFoundError
    and other OSErrors as they come; ValueError "not a regular file" or "larger than CAP
    bytes" for what is not such a file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        chunks, left = [], cap + 1
        while left > 0 and (block := os.read(fd, min(left, 1 << 20))):
            chunks.append(block)
            left -= len(block)
    finally:
        os.close(fd)
    if left <= 0:
        raise ValueError(f"larger than {cap} bytes")
    return b"".join(chunks)


def read_untrusted(directory: Path, rel: str, cap: int) -> bytes:
    """The whole of rel in directory (open_untrusted), refused past cap bytes."""
    fd, st = open_untrusted(directory, rel)
    try:
        if st.st_size > cap:
            raise CorruptCheckpointError(f"{directory}/{rel} is implausibly large "
                                         f"({st.st_size} bytes, at most {cap} expected)")
        chunks, left = [], cap + 1
        while left > 0:
            block = os.read(fd, min(left, 1 << 20))
            if not block:
                break
            chunks.append(block)
            left -= len(block)
        data = b"".join(chunks)
    except OSError as e:
        raise CorruptCheckpointError(f"cannot read {directory}/{rel}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > cap:
        raise CorruptCheckpointError(f"{directory}/{rel} grew past {cap} bytes while read")
    return data


def read_untrusted_tail(directory: Path, rel: str, n: int) -> bytes:
    """The last n bytes of rel in directory (open_untrusted)."""
    fd, st = open_untrusted(directory, rel)
    try:
        return os.pread(fd, n, max(0, st.st_size - n))
    finally:
        os.close(fd)


def printable(text: object, limit: int = 200) -> str:
    """text (from a checkpoint, untrusted) fit for a terminal: control characters and
    escapes become '?', at most limit characters. Every printer of checkpoint strings uses it."""
    s = str(text)
    out = "".join(c if c.isprintable() else "?" for c in s[:limit])
    return out + ("..." if len(s) > limit else "")


def write_new(path: Path, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Write data into a file that must not exist yet (O_EXCL refuses anything planted) and
    fsync it (durable); nothing is left behind if that fails. The file gets mode exactly: the
    umask (torpor-runtime's is 077) must not turn the 0644 config.json oci.save keeps into 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """Make the names in a directory (a rename, a new link) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o600, tmp_dir: Path | None = None, *,
                 durable: bool = True) -> None:
    """Write to a temporary name, fsync, rename, fsync the directory. The temporary file is in
    path's directory, or in tmp_dir (same filesystem) where leftovers are collected.

    durable=False leaves out both fsyncs: the rename alone already shows every reader the whole
    file or the old one, however the writer dies (SIGKILL included); only a crash of the kernel
    or the machine can lose it. For what means nothing after one: see journal.CRASH_ONLY."""
    tmp = (tmp_dir or path.parent) / f".{path.name}.tmp.{os.getpid()}"
    tmp.unlink(missing_ok=True)  # a leftover of ours
    write_new(tmp, data, mode, durable=durable)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_json(path: Path, obj: object, *, durable: bool = True) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(),
                 durable=durable)


def tree_size(path: Path, allocated: bool = False) -> int:
    """The bytes of the files under path; allocated: those written (holes not counted: the
    agent sizes its data files before it writes them)."""
    total = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(root, n))
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512 if allocated else st.st_size
    return total


def loads_json(data: bytes | str) -> Any:
    """json.loads for what comes from outside torpor (a checkpoint, an archive, the store, an
    agent, an OCI bundle): every malformation, nesting too deep for the parser (a
    RecursionError) included, is a ValueError for the caller to turn into its one line."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
