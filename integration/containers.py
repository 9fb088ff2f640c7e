"""Drive real podman and containerd to run, checkpoint and restore CPU-only test containers.

Stdlib only; every engine call is an explicit argv run by ``subprocess.run`` with a timeout,
and raises :class:`ContainerError` (argv, exit status, the tool's stdout and stderr) on
failure unless ``check=False``. Needs root, CRIU >= 4 and, per engine, podman / containerd +
ctr with a runc-compatible OCI runtime (``./install.sh`` installs them on Debian/Ubuntu).

The OCI runtime binary is pluggable: ``Podman(runtime="runc")`` or
``Podman(runtime="/usr/local/bin/torpor-runtime")``; ``Containerd(runtime_binary=...)``
likewise (containerd's runc v2 shim runs that binary instead of runc; the choice is stored
with each container and its checkpoints, so a restore uses it too). The runtime must accept
runc's argv, including the probes podman makes (``<runtime> checkpoint --help``).

API::

    Podman(runtime="runc", *, extra_global_args=(), timeout=60.0)
        .ensure_image() -> str                      # localhost/torpor-test:1, built once
        .has_image(ref) / .rm_image(ref)            # the tests' podman_image fixture removes it
        .run(name, cmd, *, devices=(), env=None, mounts=(), annotations=None) -> str  # id
        .pid(name) -> int                           # host PID of the container's init
        .bundle(name) -> Path                       # OCI bundle dir (holds config.json)
        .state(name) -> str                         # running / exited / created / ...
        .exec(name, cmd) -> str                     # stdout
        .checkpoint(name, export=None, *, leave_running=False, compress=None, check=True)
        .restore(name=None, import_=None, *, new_name=None, check=True)
        .rm(name)                                   # force, at once, missing is fine

    Containerd(runtime_binary="runc", *, namespace="torpor-test", root=..., state=...,
               timeout=60.0)                        # starts a private containerd if needed
        .ensure_image() -> str
        .run(name, cmd, *, env=None, mounts=(), devices=(), annotations=None) -> str
        .pid(name) -> int
        .bundle(name) -> Path
        .state(name) -> str                         # running / paused / stopped / created / absent
        .checkpoint(name, ref, *, leave_running=True, check=True)
        .restore(ref, new_name, *, check=True)
        .rm(name)
        .rm_image(ref)
        .stop()                                     # stops the daemon if this object started it

    Counter(host_dir)                               # the test workload, see below
        .mount / .cmd / .read() -> (token, n) | None / .wait_beyond(n, token=None)

``mounts`` are ``(host_src, container_dst, readonly)`` tuples, bound NON-recursively (a
recursive bind drags in submounts CRIU cannot dump). ``devices`` are podman ``--device``
specs (``/dev/null:/dev/nvidia0``) or, for ctr, host device paths (same path inside).

Why the flags (cgroup v1 hybrid hosts, kernel 6.x, podman 4.3, containerd 1.6, runc 1.1):

* podman: ``--cgroup-manager=cgroupfs`` (no systemd as PID 1); ``--network none`` (no
  CNI/netavark setup; still a netns of its own, which CRIU locks: see iptables below);
  ``--ulimit nofile=1024:1024 --ulimit nproc=1024:1024`` (podman otherwise sets
  RLIMIT_NOFILE to 1048576, above the hard limit here: "error setting rlimit type 7:
  operation not permitted");
  ``--mount type=bind,...,bind-nonrecursive`` (``-v`` makes an ``rbind``).
  ``restore --import`` creates a new container: the exported one must be removed first or
  a ``new_name`` given (``--name``), else "that ID is already in use".
  ``rm`` uses ``-t 0``: the workload is PID 1 and ignores SIGTERM (10 s wait otherwise).
* ctr: ``run -d --null-io`` (stdio to /dev/null; with FIFOs, nobody reads them once ctr
  exits and a chatty workload blocks),
  ``--runc-binary`` (per-container runtime binary for io.containerd.runc.v2),
  ``--mount type=bind,...,options=bind:ro`` (non-recursive). ``ctr c checkpoint --task
  --rw`` pauses the task, dumps it with CRIU's leave-running and resumes it: ctr 1.6 has no
  "exit after checkpoint" option, so ``leave_running=False`` kills and removes the container
  right after the checkpoint (the workload may run a few ms past the checkpoint; a restore
  replays from the checkpoint). ``ctr c restore --live --rw`` needs the name to be free;
  containerd unpacks each restore's images into TMPDIR and leaves them: the private daemon
  gets its own TMPDIR and :meth:`Containerd.restore` removes them.
* All engines get a PATH with CRIU's directory first (``/usr/local/sbin``, where
  ./install.sh puts CRIU 4): runc runs ``criu`` from PATH, and Debian's runc recommends
  Debian's older criu in /usr/sbin.
* CRIU locks the container's netns with ``iptables-restore`` (runc 1.1 sets no lock
  method); without it every dump fails. ``network-lock nftables`` in /etc/criu/runc.conf
  crashes CRIU 4.1.1 (see README.md), so ./install.sh installs iptables.

The workload (:class:`Counter`): ``python3 -I -S -c`` from the host's /usr (bind-mounted
read-only into an image that is only empty dirs and usr-merge symlinks) that, every 50 ms,
increments a counter and atomically writes ``"<token> <n>"`` to ``<dir>/counter`` in a
bind-mounted host directory; ``token`` is random per process start, so a restart shows up as
a new token (and n from 1), a continuation as the same token and a larger n. It opens no
other file than ``counter.tmp`` (renamed to ``counter``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

__all__ = ["ContainerError", "Podman", "Containerd", "Counter", "IMAGE", "criu_path"]

IMAGE = "localhost/torpor-test:1"
CHECKPOINT_REPO = "localhost/torpor-checkpoint"
SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Mount = tuple[str | os.PathLike, str, bool]


class ContainerError(RuntimeError):
    """An engine command failed (or timed out); carries argv, returncode, stdout, stderr."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stdout: str, stderr: str,
                 note: str = ""):
        self.argv, self.returncode, self.stdout, self.stderr = list(argv), returncode, stdout, stderr
        what = note or f"exited {returncode}"
        super().__init__(f"{' '.join(self.argv)}: {what}\n{(stderr or stdout).strip()}")


