"""Capture what today's two manifest builders write, with fakes, as golden files.

Run once before the builders moved onto manifest_types.draft (issue 17): python3
tests/unit/golden/capture.py. The files are kept; test_manifest.py checks that they load and
that the new builder writes the same keys and values (created, host, kernel aside).
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from torpor import gpus, manifest, oci
from torpor.flows import checkpoint as process
from torpor.driver import ProcessState
from torpor.runtime import checkpoint as rt
from torpor.sidecar.convert import AgentData

HERE = Path(__file__).parent
A, B = "GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"
INV = gpus.Inventory("570.86.15", [gpus.Gpu(0, A, "NVIDIA H200", 150 << 30, 100 << 30, 0),
                                   gpus.Gpu(1, B, "NVIDIA H200", 150 << 30, 150 << 30, None)],
                     [gpus.GpuProcess(4242, A, 2 << 30), gpus.GpuProcess(4243, A, 1 << 30)])
AGENT = {"bytes": 2 << 30, "chunks": 64, "allocations": 3, "cache_released": 0,
         "seconds": 0.25, "files": [1 << 30, 1 << 30], "in_memory": False}
FPS = {"parts": 512, "skipped": 12, "skipped_bytes": 48 << 20, "seconds": 0.1, "error": ""}


def bare() -> dict:
    engine = SimpleNamespace(driver_or_none=lambda: SimpleNamespace(cuda_version=12080),
                             cfg=SimpleNamespace(tcp_established=True))
    tool = SimpleNamespace(version_text="4.1.1")
    d = process._manifest(tool, INV, engine, {4242: "python3", 4250: "sh"},
                          {4242: ProcessState.LOCKED}, 4242, True, False, {"lock": 0.01234567})
    d["agent"] = {"4242": {"nspid": 4242, **AGENT, "fingerprints": FPS,
                           "streamed": {"parts": 500, "bytes": 1 << 30, "chunks": 256}}}
    return d


def container() -> dict:
    spec = {"mounts": [{"destination": oci.AGENT_DIR_IN_CONTAINER, "source": "/run/torpor"}]}
    use = oci.GpuUse(minors=[0], visible=[], cdi=["nvidia.com/gpu=0"])
    ck = SimpleNamespace(   # torpord's LockAndCheckpoint answer, as the client types it
        cuda_processes=[SimpleNamespace(pid=4243, gpu_uuids=(A,), gpu_memory=1 << 30,
                                        gpu_memory_by_gpu={A: 1 << 30}, state="LOCKED")],
        agents=[AgentData.from_moved(4243, {"nspid": 1, **AGENT, "fingerprints": FPS})])
    with mock.patch.object(gpus, "discover", return_value=INV), \
            mock.patch.object(rt.procs, "comm", return_value="python3"):
        return rt._draft("c0ffee", spec, use, ck, 4243, True)


if __name__ == "__main__":
    for name, make in (("bare", bare), ("container", container)):
        d = make()
        d["files"] = {"pstree.img": {"size": 10, "sha256": ["0" * 64]},
                      "torpor-gpu/4242/gpu-memory-0.bin": {"size": 1 << 30, "sha256": None}}
        manifest.validate(d)
        (HERE / f"{name}.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    sys.exit(0)
