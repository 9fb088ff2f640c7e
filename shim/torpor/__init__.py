"""torpor: GPU-aware checkpoint/restore for containers and processes.

Library first: the engine (lock / checkpoint / dump / restore / unlock of process sets)
lives in plain typed functions; the `torpor` CLI and the `torpord` sidecar are thin doors
onto it.
"""

__version__ = "0.1.0"
