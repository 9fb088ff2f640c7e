#!/usr/bin/env python3
"""Start containerd 2 from $TORPOR_CONTAINERD2 once, as the CRI tests and bench/cri_path.py
will (integration/cri.py: the config ./install.sh installs, root and state under BASE, the
sandbox image imported with ctr), ask its CRI for Version and stop it: run-on-gpu-host.sh's
check that the carried bundle works before the tests use it.

    python3 tests/gpu/containerd2_smoke.py BASE      (exit 0: it answered)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT)]

from integration import cri  # noqa: E402


def main(argv: list[str]) -> int:
    base = Path(argv[1] if len(argv) > 1 else "/var/lib/torpor-c2")
    why = cri.missing()
    if why:
        print(f"containerd 2: {why}")
        return 1
    cri.remove_tree(base)
    try:
        d = cri.Containerd2(base, "/usr/local/bin/torpor-runtime")
    except Exception as e:     # its message ends with the daemon's log
        print(f"containerd 2 did not start: {e}")
        return 1
    try:
        c = cri.Cri(d.socket)
        try:
            print(f"containerd 2 from {cri.PREFIX}: CRI {c.version()}; images: "
                  + " ".join(line.split()[0] for line in d.ctr("images", "ls").splitlines()[1:]))
        finally:
            c.close()
    except Exception as e:  # what the set-up needs to see: one line and the daemon's log
        print(f"containerd 2 smoke run failed: {e}\n{d.log_tail()}")
        return 1
    finally:
        d.stop()
        cri.remove_tree(base)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
