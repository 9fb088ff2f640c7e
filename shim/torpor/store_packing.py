"""A sealed checkpoint packed into the image store (store/images.py), journaled so that nothing
is lost however the pack ends.

A checkpoint whose agents skipped GPU data the store had (store/fingerprints.py) is not whole
until its pack names those chunks. If the pack fails, or is interrupted (Ctrl-C), the skipped
parts are filled in from the store before the error is raised, so the directory stands on its
own, unpacked. If torpor dies (SIGKILL, a power cut), its journal entry (kind "pack",
journal.py) stays, and the next torpor command or torpord fills them in (finish_interrupted).
Until then `torpor rm` and `gc` refuse: they could take the chunks the holes need. Only a
checkpoint whose own records of its GPU data are malformed (DamagedRecordsError: its agent
runs inside the program, which can write them) is given up on: no retry could say what its
holes are, and its entry must not hold the shared store's rm and gc off for good. It is marked
damaged (manifest.mark_damaged), and every later read of it says why.
Used by `torpor checkpoint --store` (flows/process.py) and torpor-runtime (runtime/checkpoint.py).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from . import agent_data, interrupts, manifest
from .config import Config
from .errors import BusyError, DamagedRecordsError, ExitCode, TorporError, describe, no_space
from .journal import Entry, Journal
from .progress import human_bytes
from .store import Store, fingerprints, images
from .store.writer import WriteStats

log = logging.getLogger(__name__)


def pack(journal: Journal, store: Store, images_dir: Path, name: str, owner: str,
         known: fingerprints.Known | None = None, checksums: bool = True
         ) -> tuple[dict[str, Any], WriteStats]:
    """images.pack(), journaled. Any failure, Ctrl-C included, raises TorporError saying what
    became of images_dir: unpacked and whole (what its agents skipped filled in, and with
    checksums: a checkpoint into the store is sealed without them), or, when even that
    failed, left to recovery."""
    packed_before = images.is_packed(images_dir)   # refused by images.pack: nothing to undo
    op = None
    try:
        op = journal.begin("pack", [])
        op.phase("pack", images_dir=str(images_dir.absolute()), store_owner=owner)
        result = images.pack(store, images_dir, name, owner, known)
    except BaseException as e:
        if packed_before:
            raise
        why = describe(e)
        with interrupts.deferred():       # a second Ctrl-C must not stop the fill
            try:
                stand_alone(store, images_dir, owner, checksums)
            except DamagedRecordsError as f:
                if op is not None:
                    op.close()            # nothing for recovery to try again
                raise DamagedRecordsError(
                    f"storing {images_dir} as {name}: " + ("" if str(f) == why else f"{why}; ")
                    + give_up(images_dir, f)) from e
            except (TorporError, OSError) as f:
                if op is not None:
                    op.release()          # kept: recovery tries again
                raise TorporError(
                    f"storing {images_dir} as {name}: {why}; it is not packed, and could not "
                    f"be made whole from store {store.where} ({describe(f)}): "
                    + ("the next torpor command tries again" if op is not None else
                       "it lacks the GPU data its agents skipped"),
                    exit_code=_code(e)) from e
            if op is not None:
                op.close()
        cls = type(e) if isinstance(e, TorporError) else TorporError
        # a full store is exit 8, as a full disk is at every other phase (README)
        raise cls(f"storing {images_dir} as {name}: {why}; the checkpoint in {images_dir} is "
                  "complete, not packed",
                  exit_code=ExitCode.ROLLED_BACK if no_space(e) else _code(e),
                  hint=e.hint if isinstance(e, TorporError) else None) from e
    op.close()
    return result


def _code(e: BaseException) -> int | None:
    if isinstance(e, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    return e.exit_code if isinstance(e, TorporError) else None


def stand_alone(store: Store, images_dir: Path, owner: str, checksums: bool) -> int:
    """A checkpoint directory that is not packed made whole: what a pack left of itself goes
    (its chunk links), what its agents skipped is filled in from the store, and, with
    checksums, torpor.json gets the checksums it was sealed without. The bytes filled."""
    if images.is_packed(images_dir):
        return 0
    for leftover in (images_dir / images.CHUNKS, images_dir / f".{images.CHUNKS}.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    if owner and fingerprints.any_skipped(images_dir):
        # what its agents streamed is this checkpoint's to take back (discard_unnamed) once
        # the directory holds it: torpord's stream (a container's) added it through a Store
        # of its own, which this one did not see; the fill drops the records that name it
        for name in fingerprints.streamed_chunks(images_dir):
            store.created(name)
        filled = fingerprints.fill_dir(store, images_dir, owner)
    else:
        filled = 0
    if checksums:
        manifest.add_checksums(images_dir)
    return filled


def give_up(images_dir: Path, e: DamagedRecordsError) -> str:
    """Mark a checkpoint that cannot be made whole damaged; what became of it, for a message."""
    manifest.mark_damaged(images_dir, f"its GPU data lacks parts that only its own records "
                                      f"could say, and they are damaged: {e}")
    return (f"it cannot be made whole: {e}; it is marked damaged ({manifest.DAMAGED}) and can "
            "only be removed")


def unfinished(journal: Journal) -> BusyError | None:
    """Why chunks no snapshot names must not be removed now, or None: a dead torpor's pack, or
    its stream into the store, whose directory still needs them (recovery has not finished).
    What rm and gc refuse on, and a failed checkpoint's discard_unnamed waits for."""
    from .engine.agents import targets_of   # the engine imports this module
    for entry, fd in journal.orphans():
        os.close(fd)
        if entry.kind == "pack":
            return BusyError(f"the checkpoint in {entry.images_dir} was being packed into the "
                             "store when its torpor died, and is not whole yet: removing "
                             "chunks now could lose it",
                             hint="see why above; once fixed, any torpor command finishes it")
        streamed = [p for p, t in targets_of(entry.agents).items() if not t.in_process
                    and (agent_data.DataDir(t.data).path(t.name) / agent_data.STREAMED).exists()]
        if streamed:
            return BusyError(f"the GPU data of PID {streamed[0]}, streamed into the store by "
                             f"an interrupted {entry.kind}, is in no snapshot yet and its "
                             "recovery has not finished: removing chunks now could lose it",
                             hint="see why above; once fixed, any torpor command finishes it")
    return None


