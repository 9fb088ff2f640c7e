"""setuptools glue for pyproject.toml: compile proto/torpor.proto, the agent and the native
runtime front while building.

Everything else (metadata, packages, scripts) is in pyproject.toml. build_py generates
torpor/_proto/ and builds agent/ (make) into torpor/_agent/libtorpor-agent.so, in the build
directory (or the source tree for editable installs), so `pip install .` ships both without
either being committed. It also builds shim/front (make) into shim/front/build/torpor-runtime,
which data_files install as <prefix>/bin/torpor-runtime, beside the Python side's
torpor-runtime-py (a console script) that it execs.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
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
        self._build_agent(out.parent / "_agent")
        self._build_front()

    def _build_agent(self, out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="torpor-agent-") as tmp:
            try:
                subprocess.run(["make", "-s", "-C", str(HERE / "agent"), f"BUILD={tmp}"],
                               check=True)
            except (OSError, subprocess.CalledProcessError) as e:
                raise SystemExit(f"building the agent (make -C agent) failed: {e}; "
                                 "it needs make and a C compiler (./install.sh installs them)")
            out.mkdir(parents=True, exist_ok=True)
            for name in ("libtorpor-agent.so", "torpor-copier"):
                shutil.copy2(Path(tmp) / name, out / name)
        self.announce(f"built {out / 'libtorpor-agent.so'} and {out / 'torpor-copier'}", level=2)


    def _build_front(self) -> None:
        try:
            # -B: always from the sources here (an sdist may carry a binary built elsewhere)
            subprocess.run(["make", "-B", "-s", "-C", str(HERE / "shim" / "front")], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"building torpor-runtime (make -C shim/front) failed: {e}; "
                             "it needs make and a C compiler (./install.sh installs them)")
        self.announce(f"built {FRONT}", level=2)


FRONT = "shim/front/build/torpor-runtime"


class SdistWithProto(sdist):
    def add_defaults(self) -> None:
        super().add_defaults()
        for name in ("proto/torpor.proto", "proto/generate.py", "agent/Makefile",
                     "shim/front/Makefile", "shim/front/torpor-runtime.c"):
            self.filelist.append(name)
        self.filelist.recursive_include("agent/src", "*")
        self.filelist.recursive_include("agent/copier", "*")


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for the platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithProto, "sdist": SdistWithProto},
      distclass=BinaryDistribution,
      data_files=[("bin", [FRONT])])
