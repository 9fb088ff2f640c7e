from pathlib import Path

import pytest

from torpor import config
from torpor.errors import UsageError
from tests import hostile


def test_defaults_file_and_env(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('lock_timeout_s = 3\ncriu = "/opt/criu"\nchecksums = false\n')
    cfg = config.load(f, env={"TORPOR_STATE_DIR": str(tmp_path / "s")})
    assert cfg.lock_timeout_s == 3.0 and cfg.criu == "/opt/criu" and cfg.checksums is False
    assert cfg.state_dir == tmp_path / "s" and cfg.journal_dir == tmp_path / "s" / "journal"
    absent = {"TORPOR_CONFIG": str(tmp_path / "absent.toml")}   # the default file may be missing
    assert config.load(env=absent).state_dir == Path("/var/lib/torpor")


@pytest.mark.parametrize("text,match", [("nope = 1", "unknown key 'nope'"),
                                        ("checksums = 1", "true or false"),
                                        ("lock_timeout_s = 'x'", "bad setting"),
                                        ("lock_timeout_s = -1", "between 0 and 3600"),
                                        ("lock_timeout_s = inf", "between 0 and 3600"),
                                        ("[broken", "cannot read config")])
def test_bad_config_is_one_clear_error(tmp_path, text, match):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(UsageError, match=match):
        config.load(f, env={})


@pytest.mark.parametrize("plant,match", [
    ("fifo", "not a regular file"), ("dir", "not a regular file"),
    ("dev-zero", "not a regular file"), ("huge", "larger than 1048576 bytes"),
    ("latin-1", "cannot read config"), ("deep", "cannot read config")])
def test_a_config_that_is_no_regular_small_file_is_refused_without_hanging(tmp_path, plant,
                                                                           match):
    """`torpor --config /dev/zero ps` read forever: the config must be a regular file of at
    most MAX_CONFIG bytes (a link to one is fine)."""
    import signal
    f = tmp_path / "c.toml"
    if plant in hostile.KINDS:
        hostile.plant(f, plant, config.MAX_CONFIG)
    elif plant == "latin-1":
        f.write_bytes(b"# caf\xe9\n")
    else:
        f.write_text("a = " + "[" * 200000 + "]" * 200000)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("hung")))
    signal.alarm(5)
    try:
        with pytest.raises(UsageError, match=match) as e:
            config.load(f, env={})
    finally:
        signal.alarm(0)
    assert "\n" not in str(e.value)
    link = tmp_path / "link.toml"
    (tmp_path / "real.toml").write_text("checksums = false\n")
    link.symlink_to(tmp_path / "real.toml")
    assert config.load(link, env={}).checksums is False


def test_store_dir_default_file_and_env(tmp_path):
    absent = {"TORPOR_CONFIG": str(tmp_path / "absent.toml")}
    assert config.load(env=absent).store_dir == Path("/var/lib/torpor/store")
    f = tmp_path / "c.toml"
    f.write_text('store_dir = "/srv/torpor-store"\n')
    assert config.load(f, env={}).store_dir == Path("/srv/torpor-store")
    env = {"TORPOR_STORE_DIR": str(tmp_path / "st")}
    assert config.load(f, env=env).store_dir == tmp_path / "st"


def test_every_key_is_documented_in_the_packaged_config():
    """packaging/config.toml documents every key (docs/operations.md says so): a new one must be
    added."""
    import dataclasses
    import re
    from pathlib import Path

    from torpor.config import Config
    text = (Path(__file__).resolve().parents[2] / "packaging" / "config.toml").read_text()
    missing = [f.name for f in dataclasses.fields(Config)
               if not re.search(rf"^#?{f.name} = ", text, re.M)]
    assert not missing, f"not in packaging/config.toml: {missing}"