def criu_path() -> str | None:
    """The CRIU that runc will find on the PATH we give engines (None: no CRIU)."""
    return shutil.which("criu", path=_engine_env()["PATH"])


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    parts = [p for p in env.get("PATH", SYS_PATH).split(":") if p]
    for p in reversed(SYS_PATH.split(":")):  # system dirs, /usr/local/sbin first, in front
        if p in parts:
            parts.remove(p)
        parts.insert(0, p)
    env["PATH"] = ":".join(parts)
    return env


def _run(argv: Sequence[str], *, timeout: float, check: bool = True,
         input: str | None = None) -> subprocess.CompletedProcess:
    argv = [str(a) for a in argv]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              input=input, stdin=None if input is not None else subprocess.DEVNULL,
                              env=_engine_env())
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise ContainerError(argv, None, out, err, f"timed out after {timeout:g} s") from None
    if check and proc.returncode != 0:
        raise ContainerError(argv, proc.returncode, proc.stdout, proc.stderr)
    return proc


# --- the test image: empty dirs + usr-merge symlinks; /usr comes from the host ------------

_DIRS = ("usr", "proc", "sys", "dev", "tmp", "etc", "run", "root", "var", "data", "mnt")
_LINKS = ("bin", "lib", "lib64", "sbin")


