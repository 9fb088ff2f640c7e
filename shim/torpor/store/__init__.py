"""The deduplicating image store (chunks, snapshots, gc); see store.py."""

from .store import CHUNK_SIZE, GcResult, SnapshotInfo, Store, VerifyResult

__all__ = ["CHUNK_SIZE", "GcResult", "SnapshotInfo", "Store", "VerifyResult"]
