"""Checks of everything torpor needs, each with a fix: used by `torpor doctor` and torpord."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

from . import criu, gpus
from .config import Config
from .driver import Driver
from .errors import TorporError

OK, FAIL, WARN = "ok", "fail", "warn"
SYSTEMD = Path("/run/systemd/system")   # present only while systemd runs (sd_booted(3))


def torpord_hint(verb: str = "start") -> str:
    """How to (re)start torpord here: systemctl only where systemd runs."""
    if SYSTEMD.is_dir():
        return f"systemctl {verb} torpord (or run torpord)"
    return "run torpord as root (systemd is not running here)"


@dataclasses.dataclass
class Check:
    name: str
    status: str          # ok | fail | warn (warn: optional, e.g. no GPU on a CPU-only host)
    detail: str
    fix: str = ""


def _guard(name: str, fn: Callable[[], Check], fix: str, missing: str = FAIL) -> Check:
    try:
        return fn()
    except TorporError as e:
        return Check(name, missing, e.line(), fix)
    except Exception as e:  # a check must never crash the doctor
        return Check(name, missing, f"{type(e).__name__}: {e}", fix)


def run_checks(cfg: Config, sidecar: Callable[[], Check] | None = None) -> list[Check]:
    checks: list[Check] = []

    def criu_version() -> Check:
        c = criu.find(cfg)
        return Check("criu", OK, f"CRIU {c.version_text} at {c.path}")
    checks.append(_guard("criu", criu_version, "run ./install.sh (builds CRIU >= 4)"))

    def criu_check() -> Check:
        ok, said = criu.check(criu.find(cfg))
        return Check("criu check", OK if ok else FAIL, said or "(no output)",
                     "" if ok else "run 'criu check --all' for details; CRIU needs root and "
                     "a kernel with CONFIG_CHECKPOINT_RESTORE")
    checks.append(_guard("criu check", criu_check, "install CRIU >= 4 first"))

    def pycriu() -> Check:
        import pycriu  # noqa: F401
        from pycriu import images  # noqa: F401
        return Check("pycriu", OK, f"importable from {Path(pycriu.__file__).parent}")
    checks.append(_guard("pycriu", pycriu, "run ./install.sh (installs CRIU's pycriu)"))

    def kernel() -> Check:
        release = os.uname().release
        if not Path("/proc/sys/kernel/ns_last_pid").exists():
            return Check("kernel", FAIL, f"{release} lacks CONFIG_CHECKPOINT_RESTORE",
                         "use a kernel built with CONFIG_CHECKPOINT_RESTORE")
        if os.geteuid() != 0:
            return Check("kernel", FAIL, f"{release}; torpor runs as uid {os.geteuid()}",
                         "run as root (CRIU and the driver checkpoint API need it)")
        return Check("kernel", OK, f"{release}, checkpoint/restore support, running as root")
    checks.append(_guard("kernel", kernel, ""))

    def state_dir() -> Check:
        from .files import private_dir
        d = private_dir(cfg.state_dir)
        mode = d.stat().st_mode & 0o777
        return Check("state dir", OK if mode == 0o700 else WARN, f"{d} (mode {mode:o})",
                     "" if mode == 0o700 else f"chmod 700 {d}")
    checks.append(_guard("state dir", state_dir, f"make {cfg.state_dir} writable by root"))

    def driver() -> Check:
        d = Driver.load(cfg.libcuda)
        v = d.cuda_version
        return Check("driver", OK, f"{d.path}: CUDA {v // 1000}.{v % 1000 // 10} driver API "
                     "with the checkpoint API")
    checks.append(_guard("driver", driver, "install the NVIDIA driver >= 570 (GPU work only)",
                         missing=WARN))

    def nvml() -> Check:
        inv = gpus.discover()
        names = "; ".join(f"{g.index}: {g.name} {g.uuid}" for g in inv.gpus) or "none"
        return Check("gpus", OK if inv.gpus else WARN, f"driver {inv.driver_version}, {names}")
    checks.append(_guard("gpus", nvml, "GPU checkpoints need an NVIDIA GPU and NVML",
                         missing=WARN))

    def agent_check() -> Check:
        from . import agent, elf_versions
        lib = agent.library()
        needs = elf_versions.read(lib).needed.get("libc.so.6", frozenset())
        newest = elf_versions.newest_glibc(needs).removeprefix("GLIBC_") or "?"
        where = ("preloaded into GPU containers whose libc can load it (annotation "
                 "org.torpor.agent=off opts one out)") if cfg.agent else \
            "not preloaded into GPU containers (config agent = false; org.torpor.agent=on " \
            "opts one in)"
        return Check("agent", OK, f"{lib.name} (glibc >= {newest}): {where}; bare programs "
                     "take the driver's slower path unless started as `torpor run -- CMD`")
    checks.append(_guard("agent", agent_check, "reinstall torpor (its build compiles agent/ "
                         "with make and gcc)", missing=WARN))

    if sidecar is not None:
        checks.append(_guard("torpord", sidecar, torpord_hint(),
                             missing=WARN))
    return checks