def rootfs_tar() -> bytes:
    """A tiny, reproducible rootfs tar: empty dirs and bin/lib/lib64/sbin -> usr/*."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for d in _DIRS:
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, (0o1777 if d == "tmp" else 0o755)
            t.addfile(ti)
        for name in _LINKS:
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, f"usr/{name}", 0o777
            t.addfile(ti)
    return buf.getvalue()


def _oci_arch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le",
            "s390x": "s390x", "riscv64": "riscv64"}.get(m, m)


def oci_archive(image: str = IMAGE) -> bytes:
    """An OCI image-layout tar of :func:`rootfs_tar` named ``image`` (for ``ctr i import``)."""
    layer = rootfs_tar()
    config = json.dumps({
        "architecture": _oci_arch(), "os": "linux",
        "config": {"Env": [f"PATH={SYS_PATH}"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))

        def blob(data: bytes, media_type: str) -> dict:
            digest = hashlib.sha256(data).hexdigest()
            add(f"blobs/sha256/{digest}", data)
            return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": blob(config, "application/vnd.oci.image.config.v1+json"),
            "layers": [blob(layer, "application/vnd.oci.image.layer.v1.tar")],
        }).encode()
        desc = blob(manifest, "application/vnd.oci.image.manifest.v1+json")
        desc["annotations"] = {"io.containerd.image.name": image,
                               "org.opencontainers.image.ref.name": image.rsplit(":", 1)[-1]}
        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", json.dumps({"schemaVersion": 2, "manifests": [desc]}).encode())
    return buf.getvalue()


def _run_flags(devices: Iterable[str], env: Mapping[str, str] | None,
               annotations: Mapping[str, str] | None) -> list[str]:
    """--device / --env / --annotation, spelled alike by podman run and ctr run."""
    args: list[str] = []
    for d in devices:
        args += ["--device", d]
    for k, v in (env or {}).items():
        args += ["--env", f"{k}={v}"]
    for k, v in (annotations or {}).items():
        args += ["--annotation", f"{k}={v}"]
    return args


# --- podman ----------------------------------------------------------------------------------

class Podman:
    """podman (as root, cgroupfs) with a chosen OCI runtime; see the module docstring."""

    RUN_ARGS = ("--network", "none", "--ulimit", "nofile=1024:1024",
                "--ulimit", "nproc=1024:1024")

    def __init__(self, runtime: str = "runc", *, extra_global_args: Iterable[str] = (),
                 timeout: float = 60.0, podman: str = "podman"):
        self.runtime = runtime
        self.timeout = timeout
        self.base = [podman, "--runtime", runtime, "--cgroup-manager=cgroupfs",
                     *extra_global_args]

    def _p(self, *args: str | os.PathLike, check: bool = True,
           timeout: float | None = None) -> subprocess.CompletedProcess:
        return _run([*self.base, *map(str, args)], timeout=timeout or self.timeout, check=check)

    def has_image(self, ref: str = IMAGE) -> bool:
        return self._p("image", "exists", ref, check=False).returncode == 0

    def rm_image(self, ref: str = IMAGE) -> None:
        self._p("rmi", "--force", ref, check=False)

    def ensure_image(self) -> str:
        """Import :data:`IMAGE` from :func:`rootfs_tar` unless present; returns its name."""
        if not self.has_image():
            with tempfile.NamedTemporaryFile(suffix=".tar") as f:
                f.write(rootfs_tar())
                f.flush()
                self._p("import", "--change", f"ENV PATH={SYS_PATH}", f.name, IMAGE)
        return IMAGE

    def run(self, name: str, cmd: Sequence[str], *, devices: Iterable[str] = (),
            env: Mapping[str, str] | None = None, mounts: Iterable[Mount] = (),
            annotations: Mapping[str, str] | None = None) -> str:
        """Start ``cmd`` detached in a new container from :data:`IMAGE`, host /usr read-only.

        Returns the container id."""
        args: list[str] = ["run", "-d", "--name", name, *self.RUN_ARGS]
        for src, dst, ro in [("/usr", "/usr", True), *mounts]:
            args += ["--mount", f"type=bind,src={src},dst={dst},{'ro=true,' if ro else ''}"
                                "bind-nonrecursive"]
        args += _run_flags(devices, env, annotations)
        return self._p(*args, self.ensure_image(), *cmd).stdout.strip()

    def inspect(self, name: str, fmt: str) -> str:
        return self._p("container", "inspect", "--format", fmt, name).stdout.strip()

    def pid(self, name: str) -> int:
        return int(self.inspect(name, "{{.State.Pid}}"))

    def bundle(self, name: str) -> Path:
        return Path(self.inspect(name, "{{.OCIConfigPath}}")).parent

    def state(self, name: str) -> str:
        return self.inspect(name, "{{.State.Status}}")

    def exec(self, name: str, cmd: Sequence[str]) -> str:
        return self._p("exec", name, *cmd).stdout

    def checkpoint(self, name: str, export: Path | None = None, *, leave_running: bool = False,
                   compress: str | None = None, check: bool = True,
                   timeout: float | None = None) -> subprocess.CompletedProcess:
        """``podman container checkpoint``; ``export``: write a self-contained tar there
        (``compress``: none / gzip / zstd); ``leave_running``: keep the container running."""
        args = ["container", "checkpoint"]
        if leave_running:
            args.append("--leave-running")
        if export is not None:
            args += ["--export", str(export)]
        if compress is not None:
            args += ["--compress", compress]
        return self._p(*args, name, check=check, timeout=timeout)

    def restore(self, name: str | None = None, import_: Path | None = None, *,
                new_name: str | None = None, check: bool = True,
                timeout: float | None = None) -> subprocess.CompletedProcess:
        """``podman container restore``: of ``name``'s local checkpoint, or of the tar
        ``import_`` (a new container: the original must be gone, or give ``new_name``)."""
        args = ["container", "restore"]
        if import_ is not None:
            args += ["--import", str(import_)]
        if new_name is not None:
            args += ["--name", new_name]
        if name is not None:
            args.append(name)
        return self._p(*args, check=check, timeout=timeout)

    def rm(self, name: str) -> None:
        self._p("rm", "--force", "--ignore", "--time", "0", name)


# --- containerd ------------------------------------------------------------------------------

class Containerd:
    """A containerd driven through ``ctr``; see the module docstring.

    Uses the daemon at ``<state>/containerd.sock`` if one answers there, else starts a private
    one (root, state, socket, log under ``root``/``state``; CRI plugin off) that :meth:`stop`
    stops again. Containers live in ``namespace``; images stay between runs (under ``root``).
    """

    RUNTIME = "io.containerd.runc.v2"

    def __init__(self, runtime_binary: str = "runc", *, namespace: str = "torpor-test",
                 root: str | os.PathLike = "/var/lib/torpor-test/containerd",
                 state: str | os.PathLike = "/run/torpor-test/containerd",
                 timeout: float = 60.0, ctr: str = "ctr", containerd: str = "containerd"):
        self.runtime_binary = runtime_binary
        self.namespace = namespace
        self.root, self.state_dir = Path(root), Path(state)
        self.address = self.state_dir / "containerd.sock"
        self.tmp_dir = self.state_dir / "tmp"
        self.timeout = timeout
        self.ctr = ctr
        self.daemon: subprocess.Popen | None = None
        if not self._alive():
            self._start(containerd)

    def _c(self, *args: str | os.PathLike, check: bool = True,
           timeout: float | None = None) -> subprocess.CompletedProcess:
        return _run([self.ctr, "--address", str(self.address), "--namespace", self.namespace,
                     *map(str, args)], timeout=timeout or self.timeout, check=check)

    def _alive(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            try:
                s.connect(str(self.address))
            except OSError:  # no socket, or a stale one (ctr would wait 10 s on it)
                return False
        return self._c("version", check=False, timeout=10).returncode == 0

    def _start(self, containerd: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "config.toml"
        config.write_text(
            "version = 2\n"
            f'root = "{self.root}"\n'
            f'state = "{self.state_dir}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            "[grpc]\n"
            f'  address = "{self.address}"\n'
            "[ttrpc]\n"
            f'  address = "{self.address}.ttrpc"\n')
        # containerd unpacks a checkpoint to restore into a fresh TMPDIR/ctrd-checkpoint*
        # (XDG_RUNTIME_DIR if set) and never removes it: keep those here (restore() cleans).
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(mode=0o700)
        env = _engine_env()
        env.pop("XDG_RUNTIME_DIR", None)
        env["TMPDIR"] = str(self.tmp_dir)
        with open(self.state_dir / "containerd.log", "ab") as log:
            self.daemon = subprocess.Popen([containerd, "--config", str(config)],
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                           env=env, start_new_session=True)
        daemon, deadline = self.daemon, time.monotonic() + 30
        while not self._alive():
            if daemon.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.state_dir / "containerd.log").read_text(errors="replace")[-2000:]
                raise ContainerError(daemon.args, daemon.returncode, "", tail,
                                     "did not come up")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the daemon if this object started it (containers' shims live on)."""
        d, self.daemon = self.daemon, None
        if d is None or d.poll() is not None:
            return
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(timeout=15)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait(timeout=15)

    def __enter__(self) -> "Containerd":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def images(self) -> list[str]:
        return self._c("images", "ls", "--quiet").stdout.split()

    def ensure_image(self) -> str:
        """Import :data:`IMAGE` (an OCI archive of :func:`rootfs_tar`) unless present."""
        if IMAGE not in self.images():
            with tempfile.NamedTemporaryFile(suffix=".tar") as f:
                f.write(oci_archive(IMAGE))
                f.flush()
                self._c("images", "import", f.name)
        return IMAGE

    def run(self, name: str, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
            mounts: Iterable[Mount] = (), devices: Iterable[str] = (),
            annotations: Mapping[str, str] | None = None) -> str:
        """Start ``cmd`` detached (stdio /dev/null) in container ``name`` from :data:`IMAGE`,
        host /usr read-only, run by ``runtime_binary``. Returns the container id (= name)."""
        image = self.ensure_image()
        args: list[str] = ["run", "--detach", "--null-io", "--runtime", self.RUNTIME,
                           "--runc-binary", self.runtime_binary]
        for src, dst, ro in [("/usr", "/usr", True), *mounts]:
            args += ["--mount", f"type=bind,src={src},dst={dst},options=bind:{'ro' if ro else 'rw'}"]
        args += _run_flags(devices, env, annotations)
        self._c(*args, image, name, *cmd)
        return name

    def _task(self, name: str) -> tuple[int, str] | None:
        for line in self._c("tasks", "ls").stdout.splitlines()[1:]:
            f = line.split()
            if len(f) >= 3 and f[0] == name:
                return int(f[1]), f[2].lower()
        return None

    def pid(self, name: str) -> int:
        t = self._task(name)
        if t is None:
            raise ContainerError(["ctr", "tasks", "ls"], 0, "", f"no task {name!r}")
        return t[0]

    def bundle(self, name: str) -> Path:
        return self.state_dir / "io.containerd.runtime.v2.task" / self.namespace / name

    def state(self, name: str) -> str:
        """running / paused / stopped / ... (the task's), created (no task), absent."""
        t = self._task(name)
        if t is not None:
            return t[1]
        if name in self._c("containers", "ls", "--quiet").stdout.split():
            return "created"
        return "absent"

    def checkpoint(self, name: str, ref: str, *, leave_running: bool = True,
                   check: bool = True, timeout: float | None = None
                   ) -> subprocess.CompletedProcess:
        """``ctr c checkpoint --task --rw`` into the image ``ref`` (pause, dump, resume).
        ``leave_running=False``: then kill and remove the container (see module docstring)."""
        proc = self._c("containers", "checkpoint", "--task", "--rw", name, ref,
                       check=check, timeout=timeout)
        if proc.returncode == 0 and not leave_running:
            self.rm(name)
        return proc

    def restore(self, ref: str, new_name: str, *, check: bool = True,
                timeout: float | None = None) -> subprocess.CompletedProcess:
        """``ctr c restore --live --rw``: container ``new_name`` (must be free) from ``ref``."""
        before = set(self.tmp_dir.glob("ctrd-checkpoint*"))
        try:
            return self._c("containers", "restore", "--live", "--rw", new_name, ref,
                           check=check, timeout=timeout)
        finally:  # the images containerd unpacked for this restore (it leaves them)
            for d in set(self.tmp_dir.glob("ctrd-checkpoint*")) - before:
                shutil.rmtree(d, ignore_errors=True)

    def rm(self, name: str) -> None:
        """Kill and delete the task and the container (with its snapshot); missing is fine."""
        if self._task(name) is not None:
            self._c("tasks", "rm", "--force", name, check=False)
            deadline = time.monotonic() + 10
            while self._task(name) is not None:
                if time.monotonic() > deadline:
                    self._c("tasks", "rm", "--force", name)  # raises with ctr's reason
                time.sleep(0.05)
        if name in self._c("containers", "ls", "--quiet").stdout.split():
            self._c("containers", "rm", name)

    def rm_image(self, ref: str) -> None:
        self._c("images", "rm", "--sync", ref, check=False)


