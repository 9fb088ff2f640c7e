"""The policies every door shares: opening the image store, the fingerprint/stream plan of a
checkpoint, and "restore, then roll back once more".

- open_store: the store at cfg.store_dir, opened once per flow and only where the flow needs
  it (a store to pack into, to stream from, or fingerprints to read); any failure is one
  StoreError line naming the directory.
- fingerprint_plan: which GPU data the agents of a checkpoint skip (owner's snapshots in the
  store have it), whether they only fingerprint it (index), and whether they stream it straight
  into the store: SKIP for a checkpoint that ends the program, INDEX for one left running (it
  needs its data back at once: nothing skipped), NONE without a store.
- restore_or_roll_back: restore and unlock, and when that fails one more try from wherever it
  got (engine.rollback); only when the retry fails too is it an error, with one text for every
  door, and the journal entry kept for recovery.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

from ..config import Config
from ..engine import AgentTarget, Engine
from ..errors import ExitCode, TorporError
from ..journal import Operation
from ..store import Store, fingerprints

log = logging.getLogger("torpor.flows")


class StoreError(TorporError):
    """The image store cannot be opened."""


def open_store(cfg: Config, meaning: str = "") -> Store:
    """The image store at cfg.store_dir; StoreError (one line) when it cannot be opened, which
    ends with "; <meaning>" (what that means to the caller) when one is given."""
    try:
        return Store(cfg.store_dir)
    except (OSError, TorporError) as e:
        why = e.strerror or e if isinstance(e, OSError) else e.line()
        raise StoreError(f"cannot open the image store {cfg.store_dir}: {why}"
                         + (f"; {meaning}" if meaning else "")) from e


# -- the fingerprint/stream plan ----------------------------------------------------------------

class FingerprintMode(enum.Enum):
    """What a checkpoint's agents do with fingerprints (LockAndCheckpointRequest.fingerprints,
    torpor-runtime's "", "index", "skip")."""
    NONE = ""        # no fingerprints
    INDEX = "index"  # fingerprinted only: the pack reads less, nothing is skipped
    SKIP = "skip"    # fingerprinted, and what owner's snapshots hold is skipped

    @classmethod
    def of(cls, has_store: bool, leave_running: bool) -> "FingerprintMode":
        """The mode of a checkpoint going into a store (or not): a program left running needs
        its data back at once, and a skipped part would be filled from the store first,
        slower than the copy."""
        if not has_store:
            return cls.NONE
        return cls.INDEX if leave_running else cls.SKIP


@dataclasses.dataclass(frozen=True)
class FingerprintPlan:
    """skip: the fingerprints the agents skip (None: no fingerprints at all; empty: index
    only); stream_into: the store the agents stream their GPU data into (store/stream.py),
    or None (their data files are written)."""
    skip: Collection[str] | None = None
    stream_into: Store | None = None

    @property
    def mode(self) -> FingerprintMode:
        if self.skip is None:
            return FingerprintMode.NONE
        return FingerprintMode.SKIP if self.skip or self.stream_into else FingerprintMode.INDEX


NO_FINGERPRINTS = FingerprintPlan()


def fingerprint_plan(cfg: Config, store: Store | None, owner: str, mode: FingerprintMode,
                     known: fingerprints.Known | None = None) -> FingerprintPlan:
    """The plan for a checkpoint of owner's programs into store (None: no store). known:
    owner's fingerprints there when the caller read them already (under the store's lock, to
    pack with them too); else they are read here. A checkpoint that ends its program (SKIP)
    streams its agents' GPU data straight into the store when cfg.store_stream; one left
    running keeps the shorter pause of data files in the page cache, packed while it runs."""
    if mode is FingerprintMode.NONE or store is None or not owner \
            or not fingerprints.usable(store):
        return NO_FINGERPRINTS
    if mode is FingerprintMode.INDEX:
        return FingerprintPlan(skip=frozenset())
    if known is None:
        known = fingerprints.known(store, owner)
    return FingerprintPlan(skip=known.gpu, stream_into=store if cfg.store_stream else None)


# -- restore, then roll back once more ---------------------------------------------------------

RETRY_HINT = "the journal keeps it: the next torpor, or a torpord restart, retries it"
DAMAGED_HINT = ("its saved GPU data is damaged: the journal keeps it, but a retry goes "
                "through only once that data is whole again")


def restore_or_roll_back(engine: Engine, op: Operation, checkpointed: list[int],
                         gpu_map: Mapping[str, str] | None = None,
                         agents: Mapping[int, AgentTarget] | None = None,
                         locked: Iterable[int] = (), retry: Iterable[int] | None = None
                         ) -> dict[int, dict[str, Any]]:
    """Give checkpointed (CHECKPOINTED in the driver; gpu_map: their GPUs' pairs) their GPU
    state back and unlock them, unlock locked (LOCKED), then resume the programs in agents (after
    every unlock: a locked program's agent cannot resume). Returns pid -> {"bytes", "seconds"}
    of each agent's resume ({} when it took the retry).

    On a TorporError, one more try from wherever it got (engine.rollback of them all); it is an
    error only when that fails too: the journal entry is released (kept for recovery) and the
    error says both. retry: the PIDs the retry brings back (default checkpointed and locked;
    a resume adds the programs whose agents alone moved their memory)."""
    locked = list(locked)
    try:
        if not locked:
            return engine.restore_and_unlock(op, checkpointed, gpu_map, agents)
        op.phase("gpu-restore", agents={p: t.to_json() for p, t in (agents or {}).items()})
        engine.restore_and_unlock(op, checkpointed, gpu_map)
        op.phase("unlock")
        with engine.progress.phase("unlock", f"{len(locked)} locked"):
            for p in locked:
                engine.driver.unlock(p)
        return engine.restore_and_unlock(op, [], agents=agents) if agents else {}
    except TorporError as e:
        phase = op.entry.phase
        again = list(checkpointed) + locked if retry is None else list(retry)
        problems = engine.rollback(again, gpu_map, agents)   # once more, from where it got
        if problems:
            engine.release_held()   # before recovery may claim the entry and copy from files
            op.release()
            if e.exit_code == ExitCode.CORRUPT:   # its saved GPU data, changed: exit 9
                raise TorporError(f"{phase} failed: {e}; retry failed too: "
                                  + "; ".join(problems), hint=DAMAGED_HINT,
                                  exit_code=ExitCode.CORRUPT) from e
            raise TorporError(f"{phase} failed: {e}; retry failed too: " + "; ".join(problems),
                              hint=RETRY_HINT) from e
        log.warning("%s: %s failed (%s) but the retry worked", op.entry.id, phase, e)
        return {}


def timings(engine: Engine) -> dict[str, float]:
    """The phase timings of engine's progress, rounded as every door reports them."""
    return {k: round(v, 4) for k, v in engine.progress.timings.items()}


def data_path(path: str) -> Path | None:
    """An agents' data directory given as text: absolute, or none ("")."""
    from ..errors import UsageError
    if not path:
        return None
    if not Path(path).is_absolute():
        raise UsageError(f"gpu_data_dir must be an absolute path, not {path!r}")
    return Path(path)
