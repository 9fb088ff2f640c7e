"""What torpor knows of programs that one of its paths cannot bring back.

JAX (XLA) on the driver path: measured on the H200 (driver 580.159, JAX 0.11.2,
bench/results/jax_driver_path-h200-2026-12-04.json), the driver checkpoints a JAX program and
CRIU dumps and restores it, but cuCheckpointProcessRestore then fails with
CUDA_ERROR_NOT_INITIALIZED, whatever XLA is told: its platform allocator instead of the BFC
arena, CUDA graphs (command buffers) off, or no preallocation (then the driver's checkpoint
itself fails, CUDA_ERROR_OPERATING_SYSTEM). The same program under the in-process agent
(`torpor run`) restores bit-exact: the agent moves and releases its GPU memory before the
driver's checkpoint. So a checkpoint that would end a JAX program on the driver path would
leave, as the only copy of it, images nothing can restore: it is refused before anything is
touched. A --leave-running one keeps the program running and is let through with a warning.
"""

from __future__ import annotations

from typing import Iterable

from .errors import PreflightError

# Shared objects only an XLA runtime maps (jaxlib's extension and its CUDA PJRT plugin).
XLA_LIBRARIES = (b"xla_extension", b"xla_cuda_plugin", b"/jaxlib/", b"jax_cuda", b"pjrt_c_api")


def runs_xla(pid: int) -> bool:
    """Whether pid has an XLA runtime (JAX) mapped."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            maps = f.read()
    except OSError:
        return False
    return any(name in maps for name in XLA_LIBRARIES)


def xla_without_agent(pids: Iterable[int], agents: Iterable[int]) -> list[int]:
    """The pids that run XLA and have no agent."""
    under_agent = set(agents)
    return [p for p in pids if p not in under_agent and runs_xla(p)]


def driver_path_note(pids: Iterable[int], agents: Iterable[int], container: bool) -> str:
    """One progress line for the CUDA pids a checkpoint or suspend takes on the driver's path
    (no agent), saying how to get the agent's faster one; "" when every pid has an agent."""
    under_agent = set(agents)
    bare = [p for p in pids if p not in under_agent]
    if not bare:
        return ""
    who = f"PID{'s' if len(bare) > 1 else ''} {', '.join(map(str, bare))}"
    how = ("the container runs without the agent (org.torpor.agent=off, or its libc cannot "
           "load it: see the annotation org.torpor.agent-skipped)") if container else \
        "start it with `torpor run -- CMD` for the agent's fast path"
    return f"driver path for {who} (slower, no JAX): {how}"


def refuse_unrestorable(pids: Iterable[int], agents: Iterable[int], *, leave_running: bool,
                        warn) -> None:
    """Refuse (PreflightError, exit 7) a driver-path checkpoint that would end a JAX program;
    warn(text) for one left running."""
    xla = xla_without_agent(pids, agents)
    if not xla:
        return
    what = (f"PID {xla[0]} runs JAX (XLA) without torpor's agent: the driver cannot restore "
            "such a program after CRIU (CUDA_ERROR_NOT_INITIALIZED)")
    how = "start it under the agent ('torpor run -- COMMAND', or org.torpor.agent=on for a " \
          "container): then it checkpoints and restores"
    if leave_running:
        warn(f"warning: {what}; this checkpoint, left running, will not restore: {how}")
        return
    raise PreflightError(f"{what}; checkpoint refused, the program was not touched", hint=how)
