"""torpor ps: GPU processes, their checkpoint state, their container and whether they run
under the in-process agent (AGENT: its socket answers; "stale": a socket nobody listens on)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import agent, gpus, oci, procs
from ..config import Config
from ..errors import NoDriverError, TorporError
from ..progress import human_bytes
from .context import Context

NEEDS_RECOVERY = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("ps", help=__doc__.split(":")[1].strip(), description=__doc__)


def containers_by_pid(cfg: Config) -> dict[int, str]:
    """PID -> name of the container torpord registered it under (the container's process
    tree; oci.container_name: <id>@<root key>, or an earlier torpor's <id>); empty when
    torpord is not running (ps works without it)."""
    if not cfg.socket_path.exists():
        return {}
    from ..sidecar.client import Client
    try:
        with Client(cfg, timeout=3) as c:
            registered = c.list().containers
    except TorporError:
        return {}
    out: dict[int, str] = {}
    for ctr in registered:
        for root in ctr.pids:
            for pid in procs.tree(root) if procs.alive(root) else []:
                out[pid] = ctr.id
    return out


def agent_state(pid: int, agent_dir: Path | None) -> str:
    """The agent's state (running, prepared, detached), "stale", "?" (it did not answer), or
    "" when the program has no agent."""
    path = agent.socket_of(pid, agent_dir)
    if path is None:
        return ""
    try:
        with agent.AgentClient(path, procs.owner_uid(pid), timeout=1.0, expect_pid=pid) as a:
            return a.state()
    except agent.NoAgentError:
        return "stale"
    except (TorporError, OSError):
        return "?"


def _container(cfg: Config, name: str) -> tuple[str, Path | None]:
    """A registered name as (container id, its agent directory); ("", None) for none; a name
    torpord should not have let through: as it is, no agent directory."""
    if not name:
        return "", None
    try:
        return oci.split_name(name)[0], agent.container_dir(cfg.run_dir, name)
    except TorporError:
        return name, None


def run(args: argparse.Namespace, ctx: Context) -> int:
    engine = ctx.engine
    try:
        inv = gpus.discover()
    except NoDriverError as e:  # a host without a GPU: nothing to list, and that is no error
        ctx.emit({"driver_version": "", "processes": [], "reason": e.line()},
                 f"(no GPU processes: {e.line()})")
        return 0
    suspended = engine.journal.suspended()
    pids = sorted({p.pid for p in inv.processes} | {p for p in suspended if procs.alive(p)})
    try:
        states = engine.cuda_states(pids)
    except NoDriverError:
        states = {}
    containers = containers_by_pid(ctx.cfg)
    rows = []
    for pid in pids:
        info = suspended.get(pid, {})
        cid, sockets = _container(ctx.cfg, containers.get(pid, ""))
        rows.append({"pid": pid, "comm": procs.comm(pid),
                     "state": states[pid].name if pid in states else "?",
                     "gpus": inv.gpus_of(pid) or info.get("gpus", []),
                     "gpu_memory": inv.memory_of(pid) or 0,
                     "suspended": pid in suspended, "container": cid,
                     "agent": agent_state(pid, sockets)})
    index = {g.uuid: g.index for g in inv.gpus}
    lines = [f"{'PID':>8}  {'STATE':<13} {'GPU':<5} {'MEMORY':>11}  {'AGENT':<9} "
             f"{'CONTAINER':<12}  COMMAND"]
    for r in rows:
        gpu = ",".join(str(index.get(u, "?")) for u in r["gpus"]) or "-"
        lines.append(f"{r['pid']:>8}  {r['state']:<13} {gpu:<5} {human_bytes(r['gpu_memory']):>11}"
                     f"  {r['agent'] or '-':<9} {r['container'][:12] or '-':<12}  {r['comm']}")
    if not rows:
        lines.append("(no GPU processes)")
    ctx.emit({"driver_version": inv.driver_version, "processes": rows}, "\n".join(lines))
    return 0
