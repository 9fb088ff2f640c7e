"""torpor-runtime's native front (shim/front/torpor-runtime.c), built from this tree: which
calls it execs runc for and which it hands to the Python side, always with the argv unchanged.

A fake runc and a fake Python side (TORPOR_RUNTIME_PY) record (who, argv); the last tests run
the real Python side (torpor-runtime-py of this venv) behind the front, to see the markers it
leaves for GPU containers decide later calls. No daemon, no podman, no GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CID = "c0ffee0123456789"

RECORDER = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    with open({log!r}, "a") as f:
        f.write(json.dumps([os.path.basename(sys.argv[0]), sys.argv[0], sys.argv[1:]]) + "\\n")
    sys.exit(0)
""")


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The front, compiled from this tree with warnings as errors (TORPOR_FRONT_CFLAGS: more,
    e.g. -fsanitize=address,undefined)."""
    if shutil.which("make") is None or shutil.which("gcc") is None:
        pytest.skip("needs make and gcc (./install.sh)")
    build = tmp_path_factory.mktemp("front")
    subprocess.run(["make", "-s", "-C", str(ROOT / "shim" / "front"), f"BUILD={build}",
                    "EXTRA_CFLAGS=-Werror " + os.environ.get("TORPOR_FRONT_CFLAGS", "")],
                   check=True)
    return build / "torpor-runtime"


class World:
    """A fake runc and a fake Python side in tmp, the front's environment, a bundle."""

    def __init__(self, tmp: Path, front: Path):
        self.tmp, self.front = tmp, front
        self.log = tmp / "calls.jsonl"
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.runc = self.recorder("runc")
        self.py = self.recorder("torpor-runtime-py")
        self.run_dir = tmp / "run"
        self.bundle = tmp / "bundle"
        self.bundle.mkdir()
        self.env = {"PATH": "/usr/bin:/bin", "TORPOR_OCI_RUNTIME": str(self.runc),
                    "TORPOR_RUNTIME_PY": str(self.py), "TORPOR_RUN_DIR": str(self.run_dir),
                    "TORPOR_CONFIG": str(tmp / "no-config.toml")}
        self.spec({"process": {"args": ["sh"], "env": ["PATH=/usr/bin", "TERM=xterm"]},
                   "root": {"path": "rootfs"}, "linux": {"devices": []}})

    def recorder(self, name: str) -> Path:
        p = self.bin / name
        p.write_text(RECORDER.format(python=sys.executable, log=str(self.log)))
        p.chmod(0o755)
        return p

    def spec(self, doc: dict | str) -> None:
        (self.bundle / "config.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))

    def marker(self, cid: str = CID, root: str = "") -> Path:
        """Where the Python side keeps (root, cid)'s marker (markers.path)."""
        from torpor.runtime import markers
        return self.run_dir / "containers" / f"{cid}@{markers.root_key(root)}"

    def mark(self, cid: str = CID, root: str = "") -> None:
        """A marker of cid under root ("": none given, runc's default)."""
        m = self.marker(cid, root)
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(json.dumps({"roots": [root]}) + "\n")

    def mark_legacy(self, cid: str = CID, root: str = "") -> Path:
        """A marker as torpor wrote it before markers were named by their root too."""
        m = self.run_dir / "containers" / cid
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(json.dumps({"root": root}) + "\n")
        return m

    def debug(self, *argv: str, **env: str) -> str:
        """The front's TORPOR_DEBUG lines for argv."""
        out = subprocess.run([str(self.front), *argv],
                             env={**self.env, "TORPOR_DEBUG": "1", **env},
                             capture_output=True, timeout=30)
        return os.fsdecode(out.stderr)

    def route(self, *argv: str, **env: str) -> str:
        """Where the front itself sends argv (runc or python), whatever the Python side then
        execs: its TORPOR_DEBUG line says."""
        lines = [x for x in self.debug(*argv, **env).splitlines()
                 if ": runc (" in x or ": python (" in x]
        assert len(lines) == 1, lines
        return "python" if ": python (" in lines[0] else "runc"

    def call(self, *argv: str, cwd: Path | None = None, **env: str) -> tuple[str, list[str]]:
        """Run the front; returns (who ran: runc or torpor-runtime-py, its argv[1:])."""
        self.log.unlink(missing_ok=True)
        out = subprocess.run([str(self.front), *argv], env={**self.env, **env}, cwd=cwd,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        lines = self.log.read_text().splitlines()
        assert len(lines) == 1, lines
        who, _argv0, args = json.loads(lines[0])
        assert args == list(argv)    # always the argv it was given, unchanged
        return who, args

    def goes(self, *argv: str, **env: str) -> str:
        return {"runc": "runc", "torpor-runtime-py": "python"}[self.call(*argv, **env)[0]]


@pytest.fixture
def w(tmp_path: Path, front: Path) -> World:
    return World(tmp_path, front)


GLOBALS = ["--root", "/run/x", "--log", "/tmp/l.json", "--log-format", "json",
           "--systemd-cgroup"]


def test_cpu_create_goes_straight_to_runc(w):
    assert w.goes(*GLOBALS, "create", "--bundle", str(w.bundle), "--pid-file", "/p",
                  "--console-socket", "/s", CID) == "runc"
    assert w.goes("create", f"--bundle={w.bundle}", CID) == "runc"
    assert w.goes("create", "-b", str(w.bundle), CID) == "runc"
    assert w.goes("run", "-d", "--bundle", str(w.bundle), CID) == "runc"


def test_create_reads_the_bundle_in_the_current_directory_by_default(w):
    assert w.call("create", CID, cwd=w.bundle)[0] == "runc"
    w.spec({"linux": {"devices": [{"path": "/dev/nvidia0"}]}})
    assert w.call("create", CID, cwd=w.bundle)[0] == "torpor-runtime-py"


@pytest.mark.parametrize("spec", [
    {"linux": {"devices": [{"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3}]}},
    {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}},
    {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=none"]}},    # Python's to decide, not ours
    {"annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=0"}},
    {"annotations": {"org.torpor.agent": "on"}},
    '{"linux": {"devices": [{"path": "\\/dev\\/nvidia0"}]}}',  # JSON may escape "/"
    '{"process": {"env": ["NVIDIA_VISIBLE_DEVICE\\u0053=all"]}}',
], ids=["device", "env", "env-none", "cdi", "annotation", "escaped-slash", "u-escape"])
def test_create_of_anything_torpor_may_handle_goes_to_python(w, spec):
    w.spec(spec)
    assert w.goes(*GLOBALS, "create", "--bundle", str(w.bundle), CID) == "python"


def test_escapes_of_characters_no_rule_reads_stay_with_runc(w):
    # Go's encoder writes <, > and & as \\u003c, \\u003e, \\u0026: none spells a GPU
    w.spec('{"process": {"env": ["URL=http://x/?a=1\\u0026b=\\u003cc\\u003e", "Q=\\"x\\""]}}')
    assert w.goes("create", "--bundle", str(w.bundle), CID) == "runc"


@pytest.mark.parametrize("setup", ["missing", "directory", "unreadable-bundle", "fifo"])
def test_create_with_a_spec_the_front_cannot_read_goes_to_python(w, setup):
    if setup == "fifo":          # reading it would block: refused at once
        (w.bundle / "config.json").unlink()
        os.mkfifo(w.bundle / "config.json")
        bundle = w.bundle
    elif setup == "missing":
        (w.bundle / "config.json").unlink()
        bundle = w.bundle
    elif setup == "directory":
        (w.bundle / "config.json").unlink()
        (w.bundle / "config.json").mkdir()
        bundle = w.bundle
    else:
        bundle = w.tmp / "no-such-bundle"
    assert w.goes("create", "--bundle", str(bundle), CID) == "python"


@pytest.mark.parametrize("command", ["delete", "state", "start", "kill", "pause", "resume",
                                     "ps", "events", "update", "exec"])
def test_container_commands_follow_the_marker(w, command):
    extra = {"kill": ["KILL"], "exec": ["sh", "-c", "true"]}.get(command, [])
    argv = [*GLOBALS, command, CID, *extra]
    assert w.goes(*argv) == "runc"
    w.mark(root="/run/x")
    assert w.goes(*argv) == "python"
    assert w.goes(*GLOBALS, command, "--help", CID, *extra) == "runc"   # help: runc's
    assert w.goes(*argv[2:]) == "runc"     # the same id under runc's default root: not ours


def test_marker_of_another_container_changes_nothing(w):
    w.mark("other")
    assert w.goes("delete", "--force", CID) == "runc"


def test_options_after_the_container_id_are_read_as_runc_reorders_them(w):
    w.mark()
    assert w.goes("delete", CID, "--force") == "python"
    assert w.goes("delete", "-f", CID) == "python"
    assert w.goes("kill", "--all=true", CID, "9") == "python"
    # exec and ps stop at the id: what follows is the process's own argv
    assert w.goes("exec", "--tty", "--env", "A=1", "-u", "0", CID, "ls", "--bogus") == "python"
    assert w.goes("exec", "-e=A=1", "--", CID, "ls") == "python"
    assert w.goes("ps", "-f", "json", CID, "--", "-ef") == "python"


def test_checkpoint_and_restore_always_go_to_python(w):
    assert w.goes(*GLOBALS, "checkpoint", "--image-path", "/i", CID) == "python"
    assert w.goes("restore", "--image-path", "/i", "--bundle", str(w.bundle), CID) == "python"


@pytest.mark.parametrize("argv", [
    ["--version"], ["-v"], ["--help"], ["list"], ["--root", "/r", "list", "-q"],
    ["spec", "--rootless"], ["features"], ["help", "create"], ["--root", "/r", "--help",
                                                                 "checkpoint", CID],
    ["state"],   # runc says the id is missing
])
def test_calls_without_a_container_go_to_runc(w, argv):
    w.mark()
    assert w.goes(*argv) == "runc"


@pytest.mark.parametrize("argv", [
    ["create", "--help=false", "--bundle", "B", CID],
    ["create", "--bundle", "B", CID, "-h=0"],
    ["run", "-d", "--help=False", "-b", "B", CID],
    ["create", "--help", "--help=f", "--bundle", "B", CID],      # the last one wins
    ["--help=false", "create", "--bundle", "B", CID],
    ["--version=F", "-v=FALSE", "-h=0", "create", "--bundle", "B", CID],
    ["create", "--help=yes", "--bundle", "B", CID],              # runc refuses it: odd
])
def test_a_help_flag_set_to_false_asks_for_no_help(w, argv):
    """runc (Go's flag package) reads --help=false as no help and creates the container: a
    GPU spec must reach Python all the same."""
    w.spec({"linux": {"devices": [{"path": "/dev/nvidia0"}]}})
    assert w.goes(*[str(w.bundle) if a == "B" else a for a in argv]) == "python"


@pytest.mark.parametrize("argv", [
    ["create", "--help=true", CID], ["create", "-h=1", CID], ["--help=T", "create", CID],
    ["--version=true", "state", CID], ["create", "-h", "--help=false", CID],   # two flags
])
def test_a_help_flag_set_to_true_is_runcs(w, argv):
    w.spec({"linux": {"devices": [{"path": "/dev/nvidia0"}]}})
    w.mark()
    assert w.call(*argv, cwd=w.bundle)[0] == "runc"


@pytest.mark.parametrize("argv", [
    ["--bogus", "state", CID],                  # a global option runc does not have
    ["state", "--bogus", CID],                  # a command option runc does not have
    ["---root", "/r", "state", CID],            # Go's flag package refuses it
    ["--root", "--log", "x", "state", CID],     # a value that looks like an option
    ["--root"],                                 # a value missing
    ["create", "--bundle", CID],
    ["create", "-b", "/a", "--bundle", "/b", CID],   # both forms: runc refuses it
    ["frobnicate", CID],                        # a command of a newer runc, or none
    ["state", "bad/id"], ["state", ".."], ["state", "x" * 129],
    ["kill", "KILL", "--all", CID],             # urfave moves CID before KILL: CID's kill
])
def test_anything_the_front_cannot_read_goes_to_python(w, argv):
    assert w.goes(*argv) == "python"


def test_root_is_read_in_every_form_runc_accepts(w, tmp_path):
    w.mark(root="/r")
    for g in (["--root", "/r"], ["--root=/r"], ["-root", "/r"], ["-root=/r"],
              ["--debug", "--root", "/x", "--root", "/r"],      # the last one, as Go's flag
              ["--root", "/r", "--debug=false", "--criu", "c", "--rootless", "auto"]):
        assert w.goes(*g, "state", CID) == "python", g
    none = (["--debug"], ["--debug=false", "--criu", "c", "--rootless", "auto"], ["--"],
            ["--root="], ["--root", "/r", "--root", "/x"])
    for g in none:
        assert w.goes(*g, "state", CID) == "runc", g
    w.mark(root="")
    for g in none[:-1]:
        assert w.goes(*g, "state", CID) == "python", g


ROOTS = {"none": None, "empty": "", "runc": "/run/runc",
         "k8s": "/run/containerd/runc/k8s.io", "spaces": "/var/run/my root/ x ",
         "long": "/" + "r" * 5000,                       # longer than PATH_MAX: only hashed
         "utf8": "/run/é/容器", "not-utf8": os.fsdecode(b"/run/\xff\xfe"),
         "dash": "-x=--y",
         # spellings of one root (markers.normalize_root): one marker for all
         "trailing": "/run/runc/", "double": "/run//runc", "dot": "/run/./runc",
         "all-of-them": "//run/.//runc/./", "dotdot-kept": "/run/../runc/", "slash": "/",
         "slashes": "///", "relative": "./x//y/", "dot-only": ".", "dot-slash": "./"}


@pytest.mark.parametrize("root", ROOTS.values(), ids=ROOTS.keys())
def test_front_and_python_agree_on_the_markers_name(w, root):
    """The front and markers.py derive a marker's name from the same argv, each its own way
    (C's root_key of argv's bytes, Python's of the decoded string), both reading the root
    lexically first: they must name the same file, or a GPU container's delete goes straight
    to runc. Another spelling of the root finds the marker too."""
    from types import SimpleNamespace
    from torpor.runtime import argv as argv_mod, markers

    cfg = SimpleNamespace(run_dir=w.run_dir)
    forms = [[]] if root is None else [["--root", root], [f"--root={root}"], ["-root", root]]
    if root is not None and root.startswith("-"):
        forms = [[f"--root={root}"]]       # a value that looks like an option: odd, Python's
    for g in forms:
        inv = argv_mod.parse([*g, "create", "--bundle", str(w.bundle), CID])
        want = markers.path(cfg, CID, markers.root_of_invocation(inv))
        assert f"marker {want}\n" in w.debug(*g, "state", CID), g
        assert w.goes(*g, "state", CID) == "runc"
        assert markers.write(cfg, inv)
        assert w.goes(*g, "state", CID) == "python", g
        if root:    # "" (or none) is runc's default root: no spelling of a path
            normal = markers.normalize_root(root)
            assert w.goes(f"--root={normal}", "state", CID) == "python", normal
            assert w.goes(f"--root={normal}/./", "state", CID) == "python", normal
        assert w.goes("--root", "/elsewhere", "state", CID) == "runc"
        assert markers.remove(cfg, inv)
        assert os.listdir(w.run_dir / "containers") == []


@pytest.mark.parametrize("root", ["/r/", "/r//x", "/r/./x", "./"])
def test_a_marker_keyed_by_the_root_as_given_sends_that_spelling_to_python(w, root):
    """A container marked under "/r/" by torpor before roots were normalized (its marker keyed
    by the bytes as given) and deleted under "/r/" after the upgrade: the front must still
    send its calls to Python, which removes that marker (test_runtime_markers.py)."""
    from torpor.runtime import markers
    old = w.run_dir / "containers" / f"{CID}@{markers.raw_key(root)}"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"roots": [root]}) + "\n")
    assert w.goes("--root", root, "delete", CID) == "python"
    assert "python (marker of an unnormalized root)" in w.debug("--root", root, "state", CID)
    assert w.goes("--root", "/elsewhere/", "delete", CID) == "runc"


def test_an_earlier_torpors_marker_sends_every_root_of_its_id_to_python(w):
    """A marker named by the id alone (torpor before markers had roots): the front cannot
    read which root it is of, so Python decides for every root."""
    w.mark_legacy(root="/r")
    assert w.goes("--root", "/r", "delete", CID) == "python"
    assert w.goes("--root", "/x", "kill", CID, "9") == "python"
    assert w.goes("delete", CID) == "python"
    assert "python (marker of an earlier torpor)" in w.debug("state", CID)
    assert w.goes("delete", "other") == "runc"


# ---- settings: the runtime and run_dir as torpor.config finds them ----------------------

def test_runtime_from_the_config_file(w, tmp_path):
    other = w.recorder("crun")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"# torpor\nagent = true\nlock_timeout_s = 10.0\n"
                   f"oci_runtime = '{other}'  # the real one\nrun_dir = \"{w.run_dir}\"\r\n")
    env = {"TORPOR_CONFIG": str(cfg), "TORPOR_OCI_RUNTIME": ""}   # empty: not set
    who, _ = w.call("state", CID, **env)
    assert who == "crun"
    w.mark()
    assert w.goes("state", CID, **env) == "python"    # run_dir from the file
    assert w.goes("state", CID, TORPOR_CONFIG=str(cfg)) == "python"
    assert w.call("list", TORPOR_CONFIG=str(cfg))[0] == "runc"   # the environment wins


def test_runtime_found_on_path(w):
    w.recorder("crun-x")
    who, _ = w.call("list", TORPOR_OCI_RUNTIME="crun-x", PATH=f"/nonexistent::{w.bin}")
    assert who == "crun-x"


@pytest.mark.parametrize("text", [
    "[engine]\noci_runtime = 'runc'\n",            # a table: not a key of torpor's
    "oci_runtime = \"\"\"\nrunc\"\"\"\n",          # multi-line string
    "oci_runtime = \"ru\\u006ec\"\n",              # an escape
    "oci_runtime = 'a'\noci_runtime = 'b'\n",      # twice: TOML refuses it
    "\"oci_runtime\" = 'runc'\n",                  # a quoted key
    "oci_runtime = 'runc' junk\n",
    "checksums = [\n true,\n]\n",
])
def test_a_config_file_the_front_cannot_read_for_sure_goes_to_python(w, tmp_path, text):
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    assert w.goes("list", TORPOR_CONFIG=str(cfg), TORPOR_OCI_RUNTIME="") == "python"


def test_unreadable_config_goes_to_python(w, tmp_path):
    assert w.goes("list", TORPOR_CONFIG=str(tmp_path)) == "python"       # a directory
    assert w.goes("list", TORPOR_CONFIG="") == "python"


@pytest.mark.parametrize("runtime", ["no-such-runtime", "/nonexistent/runc",
                                     "torpor-runtime", "SELF"])
def test_missing_or_looping_runtime_goes_to_python(w, runtime):
    if runtime == "torpor-runtime":
        w.recorder("torpor-runtime")
        runtime = str(w.bin / "torpor-runtime")
    if runtime == "SELF":
        (w.bin / "link").symlink_to(w.front)
        runtime = str(w.bin / "link")
    assert w.goes("list", TORPOR_OCI_RUNTIME=runtime) == "python"


def test_python_side_found_next_to_the_front(w, tmp_path):
    d = tmp_path / "venv-bin"
    d.mkdir()
    shutil.copy2(w.front, d / "torpor-runtime")
    (d / "torpor-runtime-py").symlink_to(w.py)
    link = tmp_path / "usr-local-bin-torpor-runtime"
    link.symlink_to(d / "torpor-runtime")       # /usr/local/bin links to the venv
    w.front = link
    env = {"TORPOR_RUNTIME_PY": ""}
    who, _ = w.call("checkpoint", CID, **env)
    assert who == "torpor-runtime-py"
    lines = [json.loads(x) for x in w.log.read_text().splitlines()]
    assert lines[0][1] == str(d / "torpor-runtime-py")   # argv[0]: its real place


def test_no_python_side_is_one_clear_line(w, tmp_path):
    out = subprocess.run([str(w.front), "checkpoint", CID],
                         env={**w.env, "TORPOR_RUNTIME_PY": str(tmp_path / "gone")},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert out.stderr.startswith("torpor-runtime: error: cannot run torpor-runtime-py")
    assert "No such file" in out.stderr and len(out.stderr.splitlines()) == 1
    assert not w.log.exists()
    out = subprocess.run([str(w.front), "checkpoint", CID],
                         env={**w.env, "TORPOR_RUNTIME_PY": "/" + "x" * 5000},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "File name too long" in out.stderr


def test_debug_says_where_and_why(w):
    out = subprocess.run([str(w.front), "delete", CID], env={**w.env, "TORPOR_DEBUG": "1"},
                         capture_output=True, text=True, timeout=30)
    assert "delete c0ffee0123456789: runc (no marker)" in out.stderr


# ---- behind the front, the real Python side: markers -----------------------------------

PY_SIDE = Path(sys.prefix) / "bin" / "torpor-runtime-py"


@pytest.fixture
def real(w, torpor_env) -> World:
    if not os.access(PY_SIDE, os.X_OK):
        pytest.skip(f"{PY_SIDE} is not installed (./test.sh installs it)")
    w.env.update(torpor_env)
    w.env["TORPOR_RUN_DIR"] = str(w.run_dir)
    w.env["TORPOR_RUNTIME_PY"] = str(PY_SIDE)
    return w


def gpu_spec(w: World) -> None:
    w.spec({"process": {"args": ["sh"], "env": ["NVIDIA_VISIBLE_DEVICES=0"]},
            "root": {"path": "rootfs"}, "linux": {"devices": []}})


def test_python_marks_a_gpu_container_at_create_and_forgets_it_at_delete(real):
    w = real
    gpu_spec(w)
    assert w.call("--root", "/r", "create", "--bundle", str(w.bundle), CID)[0] == "runc"
    marker = w.marker(root="/r")
    assert json.loads(marker.read_text()) == {"roots": ["/r"]}
    assert marker.stat().st_mode & 0o777 == 0o600
    assert marker.parent.stat().st_mode & 0o777 == 0o700
    # the marker sends the container's calls through Python, which passes them on
    assert w.goes("--root", "/r", "state", CID) == "runc"   # execs runc in the end, unchanged
    out = subprocess.run([str(w.front), "--root", "/r", "state", CID],
                         env={**w.env, "TORPOR_DEBUG": "1"}, capture_output=True, text=True)
    assert "state c0ffee0123456789: python (marker)" in out.stderr
    # a delete under another root (same id) leaves it; the container's own delete removes it
    assert w.call("--root", "/other", "delete", CID)[0] == "runc"
    assert marker.exists()
    assert w.call("--root", "/r", "delete", "--force", CID)[0] == "runc"
    assert not marker.exists()
    assert w.route("--root", "/r", "delete", CID) == "runc"   # straight there now


def test_the_same_id_under_two_roots_keeps_each_containers_marker(real):
    """One id, GPU containers under two roots (containerd namespaces; podman and ctr): the
    second's marker must not replace the first's, nor its delete take the first's away,
    else the first's delete goes straight to runc and leaves its agent directory and
    torpord's record behind."""
    w = real
    gpu_spec(w)
    w.call("--root", "/a", "create", "--bundle", str(w.bundle), CID)
    w.call("--root", "/b", "create", "--bundle", str(w.bundle), CID)
    assert w.call("--root", "/b", "delete", CID)[0] == "runc"
    assert w.route("--root", "/a", "state", CID) == "python"
    assert w.route("--root", "/b", "state", CID) == "runc"
    assert not w.marker(root="/b").exists()
    assert json.loads(w.marker(root="/a").read_text()) == {"roots": ["/a"]}
    assert "delete c0ffee0123456789: python (marker)" in w.debug("--root", "/a", "delete",
                                                                 CID)
    assert not w.marker(root="/a").exists()     # the delete just above went through Python


def test_a_cpu_container_of_a_gpu_containers_id_under_another_root_stays_with_runc(real):
    w = real
    gpu_spec(w)
    w.call("--root", "/a", "create", "--bundle", str(w.bundle), CID)
    w.spec({"process": {"args": ["sh"]}, "root": {"path": "rootfs"}})
    assert w.route("--root", "/b", "create", "--bundle", str(w.bundle), CID) == "runc"
    for argv in (["start", CID], ["kill", CID, "9"], ["delete", CID]):
        assert w.route("--root", "/b", *argv) == "runc", argv
        w.call("--root", "/b", *argv)
    assert w.route("--root", "/a", "state", CID) == "python"
    assert w.marker(root="/a").exists()
    assert not w.marker(root="/b").exists()


def test_a_container_marked_before_the_upgrade_is_still_torpors(real):
    """A marker an earlier torpor wrote (named by the id alone, JSON naming its root): the
    container's calls still go through Python, another root's delete leaves the marker, its
    own root's delete removes it; a new create of that (root, id) replaces it."""
    w = real
    old = w.mark_legacy(root="/r")
    assert w.route("--root", "/other", "delete", CID) == "python"
    assert w.call("--root", "/other", "delete", CID)[0] == "runc"   # in the end
    assert old.exists()
    assert w.route("--root", "/r", "delete", CID) == "python"
    assert w.call("--root", "/r", "delete", CID)[0] == "runc"
    assert not old.exists()
    assert w.route("--root", "/r", "delete", CID) == "runc"
    w.mark_legacy(root="/r")
    gpu_spec(w)
    w.call("--root", "/r", "create", "--bundle", str(w.bundle), CID)
    assert not old.exists()
    assert json.loads(w.marker(root="/r").read_text()) == {"roots": ["/r"]}


def test_python_treats_a_gpu_containers_run_as_its_create(real):
    """The front hands `run` of a GPU spec to Python as it does `create`: the spec gets the
    same marker (and hooks), then runc runs it with the argv unchanged."""
    w = real
    gpu_spec(w)
    assert w.call("--root", "/r", "run", "-d", "--bundle", str(w.bundle), CID)[0] == "runc"
    assert json.loads(w.marker(root="/r").read_text()) == {"roots": ["/r"]}


def test_python_leaves_no_marker_for_a_container_without_gpus(real):
    w = real
    w.spec({"process": {"args": ["sh"], "env": ["NVIDIA_VISIBLE_DEVICES=void"]},
            "annotations": {"org.torpor.agent": "on"}})
    assert w.call("create", "--bundle", str(w.bundle), CID)[0] == "runc"   # via Python
    assert not w.marker().exists()


def runc_answering_state(w: World, state: str) -> str:
    """A runc that records every call but `state`, which it answers: "gone" as runc does for
    an id it does not know (exit 1), "running" with its state JSON."""
    p = w.bin / f"runc-{state}"
    answer = ("echo 'time=\"x\" level=error msg=\"container does not exist\"' >&2; exit 1"
              if state == "gone" else
              f"echo '{json.dumps({'id': CID, 'status': state, 'pid': 1})}'; exit 0")
    p.write_text(f"#!/bin/sh\nfor a; do [ \"$a\" = state ] && {{ {answer}; }}; done\n"
                 f"exec {w.runc} \"$@\"\n")
    p.chmod(0o755)
    return str(p)


def test_python_removes_a_stale_marker_of_the_same_root_at_create(real):
    w = real
    w.mark()     # root "": an earlier container of this id, gone without a delete
    w.spec({"annotations": {"org.torpor.hooks": "off"}})
    w.call("create", "--bundle", str(w.bundle), CID,
           TORPOR_OCI_RUNTIME=runc_answering_state(w, "gone"))
    assert not w.marker().exists()


def test_a_create_runc_will_refuse_leaves_the_live_containers_marker(real):
    """A CPU create of an id a GPU container still runs under (runc refuses it) must not take
    that container's marker: its delete would then go straight to runc, leaving its agent
    directory and torpord's record behind."""
    w = real
    w.mark()
    w.spec({"annotations": {"org.torpor.hooks": "off"}})
    w.call("create", "--bundle", str(w.bundle), CID,
           TORPOR_OCI_RUNTIME=runc_answering_state(w, "running"))
    assert w.marker().exists()


@pytest.mark.parametrize("kind", ["link-to-fifo", "fifo", "link-to-marker"])
def test_a_marker_that_is_no_regular_file_is_not_followed_nor_waited_on(real, tmp_path, kind):
    """Only torpor-runtime writes markers (0600 in a 0700 directory): anything else there is
    removed at delete without being read through (a link) or waited on (a FIFO would hang
    the engine's delete for good)."""
    w = real
    gpu_spec(w)
    w.call("create", "--bundle", str(w.bundle), CID)
    marker = w.marker()
    marker.unlink()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    if kind == "fifo":
        os.mkfifo(marker)
    elif kind == "link-to-fifo":
        marker.symlink_to(fifo)
    else:   # a link to what reads as another root's marker: not read, not ours
        (tmp_path / "elsewhere").write_text('{"root": "/other"}\n')
        marker.symlink_to(tmp_path / "elsewhere")
    assert w.call("delete", CID)[0] == "runc"    # w.call: at most 30 s
    assert not os.path.lexists(marker)
    assert fifo.exists() and (kind != "link-to-marker" or (tmp_path / "elsewhere").exists())


def test_no_marker_when_the_delete_fails(real, tmp_path):
    w = real
    gpu_spec(w)
    w.call("create", "--bundle", str(w.bundle), CID)
    failing = w.bin / "runc-fails"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    out = subprocess.run([str(w.front), "delete", CID],
                         env={**w.env, "TORPOR_OCI_RUNTIME": str(failing)})
    assert out.returncode == 1
    assert w.marker().exists()   # the container is still there


def test_marker_and_agent_directory_go_when_runc_no_longer_knows_the_container(real):
    """runc deletes its own state of a container it checkpointed without --leave-running;
    containerd's shim then deletes it without --force and takes runc's "container does not
    exist" as done: the marker and the agent's socket directory must go all the same (a
    directory left to the container's uid made a later restore under that id fail)."""
    w = real
    gpu_spec(w)
    w.call("--root", "/r", "create", "--bundle", str(w.bundle), CID)
    agents = w.run_dir / "agents" / CID
    agents.mkdir(parents=True)
    gone = w.bin / "runc-gone"
    gone.write_text("#!/bin/sh\necho 'time=\"x\" level=error msg=\"container does not "
                    "exist\"' >&2\nexit 1\n")
    gone.chmod(0o755)
    out = subprocess.run([str(w.front), "--root", "/r", "delete", CID],
                         env={**w.env, "TORPOR_OCI_RUNTIME": str(gone)}, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 1 and "does not exist" in out.stderr   # runc's answer, as is
    assert not w.marker(root="/r").exists()
    assert not agents.exists()


def test_installed_venv_has_the_front_and_the_python_side():
    front = Path(sys.prefix) / "bin" / "torpor-runtime"
    if not front.exists():
        pytest.skip("torpor is not installed in this venv (./test.sh installs it)")
    assert front.read_bytes()[:4] == b"\x7fELF"
    assert os.access(PY_SIDE, os.X_OK)


# ---- any argv: one of the two, argv unchanged, never a crash -----------------------------

TOKENS = ["--root", "/r", "--root=/r", "-root", "--log", "--log-format=json", "--debug",
          "--systemd-cgroup", "--bogus", "-", "--", "---x", "-=", "create", "run", "delete",
          "state", "exec", "ps", "kill", "checkpoint", "restore", "list", "help", "--bundle",
          "-b", "--bundle=", "--force", "-f", "--help", "-h", "--version", CID, "KILL", "",
          "a" * 300, "x/y", "..", "--pid-file", "-e=A=1"]


def test_any_argv_goes_to_runc_or_python_unchanged(w):
    from hypothesis import HealthCheck, given, settings, strategies as st

    w.mark()
    chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")

    @settings(max_examples=int(os.environ.get("TORPOR_FUZZ_EXAMPLES", "60")), deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.sampled_from(TOKENS) | st.text(chars, max_size=12), max_size=8))
    def check(argv):
        who, _ = w.call(*argv, cwd=w.bundle)   # asserts rc 0 and the argv unchanged
        assert who in ("runc", "torpor-runtime-py")

    check()


# runc's own reading, for the property below: urfave/cli v1 over Go's flag package (runc 1.x)
RUNC_VALUES = {"create": {"bundle", "b", "pid-file"}, "run": {"bundle", "b", "pid-file"},
               "delete": set(), "state": set(), "kill": set(), "exec": {"env", "e", "user"}}
RUNC_FLAGS = {"create": {"no-pivot"}, "run": {"detach", "d", "no-pivot"},
              "delete": {"force", "f"}, "state": set(), "kill": {"all", "a"}, "exec": {"tty"}}
BOOL = {**dict.fromkeys(["1", "t", "T", "true", "TRUE", "True"], True),
        **dict.fromkeys(["0", "f", "F", "false", "FALSE", "False"], False)}


def urfave_reorder(names: set[str], args: list[str], newer: bool) -> list[str]:
    """reorderArgs of urfave/cli v1.22: options (and the argument after an option written
    without "=") before the rest; "--" and what follows stay last (newer: "--" first)."""
    def is_opt(a):
        name = a[2:] if a.startswith("--") else a
        name = name[1:] if name.startswith("-") else name
        return a.startswith("-") and a not in ("-", "--") and name.split("=")[0] in names
    moved: list[str] = []
    rest: list[str] = []
    may_be_value = False
    for i, a in enumerate(args):
        if a == "--":
            rest = ["--", *rest, *args[i + 1:]] if newer else [*rest, *args[i:]]
            break
        if may_be_value and (not is_opt(a) if newer else not a.startswith("-")):
            moved.append(a)
            may_be_value = False
        elif is_opt(a):
            moved.append(a)
            may_be_value = "=" not in a
        else:
            rest.append(a)
    return moved + rest


def go_flags(values: set[str], flags: set[str], args: list[str]):
    """Go's flag.Parse: (options, positionals), or None where it fails."""
    opts: dict[str, object] = {}
    i = 0
    while i < len(args) and len(args[i]) > 1 and args[i][0] == "-":
        if args[i] == "--":
            return opts, args[i + 1:]
        name, eq, value = args[i][2 if args[i][1] == "-" else 1:].partition("=")
        if not name or name[0] in "-=":
            return None
        if name in flags:
            if eq and value not in BOOL:
                return None
            opts[name] = BOOL[value] if eq else True
        elif name in values:
            if not eq:
                if i + 1 >= len(args):
                    return None
                i += 1
                value = args[i]
            opts[name] = value
        else:
            return None
        i += 1
    return opts, args[i:]


def runc_runs(argv: list[str], newer: bool) -> tuple[str, str, str] | None:
    """(command, container id, bundle) that runc would act on, None for help or an error."""
    g = go_flags({"root", "log"}, {"debug", "help", "h", "version", "v"}, argv)
    if not g or any(g[0].get(k) is True for k in ("help", "h", "version", "v")) or not g[1]:
        return None
    command, args = g[1][0], g[1][1:]
    if command not in RUNC_VALUES:
        return None
    values, flags = RUNC_VALUES[command], RUNC_FLAGS[command] | {"help", "h"}
    if command != "exec":
        args = urfave_reorder(values | flags, args, newer)
    c = go_flags(values, flags, args)
    if not c or c[0].get("help") is True or c[0].get("h") is True or not c[1]:
        return None
    opts, pos = c
    if command == "kill" and (len(pos) > 2 or len(pos) == 2 and pos[1].startswith("-")):
        return None     # no signal runc reads
    if command not in ("kill", "exec") and len(pos) != 1 or "b" in opts and "bundle" in opts:
        return None
    return command, pos[0], str(opts.get("bundle", opts.get("b", "")))


def test_what_runc_would_run_for_a_gpu_spec_or_a_marked_container_goes_to_python(w):
    """The safety property, against a model of runc's own command line: whatever argv the
    front execs runc for, runc neither creates a GPU spec (bundle gpu/, or the current
    directory) nor acts on the marked container G."""
    from hypothesis import HealthCheck, example, given, settings, strategies as st

    w.mark("G")
    w.mark("G", "/r")      # under each root the argv may name: markers are per root
    for name, spec in (("gpu", '{"linux": {"devices": [{"path": "/dev/nvidia0"}]}}'),
                       ("cpu", "{}")):
        (w.bundle / name).mkdir()
        (w.bundle / name / "config.json").write_text(spec)
    w.spec({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}})     # the current directory
    env = {**w.env, "TORPOR_OCI_RUNTIME": "/bin/true", "TORPOR_RUNTIME_PY": "/bin/false"}
    helps = ["--help", "-h", "--help=false", "-h=0", "--help=true", "-v=f", "--", "-"]
    globals_ = st.lists(st.sampled_from(["--root", "/r", "--debug", *helps]), max_size=2)
    commands = st.sampled_from(["create", "run", "delete", "state", "kill", "exec"])
    rest = st.lists(st.sampled_from([
        "G", "C", "KILL", "gpu", "cpu", "-b", "--bundle", "--bundle=cpu", "-b=gpu",
        "--no-pivot", "-d", "--force", "-f", "--all", "-a", "-e", "A=1", "--tty", "--pid-file",
        "/p", *helps]), max_size=5)

    @settings(max_examples=int(os.environ.get("TORPOR_FUZZ_EXAMPLES", "60")) * 10,
              deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(globals_, commands, rest)
    @example([], "create", ["--help=false", "G"])       # runc: no help, a create
    @example(["-h=0"], "run", ["-d", "C"])
    @example([], "kill", ["KILL", "--all", "G"])        # runc: kill G with KILL
    def check(g, command, args):
        argv = [*g, command, *args]
        out = subprocess.run([str(w.front), *argv], env=env, cwd=w.bundle, timeout=30)
        if out.returncode != 0:
            return      # Python's to decide
        for newer in (False, True):
            acts = runc_runs(argv, newer)
            if acts is None:
                continue
            cmd, cid, bundle = acts
            if cmd in ("create", "run"):
                assert bundle not in ("", "gpu"), (argv, acts)
            else:
                assert cid != "G", (argv, acts)

    check()


# ---- the Python side in process: a restored GPU container is marked too -----------------

from tests.unit.test_runtime_flows import (  # noqa: E402,F401  (world: a fixture)
    CID as FLOW_CID, GPU, checkpoint_argv, world, write_spec)


def test_python_marks_a_restored_gpu_container(world, monkeypatch, tmp_path, cfg):
    from torpor.flows import container
    from torpor.runtime import main as rt_main, markers
    from torpor.runtime import restore as rt_restore

    write_spec(world["bundle"], gpu=True)
    assert rt_main.main(checkpoint_argv(world["images"])) == 0
    marker = markers.path(cfg, FLOW_CID, "/r")
    assert not marker.parent.exists()     # the checkpoint marks nothing (create does)
    (world["runc"].root / "restore.pid").write_text(str(world["pid"]))
    monkeypatch.setattr(rt_restore.container, "place",
                        lambda cfg, m, b: container.Placement({GPU: GPU}))
    argv = ["--root", "/r", "restore", "--image-path", str(world["images"]), "--bundle",
            str(world["bundle"]), "--pid-file", str(tmp_path / "pid"), "--detach", FLOW_CID]
    assert rt_main.main(argv) == 0
    assert json.loads(marker.read_text()) == {"roots": ["/r"]}
