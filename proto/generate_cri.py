#!/usr/bin/env python3
"""Compile the Kubernetes CRI api.proto (runtime.v1) into the package integration._cri, the
tests' CRI client (nothing generated is committed; test.sh runs this).

    python proto/generate_cri.py [API_PROTO] [OUT_DIR]

API_PROTO defaults to the copy ./install.sh keeps from Debian's golang-k8s-cri-api-dev
(<containerd2 prefix>/share/cri-api/api.proto, prefix $TORPOR_CONTAINERD2 or
/opt/torpor/containerd2); OUT_DIR to integration/_cri. Runs `python -m grpc_tools.protoc`
(grpcio-tools), writes api_pb2.py, api_pb2.pyi, api_pb2_grpc.py and __init__.py, and makes
the import in api_pb2_grpc.py package-relative. Exits 0 with a note on stderr when there is
no api.proto (containerd 2 is not installed: the CRI tests skip).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "integration" / "_cri"
PREFIX = Path(os.environ.get("TORPOR_CONTAINERD2", "/opt/torpor/containerd2"))
DEFAULT_PROTO = PREFIX / "share" / "cri-api" / "api.proto"

INIT = ('"""Generated from the CRI api.proto (k8s.io/cri-api runtime/v1) by '
        'proto/generate_cri.py: do not edit."""\n')


def generate(proto: Path, out_dir: Path, python: str = sys.executable) -> list[Path]:
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "api.proto"          # protoc names the modules after the file
        shutil.copyfile(proto, src)
        staging = Path(tmp) / "out"
        staging.mkdir()
        cmd = [python, "-m", "grpc_tools.protoc", f"-I{tmp}", f"--python_out={staging}",
               f"--pyi_out={staging}", f"--grpc_python_out={staging}", str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"protoc failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
        grpc_file = staging / "api_pb2_grpc.py"
        text, n = re.subn(r"^import api_pb2 as api__pb2$", "from . import api_pb2 as api__pb2",
                          grpc_file.read_text(), flags=re.M)
        if n != 1:
            raise RuntimeError(f"{grpc_file}: expected one 'import api_pb2' line, found {n}")
        grpc_file.write_text(text)
        (staging / "__init__.py").write_text(INIT)
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staging, out)
    return sorted(out.iterdir())


def main(argv: list[str]) -> int:
    proto = Path(argv[1]) if len(argv) > 1 else DEFAULT_PROTO
    out = Path(argv[2]) if len(argv) > 2 else DEFAULT_OUT
    if not proto.is_file():
        print(f"generate_cri: no {proto} (containerd 2 not installed): no CRI client",
              file=sys.stderr)
        return 0
    for path in generate(proto, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
