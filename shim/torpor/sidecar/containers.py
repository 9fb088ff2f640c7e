"""The container registry of torpord: one <state_dir>/containers/<id>.json per registered
container (files 0600, directory 0700), written whole (files.write_json) so a reader never
sees half a record. Ids are checked (oci.validate_container_id) before they name a file.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from ..errors import NotFoundError, TorporError
from ..files import private_dir, write_json
from ..oci import validate_container_id

log = logging.getLogger("torpor.sidecar")


class Containers:
    """Registered containers, one <state_dir>/containers/<id>.json each (0600, dir 0700)."""

    def __init__(self, directory: Path):
        self.dir = private_dir(directory)
        self._lock = threading.Lock()

    def _path(self, cid: str) -> Path:
        return self.dir / f"{validate_container_id(cid)}.json"

    def put(self, record: dict[str, Any]) -> None:
        with self._lock:
            write_json(self._path(record["id"]), record)

    def get(self, cid: str) -> dict[str, Any]:
        path = self._path(cid)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise NotFoundError(f"no registered container '{cid}'") from None
        except (OSError, ValueError) as e:
            raise TorporError(f"container record {path} is unreadable: {e}") from e

    def remove(self, cid: str) -> bool:
        with self._lock:
            try:
                self._path(cid).unlink()
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
