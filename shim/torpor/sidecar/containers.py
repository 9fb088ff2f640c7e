"""The container registry of torpord: one <state_dir>/containers/<name>.json per registered
container (files 0600, directory 0700), written whole (files.write_json) so a reader never
sees half a record. A record is named as torpor names the container (oci.container_name):
<id>@<root key>, as torpor-hook registers a container torpor-runtime created (one id may live
under two runtime roots at once: each has its own record, PIDs and agent directory), or <id>
alone (one an earlier torpor created, or one torpor-runtime did not create). Names are checked
(oci.validate_container_name) before they name a file.

Readers: torpord's container_id requests (the PIDs of LockAndCheckpoint, RestoreAndUnlock and
Status, and the agent directory they default to), List (`torpor ps`: which container a GPU
process is in, and its agent directory). torpor-runtime's own checkpoint and restore send
PIDs and need no record.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from ..errors import NotFoundError, TorporError, UsageError
from ..files import private_dir, write_json
from ..oci import NAME_SEP, validate_container_name

log = logging.getLogger("torpor.sidecar")


class Containers:
    """Registered containers, one <state_dir>/containers/<name>.json each (0600, dir 0700)."""

    def __init__(self, directory: Path):
        self.dir = private_dir(directory)
        self._lock = threading.Lock()

    def _path(self, name: str) -> Path:
        return self.dir / f"{validate_container_name(name)}.json"

    def put(self, record: dict[str, Any]) -> None:
        with self._lock:
            write_json(self._path(record["id"]), record)

    def name_of(self, cid: str) -> str:
        """The registered name a request's container_id means: a name as it is; a bare id the
        record of that id alone, else the one record of that id under a runtime root
        (UsageError where there are several: the name must say which)."""
        if NAME_SEP in cid or self._path(cid).exists():   # (_path: a bad id is refused)
            return cid
        found = sorted(p.name[:-len(".json")] for p in self.dir.glob(f"{cid}{NAME_SEP}*.json"))
        if len(found) > 1:
            raise UsageError(f"container id '{cid}' is registered under {len(found)} runtime "
                             f"roots: name one of {', '.join(found)}")
        return found[0] if found else cid

    def get(self, cid: str) -> dict[str, Any]:
        """The record of a container id or name (name_of)."""
        path = self._path(self.name_of(cid))
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise NotFoundError(f"no registered container '{cid}'") from None
        except (OSError, ValueError) as e:
            raise TorporError(f"container record {path} is unreadable: {e}") from e

    def remove(self, name: str) -> bool:
        """Forget the record of exactly this name (another root's of the same id stays)."""
        with self._lock:
            try:
                self._path(name).unlink()
                return True
            except FileNotFoundError:
                return False

    def all(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError) as e:
                log.warning("skipping unreadable container record %s: %s", path, e)
        return out
