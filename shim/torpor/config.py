"""Settings: built-in defaults < /etc/torpor/config.toml (or $TORPOR_CONFIG) < environment.

The TOML file is optional; where there is one it must be a regular file of at most
MAX_CONFIG bytes. Every key is documented in packaging/config.toml, which is also
what ./install.sh puts in /etc/torpor/. Environment variables exist for tests and one-off
runs: TORPOR_STATE_DIR, TORPOR_RUN_DIR, TORPOR_LIBCUDA, TORPOR_CRIU, TORPOR_LOCK_TIMEOUT,
TORPOR_OCI_RUNTIME, TORPOR_DEVICE_MAP, TORPOR_SUSPEND_DIR, TORPOR_SUSPEND_TMPFS,
TORPOR_STORE_DIR, TORPOR_STORE_STREAM, TORPOR_TCP_ESTABLISHED, TORPOR_LEAVE_RUNNING_DRAIN,
TORPOR_REGISTRY_AUTH_FILE, TORPOR_REGISTRY_HOSTS_DIR, TORPOR_RESTORE_FETCH_TIMEOUT. The
on/off ones take true/false, on/off, yes/no or 1/0, in any case (as the agent's own
TORPOR_AGENT_VMM_EXPORT); anything else is a UsageError.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

try:
    import tomllib  # Python >= 3.11: this *is* tomli, merged into the standard library
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from .errors import UsageError
from .files import read_small_file

DEFAULT_CONFIG_PATH = Path("/etc/torpor/config.toml")
MAX_CONFIG = 1 << 20   # bytes: packaging/config.toml, every key documented, is 10 KiB


@dataclasses.dataclass(frozen=True)
class Config:
    state_dir: Path = Path("/var/lib/torpor")   # journal and per-process locks (0700)
    run_dir: Path = Path("/run/torpor")         # torpord's socket
    libcuda: str = "libcuda.so.1"               # driver library holding cuCheckpointProcess*
    criu: str = ""                              # CRIU binary; empty: search PATH and /usr/local/sbin
    copier: str = ""                            # torpor-copier; empty: beside the agent library
    lock_timeout_s: float = 10.0                # how long a driver lock may wait for CUDA calls in flight
    checksums: bool = True                      # sha256 of every image file in torpor.json
    socket_owner_uid: int = 0                   # besides root, the one uid torpord answers
    oci_runtime: str = "runc"                   # what torpor-runtime wraps: runc or crun (name or path)
    device_map: str = ""                        # restores of containers: OLD_UUID=NEW_UUID,... (wins over placement)
    agent: bool = True                          # torpor-runtime preloads the agent into GPU containers
    use_agent: bool = True                      # checkpoints move GPU memory through a program's agent
    agent_files: int = 0                        # data files per program (0: one per CPU, 1-16)
    agent_timeout_s: float = 600.0              # how long one agent prepare/resume may take
    suspend_dir: Path = Path("/dev/shm/torpor")  # suspended programs' GPU data (host memory)
    suspend_in_process: bool = False            # a suspend keeps its agent's data in the program
    suspend_tmpfs: bool = True                  # mount a huge-page tmpfs on an empty suspend_dir
    store_dir: Path = Path("/var/lib/torpor/store")  # the deduplicating image store (0700)
    store_containers: bool = False              # torpor-runtime packs checkpoints into the store
    store_stream: bool = True                   # agents stream GPU data into and out of the store
    tcp_established: bool = False               # bare checkpoints keep established TCP connections
    leave_running_staging: bool = True          # --leave-running: agents' data staged in suspend_dir
    writeout_rate_mbps: float = 0.0             # ... and written out at most this fast (0: no limit)
    leave_running_drain: bool = True            # --leave-running: held memory copied beside the dump

    # torpor-runtime fetching a checkpoint image's chunks at restore (registry/chunks.py)
    registry_auth_file: str = ""                # read first: the node's registry credentials
    registry_hosts_dir: Path = Path("/etc/containerd/certs.d")  # containerd's config_path (TLS)
    restore_fetch_timeout_s: float = 90.0       # within the kubelet's 2 min; 0: never fetch

    @property
    def journal_dir(self) -> Path:
        return self.state_dir / "journal"

    @property
    def locks_dir(self) -> Path:
        return self.state_dir / "locks"

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "torpord.sock"


_ENV = {
    "TORPOR_STATE_DIR": ("state_dir", Path),
    "TORPOR_RUN_DIR": ("run_dir", Path),
    "TORPOR_LIBCUDA": ("libcuda", str),
    "TORPOR_CRIU": ("criu", str),
    "TORPOR_LOCK_TIMEOUT": ("lock_timeout_s", float),
    "TORPOR_OCI_RUNTIME": ("oci_runtime", str),
    "TORPOR_DEVICE_MAP": ("device_map", str),
    "TORPOR_SUSPEND_DIR": ("suspend_dir", Path),
    "TORPOR_SUSPEND_TMPFS": ("suspend_tmpfs", bool),
    "TORPOR_STORE_DIR": ("store_dir", Path),
    "TORPOR_STORE_STREAM": ("store_stream", bool),
    "TORPOR_TCP_ESTABLISHED": ("tcp_established", bool),
    "TORPOR_LEAVE_RUNNING_DRAIN": ("leave_running_drain", bool),
    "TORPOR_REGISTRY_AUTH_FILE": ("registry_auth_file", str),
    "TORPOR_REGISTRY_HOSTS_DIR": ("registry_hosts_dir", Path),
    "TORPOR_RESTORE_FETCH_TIMEOUT": ("restore_fetch_timeout_s", float),
}
# an environment variable's on and off, in any case: the words the agent takes for its own
# (TORPOR_AGENT_VMM_EXPORT); the file's are TOML's true and false
_BOOL_WORDS = {"true": True, "on": True, "yes": True, "1": True,
               "false": False, "off": False, "no": False, "0": False}
BOOL_WORDS_SAID = "true or false (also on/off, yes/no, 1/0)"


def _read(path: Path) -> bytes:
    """The config file's bytes (files.read_small_file: a regular file of at most MAX_CONFIG
    bytes, never waited on), else one UsageError."""
    try:
        return read_small_file(path, MAX_CONFIG)
    except OSError as e:
        raise UsageError(f"cannot read config {path}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"config {path} is {e}"
                         + (": not a config" if "larger" in str(e) else "")) from None


def _convert(kind: type, value: object) -> object:
    """A setting's value (from TOML, or a string from the environment) as its field's type;
    TypeError or ValueError saying what was expected."""
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError("expected true or false")
        return value
    if issubclass(kind, Path) or kind is str:
        if not isinstance(value, str):
            raise TypeError("expected a string" + (" (a path)" if kind is not str else ""))
        if kind is str:
            return value
        if not Path(value).is_absolute():   # "" too: Path("") is the current directory
            # a relative state_dir puts the journal and locks wherever torpor is run from:
            # two torpors in two directories would not see each other's locks
            raise ValueError("expected an absolute path")
        return Path(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError("expected a number")
    if kind is int and isinstance(value, float):
        raise ValueError("expected a whole number")
    return kind(value)


def load(path: Path | None = None, env: dict[str, str] | None = None) -> Config:
    """Read the config file and the environment; bad values are one UsageError. The file
    ($TORPOR_CONFIG or the default) may be missing; one named on the command line (path)
    must exist."""
    env = os.environ if env is None else env
    explicit = path is not None
    path = path or Path(env.get("TORPOR_CONFIG", DEFAULT_CONFIG_PATH))
    values: dict[str, object] = {}
    fields = {f.name: f for f in dataclasses.fields(Config)}
    if explicit and not path.exists():
        raise UsageError(f"config {path} does not exist")
    if path.exists():
        try:
            raw = tomllib.loads(_read(path).decode())
        except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
            raise UsageError(f"cannot read config {path}: {e}") from e
        for key, value in raw.items():
            if key not in fields:
                raise UsageError(f"config {path}: unknown key '{key}' (known: {', '.join(fields)})")
            values[key] = value
    for var, (key, conv) in _ENV.items():
        if var in env and env[var] != "":
            if conv is bool and env[var].lower() not in _BOOL_WORDS:
                shown = repr(env[var])
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise UsageError(f"bad setting {var}={shown}: expected {BOOL_WORDS_SAID}")
            values[key] = _BOOL_WORDS[env[var].lower()] if conv is bool else env[var]
    for key, value in list(values.items()):
        try:
            values[key] = _convert(type(getattr(Config, key)), value)
        except (TypeError, ValueError) as e:
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise UsageError(f"bad setting {key} = {shown}: {e}") from None
    if "suspend_dir" not in values and os.geteuid() != 0:
        # a user's own: root takes /dev/shm/torpor back from any user who has it
        # (files.reclaim_shared_name), their suspended programs' data with it
        values["suspend_dir"] = Path(f"{Config.suspend_dir}-{os.geteuid()}")
    cfg = Config(**values)  # type: ignore[arg-type]
    if not math.isfinite(cfg.lock_timeout_s) or not 0 < cfg.lock_timeout_s <= 3600:
        raise UsageError("lock_timeout_s must be a number of seconds between 0 and 3600")
    if not math.isfinite(cfg.agent_timeout_s) or not 0 < cfg.agent_timeout_s <= 86400:
        raise UsageError("agent_timeout_s must be a number of seconds between 0 and 86400")
    if not math.isfinite(cfg.writeout_rate_mbps) or cfg.writeout_rate_mbps < 0:
        raise UsageError("writeout_rate_mbps must be 0 (no limit) or a positive number of MB/s")
    if not math.isfinite(cfg.restore_fetch_timeout_s) or not 0 <= cfg.restore_fetch_timeout_s \
            <= 3600:
        raise UsageError("restore_fetch_timeout_s must be 0 (never fetch) to 3600 seconds")
    if not 0 <= cfg.socket_owner_uid < 0xFFFFFFFF:   # (uid_t)-1 is no uid: "unchanged"
        raise UsageError("socket_owner_uid must be a uid, 0 to 4294967294")
    if not 0 <= cfg.agent_files <= 16:
        raise UsageError("agent_files must be 0 (automatic) to 16")
    return cfg
