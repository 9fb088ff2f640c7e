"""torpor-runtime: an OCI runtime (runc/crun command line) that adds GPU state to checkpoints.

This package is its Python side, torpor-runtime-py. torpor-runtime, the command engines call,
is a native front (shim/front) that execs runc itself for every call torpor has nothing to do
with and this package for the rest (docs/containers.md, "The native front"; markers.py).

podman (containers.conf `[engine.runtimes]`) and containerd (runc shim option `BinaryName`)
call it exactly as they call runc. Every command goes to the real runtime (config
`oci_runtime`) unchanged; four get GPU handling around them, and only for containers whose
spec names NVIDIA GPUs (torpor.oci.detect) — the rest are exec'd untouched:

  create      add torpor's OCI hooks (register/unregister with torpord) to the spec
  checkpoint  torpord locks and checkpoints the CUDA state, the real runtime dumps, torpor.json
              goes into the image directory; any failure rolls the GPU state back
  restore     read torpor.json, pick GPUs, rewrite the bundle's devices, restore, then torpord
              restores the GPU state on the new host PIDs and unlocks
  delete      forget the container in torpord
"""