# --- the workload ----------------------------------------------------------------------------

COUNTER_SCRIPT = """\
import os, time
d = os.environ.get("COUNTER_DIR", "/data")
tok = os.urandom(8).hex()
n = 0
while True:
    n += 1
    with open(d + "/counter.tmp", "w") as f:
        f.write("%s %d\\n" % (tok, n))
    os.replace(d + "/counter.tmp", d + "/counter")
    time.sleep(0.05)
"""


class Counter:
    """The counter workload, writing to ``host_dir`` (mounted at ``container_dir``).

    ``engine.run(name, c.cmd, mounts=[c.mount])``; ``c.read()`` -> ``(token, n)``."""

    def __init__(self, host_dir: str | os.PathLike, container_dir: str = "/data"):
        self.host_dir = Path(host_dir)
        self.host_dir.mkdir(parents=True, exist_ok=True)
        self.container_dir = container_dir
        self.mount: Mount = (str(self.host_dir), container_dir, False)
        self.cmd = ["/usr/bin/python3", "-I", "-S", "-c",
                    COUNTER_SCRIPT.replace('"/data"', repr(container_dir))]

    def read(self) -> tuple[str, int] | None:
        try:
            tok, n = (self.host_dir / "counter").read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        return tok, int(n)

    def wait_beyond(self, n: int = 0, *, token: str | None = None,
                    timeout: float = 10.0) -> tuple[str, int]:
        """Wait until the counter exceeds ``n`` (with ``token``, if given); returns it."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.read()
            if last and last[1] > n and (token is None or last[0] == token):
                return last
            time.sleep(0.02)
        raise TimeoutError(f"counter in {self.host_dir} not beyond {n}"
                           f"{f' with token {token}' if token else ''}: last {last}")
