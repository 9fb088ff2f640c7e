#!/usr/bin/env python3
"""Compile proto/torpor.proto into the package torpor._proto (nothing generated is committed).

    python proto/generate.py [OUT_DIR]      # default: shim/torpor/_proto

Runs `python -m grpc_tools.protoc` (grpcio-tools), writes torpor_pb2.py, torpor_pb2.pyi,
torpor_pb2_grpc.py and __init__.py, and makes the import in torpor_pb2_grpc.py package-relative.
setup.py's build_py calls generate() on the build directory, so `pip install .` ships them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO = PROTO_DIR / "torpor.proto"
DEFAULT_OUT = PROTO_DIR.parent / "shim" / "torpor" / "_proto"

INIT = '"""Generated from proto/torpor.proto by proto/generate.py: do not edit."""\n'


def generate(out_dir: Path | str = DEFAULT_OUT, python: str = sys.executable) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={out}",
           f"--pyi_out={out}", f"--grpc_python_out={out}", str(PROTO)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"protoc failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
    grpc_file = out / "torpor_pb2_grpc.py"
    text = grpc_file.read_text()
    fixed, n = re.subn(r"^import torpor_pb2 as torpor__pb2$",
                       "from . import torpor_pb2 as torpor__pb2", text, flags=re.M)
    if n != 1:
        raise RuntimeError(f"{grpc_file}: expected one 'import torpor_pb2' line, found {n}")
    grpc_file.write_text(fixed)
    (out / "__init__.py").write_text(INIT)
    return [out / n for n in ("__init__.py", "torpor_pb2.py", "torpor_pb2.pyi",
                              "torpor_pb2_grpc.py")]


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    for path in generate(out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
