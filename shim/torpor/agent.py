"""The client side of the in-process agent (agent/, libtorpor-agent.so): one Unix socket per
program, `<agent_dir>/agent-<nspid>.sock`, one command a line, one JSON object a reply
(agent/PROTOCOL.md is the contract).

    with AgentClient.for_pid(1234) as a:
        a.status()     # {"pid", "state", "gate", "in_flight", "allocations", "bytes", ...}
        a.close(5000)  # gate closed, calls in flight done, contexts synchronized (or AgentError)
        a.open()
        a.prepare(fds, 10_000)   # movable GPU memory into the files (fds: empty, read-write)
        a.detach()               # the agent lets go of the files: the dump may come
        a.resume(fds)            # the memory back from the files (fds: read-only)
        held = a.detach_hold()   # (after a prepare that says "held": N) the GPU memory's own
        a.resume(fds, held=held) # descriptors held here through the dump: mapped back, no copy
        a.prepare([], 10_000)    # no files: into the program's own host memory (a suspend)
        a.resume()               # ... and back from there

<nspid> is the program's pid in its own pid namespace (a container's agent directory is one
per container). The agent accepts only root and the program's own uid (SO_PEERCRED). We trust
the socket only when root or the program's uid owns it (another user could otherwise plant one
in its place), and only when the process listening on it is the program we mean (a program in
another pid namespace may share its nspid).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket
import stat
import struct
from pathlib import Path
from typing import Any, Iterator, Sequence

from . import fdbag
from .errors import ExitCode, NotFoundError, TorporError
from .fdbag import HOLD_DIRECT
from .files import loads_json

log = logging.getLogger(__name__)

DEFAULT_DIR = Path("/run/torpor/agents")
REPLY_MAX = 1 << 20
MAX_FILES = 16                       # what one `prepare` accepts
HOLD_MAX = 8192                      # held descriptors at most (PROTOCOL.md): past HOLD_DIRECT,
                                     # in one bag (fdbag.py)
STATES = ("running", "prepared", "detached")
LIBRARY = Path(__file__).resolve().parent / "_agent" / "libtorpor-agent.so"
# How an agent older than `prepare ... host=N` (PROTOCOL.md) refuses it: its parser takes
# "T host=N" for the timeout, and nothing else in a prepare of ours makes any agent say this.
BEFORE_HOST_BUDGET = "bad timeout"


class AgentError(TorporError):
    """refusal: the agent's own error text when it answered {"ok":false}; "" when the
    failure is torpor's finding (no reply, a bad one)."""

    def __init__(self, message: str, *, refusal: str = "", **kw: Any):
        super().__init__(message, **kw)
        self.refusal = refusal


@contextlib.contextmanager
def held_fds(held: Sequence[int]) -> Iterator[list[int]]:
    """fdbag.carried for a command to an agent: AgentError when no bag can be made."""
    try:
        with fdbag.carried(held) as sent:
            yield sent
    except fdbag.BagError as e:
        raise AgentError(str(e)) from e


def takes_bags(status: dict[str, Any]) -> bool:
    """Does an agent with this status hold past HOLD_DIRECT allocations when asked
    (`prepare ... bag`; its hold_max, absent before 2026-12-07)?"""
    hold_max = status.get("hold_max")
    return isinstance(hold_max, int) and not isinstance(hold_max, bool) and \
        hold_max > HOLD_DIRECT


class _Unheld(Exception):
    """detach_hold: the agent's descriptors did not come as it said."""


class NoAgentError(NotFoundError):
    """No agent serves this program: no socket, or a stale one nobody listens on."""


def library() -> Path:
    """The agent library the package build made (setup.py builds agent/ into torpor/_agent/)."""
    if not LIBRARY.is_file():
        raise NotFoundError(f"the torpor agent library is missing ({LIBRARY})",
                            hint="reinstall torpor: the build compiles agent/ with make and gcc")
    return LIBRARY