def discard_unnamed(journal: Journal, store: Store, images_dir: Path | None,
                    say: Callable[[str], None]) -> None:
    """After a checkpoint into store failed, with the store's lock no longer held: the chunks
    its writers (the agents' stream, the pack) added and no snapshot names removed, so that a
    full store is not left full until gc (Store.discard_unnamed). Not while images_dir still
    needs them (holes its recovery fills from the store), nor while a dead torpor's pack or
    stream is unrecovered (they may name the same chunks), nor while another writer holds the
    store: those are gc's. Says what it did; never raises (the checkpoint's error is what
    matters)."""
    if not store.unnamed():
        return
    left = f"{len(store.unnamed())} chunk(s) it added to store {store.where} are left for " \
           "`torpor gc`"
    done = None
    try:
        if images_dir is not None and fingerprints.any_skipped(images_dir):
            why = f"{images_dir} still needs them"
        elif (busy := unfinished(journal)) is not None:
            why = str(busy)
        else:
            done = store.discard_unnamed()
            why = "another torpor is writing to the store"
    except (TorporError, OSError) as e:
        why = describe(e)
    if done is None:
        log.info("%s: %s", left, why)
        say(f"{left}: {why}")
        return
    log.info("removed %d chunk(s) (%d bytes) a failed checkpoint added to store %s; %d kept "
             "(named or linked by now)", len(done.removed), done.freed, store.where, done.kept)
    if done.removed:
        say(f"removed the {len(done.removed)} chunk(s) ({human_bytes(done.freed)}) it added to "
            f"store {store.where}: no snapshot names them")


def finish_interrupted(cfg: Config, entry: Entry) -> list[str]:
    """Recovery of a pack whose torpor died: its directory made whole (stand_alone)."""
    images_dir = Path(entry.images_dir)
    if not entry.images_dir or not images_dir.is_dir() or images.is_packed(images_dir):
        return []
    try:
        filled = stand_alone(Store(cfg.store_dir), images_dir, entry.store_owner, cfg.checksums)
    except DamagedRecordsError as e:
        return [f"the checkpoint in {images_dir}, whose pack into the image store was "
                "interrupted: " + give_up(images_dir, e)]
    return [f"the checkpoint in {images_dir}, whose pack into the image store was interrupted, "
            "is complete, not packed" + (f" ({human_bytes(filled)} of GPU data its agents "
                                        "skipped filled in from the store)" if filled else "")]
