"""torpor's checkpoint and restore flows: every policy, once, for the three doors.

The CLI (bare process trees), torpord's handlers (containers) and torpor-runtime (runc argv)
only translate their input into calls of this package and its results into their output:

  policy.py     the store opened from cfg.store_dir, where a flow needs it (one error text); the
                fingerprint/stream plan; restore with its one retry, then roll back
  checkpoint.py, restore.py, suspend.py
                checkpoint (and its pack into the store), restore, suspend and resume of bare
                process trees (the CLI's); process.py names them all
  container.py  the operations torpord holds open for a container's runtime (lock and
                checkpoint, finish, roll back, restore and unlock), typed in and out, and
                where a container checkpoint's GPUs go on restore (torpor-runtime's)
Placement ("same GPUs: no pairs") is placement.driver_map; the engine (engine/) moves the
GPU state and the agents' data.
"""