def preload_env(env: dict[str, str], agent_dir: Path, libcuda: str) -> dict[str, str]:
    """env with the agent preloaded (ahead of any LD_PRELOAD already there), its socket
    directory and the driver it should wrap."""
    out = dict(env)
    out["LD_PRELOAD"] = " ".join(filter(None, [str(library()), env.get("LD_PRELOAD", "")]))
    out["TORPOR_AGENT_DIR"] = str(agent_dir)
    if libcuda != "libcuda.so.1":
        out["TORPOR_AGENT_LIBCUDA"] = libcuda
    return out


def default_dir() -> Path:
    """Where bare programs' agents put their sockets ($TORPOR_AGENT_DIR, as `torpor run`)."""
    return Path(os.environ.get("TORPOR_AGENT_DIR") or DEFAULT_DIR)


def container_dirs(run_dir: Path) -> Path:
    """Under here, one socket directory per container (bound to /run/torpor/agents inside)."""
    return run_dir / "agents"


def container_dir(run_dir: Path, name: str) -> Path:
    """A container's socket directory on the host (torpor-runtime makes it at create), named
    by the container's name at torpor (oci.container_name: <id>@<runtime root key>, or <id>
    alone for a container an earlier torpor created); UsageError for any other name, so none
    leads outside container_dirs."""
    from .oci import validate_container_name
    return container_dirs(run_dir) / validate_container_name(name)


def socket_path(nspid: int, agent_dir: Path | None = None) -> Path:
    """The socket of the program whose pid in its own pid namespace is nspid."""
    return (agent_dir or default_dir()) / f"agent-{int(nspid)}.sock"


def socket_of(pid: int, agent_dir: Path | None = None) -> Path | None:
    """The agent socket of host process pid, or None when there is none (the program does not
    run under the agent: the normal case)."""
    from .procs import nspid
    n = nspid(pid)
    if n is None:
        return None
    path = socket_path(n, agent_dir)
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return path


def _peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _int(reply: dict[str, Any], key: str, what: str) -> int:
    v = reply.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise AgentError(f"the agent's {what} reply has no valid '{key}': {v!r}")
    return v


def _number(reply: dict[str, Any], key: str, what: str) -> float:
    v = reply.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e9:
        raise AgentError(f"the agent's {what} reply has no valid '{key}': {v!r}")
    return float(v)


