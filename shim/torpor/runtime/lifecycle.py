"""create and delete: torpor's hooks into GPU containers' specs, and forgetting them after.

Neither may stop a container from starting or going away: what fails here is logged and the
real runtime runs anyway (a container without hooks is still checkpointed with its GPU state:
the checkpoint flow reads the runtime's state itself). create (and run, create and start in
one) marks each GPU container for the native front (markers.py), delete removes the mark once
the runtime has deleted it.

What torpor keeps per container on the host is named as its marker is, by the pair (runtime
root, id): agent_name, <id>@<root key>. One id may live under two roots at once; each
container then has its own agent socket directory (both main processes are nspid 1: one
directory would hold one agent-1.sock for two programs) and its own record in torpord (the
hook reads the root's key from the annotation create puts into the spec). A container an
earlier torpor created has <run_dir>/agents/<id> bound into it and is registered as <id>:
checkpoint finds its directory through its spec, delete removes both where no other root
still marks that id.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from pathlib import Path

from .. import agent, oci
from ..config import Config
from ..errors import TorporError
from ..files import open_trusted_dir
from . import libc, markers
from .argv import Invocation
from .runc import Runtime

log = logging.getLogger("torpor.runtime")


def hook_path() -> str | None:
    """torpor-hook next to torpor-runtime (same install), else on PATH."""
    here = Path(sys.argv[0]).resolve().parent / "torpor-hook" if sys.argv and sys.argv[0] else None
    if here and here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("torpor-hook")


def hook_env() -> dict[str, str]:
    """The hook sees torpor's settings as this runtime does (a runtime runs hooks with the
    environment in the spec only): TORPOR_* variables and PATH."""
    return {k: v for k, v in os.environ.items() if k.startswith("TORPOR_") or k == "PATH"}


def create(cfg: Config, runtime: Runtime, inv: Invocation) -> int:
    bundle = Path(inv.opt("bundle", "b") or ".").absolute()
    try:
        spec = oci.load(bundle)
        use = oci.detect(spec)
        if use:
            markers.write(cfg, inv)
        elif markers.present(cfg, inv) and _gone(runtime, inv.container_id) \
                and markers.remove(cfg, inv):   # an earlier container's of this id and root
            # (one runc still runs keeps its marker: runc refuses this create of its id)
            log.info("create %s: removed a stale marker", inv.container_id)
        off = (spec.get("annotations") or {}).get(oci.HOOK_ANNOTATION) == "off"
        if use and oci.set_root_key(spec, markers.key(inv)):
            oci.save(bundle, spec)   # torpor-hook registers the container by its name
        if use and not off:
            path = hook_path()
            if path is None:
                log.warning("create %s: GPU container but torpor-hook is not installed",
                            inv.container_id)
            else:
                added = oci.add_hooks(spec, path, hook_env())
                if added:
                    oci.save(bundle, spec)
                    log.info("create %s: GPUs %s; added hooks %s", inv.container_id, use,
                             ",".join(added))
        if use and oci.wants_agent(spec, cfg.agent):
            preload_agent(cfg, bundle, spec, inv.container_id, agent_name(cfg, inv))
    except Exception as e:  # whatever it is, the container must still start
        log.warning("create %s: spec left as it was: %s", inv.container_id, e,
                    exc_info=not isinstance(e, (TorporError, OSError, ValueError)))
    runtime.exec()


def preload_agent(cfg: Config, bundle: Path, spec: dict, cid: str, name: str) -> None:
    """The agent into the container's spec, where its libc can load it (libc.py); else the
    spec gets the annotation org.torpor.agent-skipped with the reason (torpor-hook copies the
    annotations into torpord's record) and the container runs on the driver path."""
    library = agent.library()
    fit = libc.agent_fit(spec, bundle, library)
    if not fit.loads:
        log.warning("create %s: agent not preloaded, the container takes the driver path: %s",
                    cid, fit.reason)
        oci.mark_agent_skipped(spec, fit.reason)
        oci.save(bundle, spec)
        return
    host_dir = agent_dir(cfg, name, spec)
    if oci.add_agent(spec, library, host_dir):
        oci.save(bundle, spec)
        log.info("create %s: agent preloaded (%s), sockets in %s", cid, fit.libc, host_dir)


def agent_dirs(cfg: Config) -> Path:
    """One socket directory per container under here (bound to /run/torpor/agents inside)."""
    return agent.container_dirs(cfg.run_dir)


def agent_name(cfg: Config, inv: Invocation, spec: dict | None = None) -> str:
    """The name of inv's container's agent socket directory (<run_dir>/agents/<name>) and of
    torpord's record of it: markers.name, <id>@<root key>, one per (root, id) as its marker.
    Given the spec of a running container (a checkpoint's): an earlier torpor's container has
    <run_dir>/agents/<id> bound into it, and keeps that name for its life. UsageError for an
    id that cannot name a file."""
    mine = markers.name(inv)
    if spec is not None and not (agent_dirs(cfg) / mine).is_dir():
        legacy = agent_dirs(cfg) / oci.validate_container_id(inv.container_id)
        if oci.agent_host_dir(spec) == str(legacy) and legacy.is_dir():
            return legacy.name
    return mine


def agent_dir(cfg: Config, name: str, spec: dict) -> Path:
    """The container's socket directory (name: agent_name's), 0700 and owned by the host uid
    its process runs as (the agent creates its socket there, and accepts root and that uid).
    One left by an earlier create or restore of this (root, id) (its owner that container's
    uid) is taken as it is: only root makes entries in agent_dirs (0700), and private_dir
    would refuse it as another uid's. Never through a link."""
    path = agent.container_dir(cfg.run_dir, name)
    parent = open_trusted_dir(path.parent, "agent socket directory", create=True)
    try:
        try:
            os.mkdir(path.name, 0o700, dir_fd=parent.fd)
        except FileExistsError:
            pass
        fd = os.open(path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent.fd)
        try:
            os.fchmod(fd, 0o700)
            os.fchown(fd, *oci.host_ids(spec))
        finally:
            os.close(fd)
    finally:
        os.close(parent.fd)
    return path


def says_missing(message: str, container_id: str) -> bool:
    """Does a runtime's error say that it knows no container of this id? Each runtime's own
    words, no more (a rootfs or config file that "does not exist" is another error):
      runc >= 1.1  container does not exist  (libcontainer's ErrNotExist)
      runc 1.0     container "<id>" does not exist
      crun >= 1.22 container `<id>` does not exist: ...
      crun older   error opening file `<state root>/<id>/status`: No such file or directory
    crun 1.22 and later say "open `.../status`" without "does not exist" where the state
    directory is there but not its status: not this. Older crun words both alike: a state
    directory without its status reads as gone, which crun's own delete also removes."""
    cid = re.escape(container_id)
    return bool(re.search(r"\bcontainer does not exist\b", message)
                or re.search(rf'\bcontainer \\?"{cid}\\?" does not exist\b', message)
                or re.search(rf"\bcontainer `{cid}` does not exist\b", message)
                or re.search(rf"\berror opening file `[^`]*/{cid}/status`: "
                             r"No such file or directory", message))


def _gone(runtime: Runtime, container_id: str) -> bool:
    """Does the runtime no longer know the container? A checkpoint without --leave-running
    deletes runc's own state of it, and containerd's shim then deletes it without --force:
    runc fails with "container does not exist", which containerd takes as done (the same
    words it looks for). The question goes without the engine's --log: crun writes its
    error only there where one is given, and the answer is ours, not the engine's to read."""
    try:
        runtime.state(container_id, to_log=False)
    except TorporError as e:
        return says_missing(str(e), container_id)
    return False


def delete(cfg: Config, runtime: Runtime, inv: Invocation) -> int:
    rc = runtime.run().wait()
    if rc != 0 and not _gone(runtime, inv.container_id):
        return rc   # still there: its marker and agent directory stay with it
    markers.remove(cfg, inv)
    try:
        names = [agent_name(cfg, inv)]
    except TorporError:
        return rc   # an id that names no file: torpor made nothing for it
    # what an earlier torpor named by the id alone: this container's, or a stale one's, unless
    # a container of this id under another root (created before the upgrade) may use it
    if markers.other_roots(cfg, inv):
        log.info("delete %s: a container of this id under another runtime root is torpor's: "
                 "the agent directory and torpord's record named by the id alone stay",
                 inv.container_id)
    else:
        names.append(inv.container_id)
    for name in names:
        shutil.rmtree(agent_dirs(cfg) / name, ignore_errors=True)
    if cfg.socket_path.exists():
        try:
            from ..sidecar.client import Client
            with Client(cfg, timeout=5) as c:
                for name in names:
                    if c.unregister_container(name, missing_ok=True):
                        log.info("delete %s: unregistered %s", inv.container_id, name)
        except TorporError as e:
            log.warning("delete %s: could not unregister: %s", inv.container_id, e)
    return rc


def resume(cfg: Config, runtime: Runtime, inv: Invocation) -> int:
    """resume of a GPU container: runc's, except that one already running is resumed. A
    checkpoint of a container the engine paused (ctr pauses the task around it) thaws it for
    the GPU step and pauses it again after (checkpoint.py's _Thaw): a torpor-runtime killed
    in between leaves it running, and the engine's resume that follows the failed checkpoint
    would fail "container not paused", leaving containerd's shim with a task it calls paused
    that runc will neither pause nor resume again (wedged until killed)."""
    rc = runtime.run().wait()
    if rc == 0:
        return 0
    try:
        status = runtime.state(inv.container_id, to_log=False).get("status")
    except TorporError:
        return rc
    if status != "running":
        return rc
    log.warning("resume %s: not paused (a checkpoint interrupted while it had it thawed?); "
                "it runs, as asked", inv.container_id)
    return 0
