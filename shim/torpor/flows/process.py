"""The bare-process flows in one name (the CLI's, bench/'s and the tests'): checkpoint,
restore, suspend and resume of process trees (checkpoint.py, restore.py, suspend.py)."""

from .checkpoint import checkpoint, checkpoint_into_store, store_checkpoint
from .restore import restore, restore_any
from .suspend import resume, suspend

__all__ = ["checkpoint", "checkpoint_into_store", "restore", "restore_any", "resume",
           "store_checkpoint", "suspend"]
