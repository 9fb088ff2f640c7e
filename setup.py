"""setuptools glue for pyproject.toml: compile proto/torpor.proto while building.

Everything else (metadata, packages, scripts) is in pyproject.toml. build_py generates
torpor/_proto/ into the build directory (or into the source tree for editable installs), so
`pip install .` ships the gRPC modules without them being committed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent


def _generator():
    spec = importlib.util.spec_from_file_location("torpor_proto_generate",
                                                  HERE / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class BuildPyWithProto(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            out = HERE / "shim" / "torpor" / "_proto"
        else:
            out = Path(self.build_lib) / "torpor" / "_proto"
        for path in _generator().generate(out):
            self.announce(f"generated {path}", level=2)


class SdistWithProto(sdist):
    def add_defaults(self) -> None:
        super().add_defaults()
        for name in ("proto/torpor.proto", "proto/generate.py"):
            self.filelist.append(name)


setup(cmdclass={"build_py": BuildPyWithProto, "sdist": SdistWithProto})