def _with_phases(out: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """out plus the reply's "phases" ({name: seconds}: where a move's time went), the valid
    ones; an agent that sends none (or nonsense) costs nothing but the breakdown."""
    phases = reply.get("phases")
    if isinstance(phases, dict):
        kept = {str(k): float(v) for k, v in phases.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9}
        if kept:
            out["phases"] = kept
    return out


def _zeros(reply: dict[str, Any]) -> dict[str, int]:
    """{"zero_bytes": n}: the bytes of the parts the agent found all zero on the GPU (a
    prepare's "zero" block) or memset back (a resume's "zero_bytes"): never copied nor
    written; "bytes" counts what moved. 0 from an agent older than zero parts (issue 20)."""
    block = reply.get("zero")
    n = (block.get("bytes", 0) if isinstance(block, dict) else reply.get("zero_bytes", 0))
    return {"zero_bytes": n if isinstance(n, int) and not isinstance(n, bool)
            and 0 <= n < 1 << 62 else 0}


SUN_PATH_MAX = 107   # sockaddr_un.sun_path holds 108 bytes, NUL included


def _connect(sock: socket.socket, path: Path) -> None:
    """sock connected to the Unix socket at path. A path longer than a socket address holds
    (a container's agent directory <run_dir>/agents/<64-hex id>@<root key> leaves no room
    for agent-<nspid>.sock under /run/torpor) is reached through its directory, held open
    (O_PATH) for the call: /proc/self/fd/<fd>/<name> is short, and names the same socket."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        sock.connect(str(path))
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)


class AgentClient:
    """One connection to one program's agent. expect_pid: the host pid of the program; the
    connection is refused when another live process listens on the socket."""

    def __init__(self, path: Path, owner_uid: int | None = None, timeout: float = 30.0,
                 expect_pid: int | None = None):
        self.path = Path(path)
        try:
            st = os.lstat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            raise NoAgentError(f"no torpor agent socket at {self.path}") from None
        trusted = {0, os.geteuid()} | ({owner_uid} if owner_uid is not None else set())
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in trusted:
            raise AgentError(f"{self.path} is not an agent socket we can trust (owner uid "
                             f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        try:
            _connect(self.sock, self.path)
        except OSError as e:
            self.sock.close()
            if e.errno == errno.ECONNREFUSED:  # a socket file nobody listens on
                raise NoAgentError(f"no agent listens on {self.path} (a stale socket of a "
                                   "program that ended)") from e
            raise AgentError(f"cannot reach the agent at {self.path}: "
                             f"{e.strerror or e}") from e
        if expect_pid is not None:
            peer = _peer_pid(self.sock)
            from .procs import alive
            if peer > 0 and peer != expect_pid and alive(peer):
                self.sock.close()
                raise AgentError(f"{self.path} is the agent socket of PID {peer}, not of "
                                 f"PID {expect_pid} (programs in different pid namespaces "
                                 "share an agent directory)")
        self._buf = b""
        self.release_owed = False   # detach_hold of a deferred prepare: detach_release owed

    @classmethod
    def for_pid(cls, pid: int, agent_dir: Path | None = None, timeout: float = 30.0
                ) -> "AgentClient":
        """The agent of host process pid (NoAgentError when it has none)."""
        from .procs import nspid, owner_uid
        n = nspid(pid)
        if n is None:
            raise NoAgentError(f"no process with PID {pid}")
        return cls(socket_path(n, agent_dir), owner_uid(pid), timeout, expect_pid=pid)

    def close_socket(self) -> None:
        self.sock.close()

    def __enter__(self) -> "AgentClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_socket()

    def call(self, line: str, fds: Sequence[int] = (), timeout: float | None = None
             ) -> dict[str, Any]:
        """One command (with fds passed as SCM_RIGHTS on the same sendmsg); its reply.
        AgentError when the agent answers ok:false, or anything but a JSON object."""
        data = line.encode() + b"\n"
        if timeout is not None:
            self.sock.settimeout(timeout)
        try:
            if fds:
                sent = socket.send_fds(self.sock, [data], list(fds))
                if sent < len(data):
                    self.sock.sendall(data[sent:])
            else:
                self.sock.sendall(data)
            while b"\n" not in self._buf:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise AgentError(f"the agent at {self.path} hung up on '{line}'")
                self._buf += chunk
                if len(self._buf) > REPLY_MAX:
                    raise AgentError(f"the agent at {self.path} sent an oversized reply")
        except socket.timeout as e:
            raise AgentError(f"the agent at {self.path} did not answer '{line}' within "
                             f"{self.sock.gettimeout():.0f} s") from e
        except OSError as e:
            raise AgentError(f"agent at {self.path}: {e}") from e
        raw, _, self._buf = self._buf.partition(b"\n")
        try:
            reply = loads_json(raw)
        except ValueError as e:
            raise AgentError(f"the agent at {self.path} sent a non-JSON reply: {raw[:200]!r}"
                             ) from e
        if not isinstance(reply, dict):
            raise AgentError(f"the agent at {self.path} sent {reply!r}")
        if reply.get("ok") is False:
            error = " ".join(str(reply.get("error") or "failed").split())[:500]
            # damaged: a resume's data files are not what was saved to them (PROTOCOL.md)
            raise AgentError(f"agent '{line.split()[0] if line else line}': {error}",
                             refusal=error, exit_code=ExitCode.CORRUPT
                             if reply.get("damaged") is True else None)
        return reply

    def status(self) -> dict[str, Any]:
        """{"pid", "state": running|prepared|detached, "gate": open|closed, "in_flight",
        "waiting", "allocations", "bytes", "movable_allocations", "movable_bytes",
        "contexts"}, as the agent sent it (see state())."""
        reply = self.call("status")
        if reply.get("state", "running") not in STATES:
            raise AgentError(f"the agent at {self.path} reports an unknown state "
                             f"{reply['state']!r}")
        return reply

    def state(self) -> str:
        """running | prepared | detached (an agent without prepare: running)."""
        return str(self.status().get("state", "running"))

    def close(self, timeout_ms: int = 10_000) -> dict[str, Any]:
        """Close the gate: new driver calls wait, calls in flight finish, contexts sync."""
        return self.call(f"close {int(timeout_ms)}")

    def open(self) -> dict[str, Any]:
        return self.call("open")

    # -- moving GPU memory (PROTOCOL.md) --------------------------------------------------------
    def prepare(self, files: Sequence[int], timeout_ms: int, timeout: float | None = None,
                fingerprints: tuple[int, int] | None = None,
                stream: Sequence[int] = (), host_budget: int | None = None,
                plan: int | None = None, bag: bool = False) -> dict[str, Any]:
        """Movable GPU memory into files (fds of empty regular files, read-write), or with no
        files into the program's own host memory; the gate is closed after. Returns the
        agent's reply: {"bytes" (moved), "zero_bytes" (found zero: stayed), "chunks",
        "allocations", "cache_released", "seconds",
        "files": [size of each], "in_memory"}.
        fingerprints: (known, index) fds (fingerprints.py): every part fingerprinted on the
        GPU, the known ones skipped, the index written; the reply then has "fingerprints":
        {"parts", "skipped", "skipped_bytes", "seconds", "error"}.
        stream: the ring and the socket of a store.stream.Intake (with fingerprints): the data
        goes through them into the image store, the files stay holes; the reply then has
        "streamed": true.
        host_budget: the bytes of host memory the data may take (a suspend's share of what the
        host has): the agent refuses, before copying anything, when the parts it must copy
        (zero and skipped parts left out, known only after its scan on the GPU) need more.
        An agent older than host budgets (preloaded before torpor was upgraded) refuses the
        word: then all it could move (its status's movable_bytes, zero parts included) must
        fit, or this refuses, and the prepare goes again without it.
        plan: the fd of an empty regular file (read-write): the copy is deferred where the
        agent can (PROTOCOL.md, "The deferred copy"): its memory held, the copy's plan written
        there, nothing copied, "deferred": true; a copier (copier.py) must fill the files
        before anything reads them. Where it cannot, it copies as always, and "defer_error"
        says why. An agent older than the deferred copy is asked again without it.
        bag: take more than HOLD_DIRECT held descriptors (in one bag, fdbag.py): only for an
        agent whose status said so (takes_bags); without it the agent holds at most
        HOLD_DIRECT, as much as a torpor before bags could take.
        On failure (AgentError) the agent released nothing and opened its gate again."""
        if not 0 <= len(files) <= MAX_FILES:
            raise ValueError(f"prepare takes 0 to {MAX_FILES} files, not {len(files)}")
        if fingerprints is not None and not files:
            raise ValueError("fingerprints are for a prepare into files")
        if stream and (fingerprints is None or len(stream) != 2):
            raise ValueError("a stream is a ring and a socket, with fingerprints")
        fp = fingerprints is not None
        if host_budget is not None and host_budget < 1:
            raise ValueError("host_budget is a number of bytes above 0")
        if plan is not None and (not files or fp or host_budget is not None):
            raise ValueError("a deferred copy is for a prepare into files, without the store "
                             "or a host budget")
        budget = f" host={int(host_budget)}" if host_budget is not None else ""
        tail = " bag" if bag else ""   # only to an agent that said it takes the word
        words = f"{' fp' if fp else ''}{' stream' if stream else ''}{tail}"
        fds = [*files, *(fingerprints or ()), *stream]
        try:
            if plan is not None:
                try:
                    reply = self.call(f"prepare {int(timeout_ms)} defer{tail}", [*fds, plan],
                                      timeout)
                except AgentError as e:
                    if e.refusal != BEFORE_HOST_BUDGET:   # its parser's words for "defer" too
                        raise
                    log.info("the agent at %s is older than the deferred copy: it copies",
                             self.path)
                    reply = self.call(f"prepare {int(timeout_ms)}", fds, timeout)
            else:
                reply = self.call(f"prepare {int(timeout_ms)}{budget}{words}", fds, timeout)
        except AgentError as e:
            if host_budget is None or e.refusal != BEFORE_HOST_BUDGET:
                raise
            # It did nothing (the fds it got are closed after the command, as with any):
            # checked by all it could move, since it cannot leave its zero parts out
            self._fits_before_host_budget(host_budget)
            reply = self.call(f"prepare {int(timeout_ms)}{words}", fds, timeout)
        if stream and reply.get("streamed") is not True:
            raise AgentError("the agent did not stream the GPU data as asked (an agent older "
                             "than streaming?)")
        sizes = reply.get("files")
        if not isinstance(sizes, list) or len(sizes) != len(files) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes):
            raise AgentError(f"the agent's prepare reply has no valid 'files' for "
                             f"{len(files)} file(s): {sizes!r}")
        out = {"bytes": _int(reply, "bytes", "prepare"), "chunks": _int(reply, "chunks", "prepare"),
               "allocations": _int(reply, "allocations", "prepare"),
               "seconds": _number(reply, "seconds", "prepare"), "files": list(sizes)}
        cache = reply.get("cache_released", 0)
        out["cache_released"] = cache if isinstance(cache, int) and not isinstance(cache, bool) \
            and cache >= 0 else 0
        if not files and reply.get("in_memory") is not True:
            raise AgentError("the agent did not keep the GPU memory in the program as asked "
                             "(an agent older than in-memory prepares?)")
        out["in_memory"] = not files
        held = reply.get("held", 0)   # descriptors detach_hold() can take (0: an older agent)
        out["held"] = held if isinstance(held, int) and not isinstance(held, bool) and \
            0 <= held <= HOLD_MAX and files else 0
        why = str(reply.get("hold_error", "") or "")[:200]   # asked to hold, held nothing
        if why and not out["held"]:
            out["hold_error"] = why
        if plan is not None:
            # deferred: nothing is in the files until the copier has run, and the held memory
            # is the only copy of the data: a reply that says so without any is not believed
            out["deferred"] = reply.get("deferred") is True and out["held"] > 0
            if reply.get("deferred") is True and not out["deferred"]:
                raise AgentError("the agent deferred its copy but holds no memory")
            out["defer_error"] = str(reply.get("defer_error", "") or "")[:200]
        if fp:
            f = reply.get("fingerprints")
            if not isinstance(f, dict):
                raise AgentError("the agent's prepare reply has no 'fingerprints' (an agent "
                                 "older than fingerprints?)")
            out["fingerprints"] = {
                "parts": _int(f, "parts", "prepare"), "skipped": _int(f, "skipped", "prepare"),
                "skipped_bytes": _int(f, "skipped_bytes", "prepare"),
                "seconds": _number(f, "seconds", "prepare"), "error": str(f.get("error", ""))}
        out.update(_zeros(reply))
        alloc = reply.get("host_alloc_seconds")
        if not files and isinstance(alloc, (int, float)) and not isinstance(alloc, bool) \
                and 0 <= alloc < 1e9:
            out["host_alloc_seconds"] = float(alloc)
        return _with_phases(out, reply)

    def _fits_before_host_budget(self, host_budget: int) -> None:
        """An agent older than `prepare ... host=N`: all it could move (status's
        movable_bytes, in every agent that has prepare) within host_budget, or AgentError in
        the words the newer agent refuses with. What it could move only shrinks in the
        prepare (caches released, zero parts a newer agent leaves out)."""
        movable = _int(self.status(), "movable_bytes", "status")
        if movable > host_budget:
            raise AgentError(f"its GPU data needs up to {movable} bytes of host memory (all "
                             "its agent could move: an agent older than host budgets cannot "
                             f"leave zero parts out); {host_budget} bytes are available for it")
        log.info("the agent at %s is older than host budgets: all it could move (%d bytes) "
                 "fits in %d bytes; its prepare without one", self.path, movable, host_budget)

    def detach(self) -> dict[str, Any]:
        """The agent closes the prepare's fds (the CRIU dump comes next)."""
        return self.call("detach")

    def detach_hold(self, timeout: float | None = None) -> list[int]:
        """detach(), and the agent hands over the descriptors of the GPU memory it exported
        in its prepare (the prepare's "held": N; PROTOCOL.md): while the caller holds them the
        memory stays on the GPU through the driver's checkpoint, and resume(held=...) maps it
        back instead of copying the files back. Returns them (the caller closes them, which
        frees the memory); [] when the agent sent none or not as many as it said (those that
        came are closed: the resume then copies from the files, as after detach()).
        After a deferred prepare these are duplicates: the agent keeps its own until
        detach_release() (self.release_owed says so), so that its memory is never held by
        this process alone. Past HOLD_DIRECT they come in one bag (fdbag.py), which the reply
        says ("bag": true) and this unpacks."""
        self.release_owed = False
        if self._buf:
            raise AgentError(f"the agent at {self.path} sent more than it was asked")
        if timeout is not None:
            self.sock.settimeout(timeout)
        fds: list[int] = []
        too_many = False
        try:
            self.sock.sendall(b"detach hold\n")
            while b"\n" not in self._buf:
                data, got, flags, _ = socket.recv_fds(self.sock, 65536, HOLD_DIRECT + 1)
                fds.extend(got)
                for fd in got:   # SCM_RIGHTS gives inheritable ones: no child may keep them
                    os.set_inheritable(fd, False)
                if not data:
                    raise AgentError(f"the agent at {self.path} hung up on 'detach hold'")
                if flags & socket.MSG_CTRUNC:   # more than asked for, or past our fd limit
                    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                    raise AgentError(f"the descriptors of the GPU memory the agent at "
                                     f"{self.path} holds were cut short: more than "
                                     f"{HOLD_DIRECT}, "
                                     f"or past this process's limit on open files ({limit})")
                if len(fds) > HOLD_DIRECT:   # over several messages: an agent in a container
                    too_many = True       # is not trusted with this process's fd table
                    for fd in fds:
                        os.close(fd)
                    fds = []
                self._buf += data
                if len(self._buf) > REPLY_MAX:
                    raise AgentError(f"the agent at {self.path} sent an oversized reply")
            raw, _, self._buf = self._buf.partition(b"\n")
            try:
                reply = loads_json(raw)
            except ValueError as e:
                raise AgentError(f"the agent at {self.path} sent a non-JSON reply: "
                                 f"{raw[:200]!r}") from e
            if not isinstance(reply, dict) or reply.get("ok") is not True:
                error = reply.get("error") if isinstance(reply, dict) else reply
                raise AgentError(f"agent 'detach hold': {error}", refusal=str(error))
            held = reply.get("held", 0)
            if reply.get("bag") is True and len(fds) == 1 and not too_many and \
                    isinstance(held, int) and not isinstance(held, bool) and \
                    HOLD_DIRECT < held <= HOLD_MAX:
                bag, fds = fds[0], []
                try:
                    fds = fdbag.unpack(bag, held)
                except fdbag.BagError as e:
                    log.warning("the agent at %s said it held %d descriptors: %s", self.path,
                                held, e)
                    raise _Unheld from e
                finally:
                    os.close(bag)
            if not isinstance(held, int) or isinstance(held, bool) or held != len(fds) \
                    or held > HOLD_MAX or too_many:   # more than a resume takes
                log.warning("the agent at %s said it held %r descriptors and sent %d (at most "
                            "%d are taken): none kept (its resume copies from the files)",
                            self.path, held, len(fds), HOLD_MAX)
                raise _Unheld
            self.release_owed = reply.get("release") is True
        except _Unheld:
            for fd in fds:
                os.close(fd)
            return []
        except socket.timeout as e:
            for fd in fds:
                os.close(fd)
            raise AgentError(f"the agent at {self.path} did not answer 'detach hold' within "
                             f"{self.sock.gettimeout():.0f} s") from e
        except BaseException as e:
            for fd in fds:
                os.close(fd)
            if isinstance(e, OSError):
                raise AgentError(f"agent at {self.path}: {e}") from e
            raise
        return fds

    def detach_release(self) -> dict[str, Any]:
        """After a deferred prepare's detach_hold(), once the copier holds the memory too: the
        agent closes its own descriptors (none may be in the CRIU dump)."""
        return self.call("detach release")

    def resume(self, files: Sequence[int] | None = None, timeout: float | None = None,
               held: Sequence[int] = (), drained: bool = False) -> dict[str, Any]:
        """The memory back from files (the prepare's files, same order, read-only; None while
        the agent still holds the prepare's fds), checksums verified, gate open.
        held: the descriptors detach_hold() returned, in its order: the agent maps that memory
        back instead of copying (it checks each is the one it sent; any doubt and it copies
        from the files instead). The caller still closes them after.
        drained: after a deferred prepare, the copier filled the files (or, in a recovery,
        ended): only then may the agent read them; without it the held memory is the only way
        back, and a refused import changes nothing.
        Returns {"bytes", "seconds", "held" (mapped back, not copied)}. On failure the memory
        stays out (retry with good files)."""
        fds = list(files or ())
        if len(fds) > MAX_FILES:
            raise ValueError(f"resume takes at most {MAX_FILES} files")
        if len(held) > HOLD_MAX or (held and not fds):
            raise ValueError(f"resume takes at most {HOLD_MAX} held descriptors, after the files")
        line = (f"resume held={len(held)}" if held else "resume") + (" drained" if drained
                                                                       else "")
        with held_fds(held) as sent:
            reply = self.call(line, [*fds, *sent], timeout)
        return _with_phases({"bytes": _int(reply, "bytes", "resume"),
                             "seconds": _number(reply, "seconds", "resume"),
                             "held": reply.get("held") is True,
                             **_zeros(reply)}, reply)

    def resume_stream(self, stream: Sequence[int], timeout: float | None = None
                      ) -> dict[str, Any]:
        """resume(), the memory coming from the image store through a ring and a socket
        (store.stream.feed sends it meanwhile) rather than from files."""
        if len(stream) != 2:
            raise ValueError("a stream is a ring and a socket")
        reply = self.call("resume stream", list(stream), timeout)
        if reply.get("streamed") is not True:
            raise AgentError("the agent did not resume from the stream (an agent older than "
                             "streaming?)")
        return _with_phases({"bytes": _int(reply, "bytes", "resume"),
                             "seconds": _number(reply, "seconds", "resume"),
                             **_zeros(reply)}, reply)

    def abort(self, timeout: float | None = None) -> dict[str, Any]:
        """A prepare that no checkpoint follows: the memory back from the fds the agent kept."""
        reply = self.call("abort", (), timeout)
        return {"bytes": _int(reply, "bytes", "abort"),
                "seconds": _number(reply, "seconds", "abort")}