def test_every_key_is_named_in_the_operations_doc():
    """docs/operations.md's table names every key, so a reader finds it from the docs."""
    import dataclasses
    from pathlib import Path

    from torpor.config import Config
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    missing = [f.name for f in dataclasses.fields(Config) if f"`{f.name}`" not in text]
    assert not missing, f"not in docs/operations.md: {missing}"


@pytest.mark.parametrize("line,says", [
    ("suspend_dir = 5", "bad setting suspend_dir = 5: expected a string (a path)"),
    ("oci_runtime = 7", "bad setting oci_runtime = 7: expected a string"),
    ("lock_timeout_s = true", "bad setting lock_timeout_s = True: expected a number"),
    ("agent_files = 2.5", "bad setting agent_files = 2.5: expected a whole number"),
    ("suspend_tmpfs = 1", "bad setting suspend_tmpfs = 1: expected true or false"),
])
def test_a_setting_of_the_wrong_type_is_named_with_what_it_expects(tmp_path, line, says):
    path = tmp_path / "c.toml"
    path.write_text(line + "\n")
    with pytest.raises(UsageError) as e:
        config.load(path, env={})
    assert str(e.value) == says


def test_a_user_s_default_suspend_dir_is_their_own_not_the_one_root_takes_back(monkeypatch):
    none = {"TORPOR_CONFIG": "/nonexistent.toml"}
    monkeypatch.setattr(config.os, "geteuid", lambda: 1000)
    assert config.load(env=none).suspend_dir == Path("/dev/shm/torpor-1000")
    assert config.load(env={**none, "TORPOR_SUSPEND_DIR": "/x"}).suspend_dir == Path("/x")
    monkeypatch.setattr(config.os, "geteuid", lambda: 0)
    assert config.load(env=none).suspend_dir == Path("/dev/shm/torpor")


@pytest.mark.parametrize("text,match", [
    ('state_dir = "rel/dir"', "state_dir = 'rel/dir': expected an absolute path"),
    ('store_dir = ""', "store_dir = '': expected an absolute path"),
    ("socket_owner_uid = -1", "socket_owner_uid must be a uid"),
    ("socket_owner_uid = 1099511627776", "socket_owner_uid must be a uid")])
def test_a_relative_directory_or_no_uid_is_refused(tmp_path, text, match):
    """A relative state_dir put the journal and locks wherever torpor ran (and every dump
    failed); socket_owner_uid 2**40 crashed torpord at start (OverflowError), -1 was taken."""
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(UsageError, match=match):
        config.load(f, env={})
    with pytest.raises(UsageError, match="expected an absolute path"):
        config.load(env={"TORPOR_CONFIG": str(tmp_path / "none"), "TORPOR_STATE_DIR": "rel"})


@pytest.mark.parametrize("word,value", [
    ("on", True), ("OFF", False), ("Yes", True), ("no", False), ("1", True), ("0", False),
    ("TRUE", True), ("false", False),
])
def test_an_on_off_variable_takes_the_agents_words(tmp_path, word, value):
    """TORPOR_LEAVE_RUNNING_DRAIN=off as TORPOR_AGENT_VMM_EXPORT=off: the same words for both,
    in any case."""
    env = {"TORPOR_CONFIG": str(tmp_path / "absent.toml")}
    for var, key in [("TORPOR_LEAVE_RUNNING_DRAIN", "leave_running_drain"),
                     ("TORPOR_TCP_ESTABLISHED", "tcp_established")]:
        assert getattr(config.load(env={**env, var: word}), key) is value


@pytest.mark.parametrize("word", ["maybe", "enabled", "2", " on"])
def test_an_on_off_variable_with_another_word_is_one_clear_error(tmp_path, word):
    env = {"TORPOR_CONFIG": str(tmp_path / "absent.toml"), "TORPOR_LEAVE_RUNNING_DRAIN": word}
    with pytest.raises(UsageError) as e:
        config.load(env=env)
    assert str(e.value) == (f"bad setting TORPOR_LEAVE_RUNNING_DRAIN={word!r}: expected true "
                            "or false (also on/off, yes/no, 1/0)")
