"""Job config: TOML, env and --set precedence, and clear errors."""

from __future__ import annotations

import pytest

from edgestream.job.config import ConfigError, load_config


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_scadles_setup():
    cfg = load_config(env={})
    assert cfg.devices.count == 10 and cfg.devices.rates_hz[:3] == [92, 38, 62]
    assert cfg.devices.device_ids()[0] == "dev00"


def test_precedence_file_then_env_then_flags(tmp_path):
    path = write(tmp_path, '[buffer]\npolicy = "truncate"\ncapacity = 10\n[batcher]\nwindow_s = 2.0\n')
    cfg = load_config(path, ["buffer.capacity=30"], env={"EDGESTREAM__BUFFER__CAPACITY": "20",
                                                        "EDGESTREAM__BATCHER__WINDOW_S": "0.5"})
    assert cfg.buffer.policy == "truncate"
    assert cfg.buffer.capacity == 30
    assert cfg.batcher.window_s == 0.5


def test_lists_from_flags_and_round_robin_assignment():
    cfg = load_config(overrides=["devices.count=5", "devices.rates_hz=10,20", "workers.count=2"], env={})
    assert cfg.devices.rate_of(3) == 20
    assert cfg.devices_of("w0") == ["dev00", "dev02", "dev04"]
    assert cfg.devices_of("w1") == ["dev01", "dev03"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("buffer.policy=lossy", "buffer.policy='lossy' is not one of"),
        ("buffer.nope=1", "unknown key 'buffer.nope'"),
        ("bogus.key=1", "unknown config section 'bogus'"),
        ("buffer.capacity=ten", "not a valid int"),
        ("workers.count=20", "exceeds devices.count"),
        ("devices.ids=a b", "devices.ids lists 1 ids"),
        ("justtext", "section.key=value"),
        ("workers.slowdown=1,0.5", "workers.slowdown factors must be >= 1"),
        ("train.injection_alpha=1.5", "train.injection_alpha must be in"),
    ],
)
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override], env={})


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("EDGESTREAM__BUFFER__CAPACTY", "20", "unknown key 'buffer.capacty'"),
        ("EDGESTREAM__BUFER__CAPACITY", "20", "unknown config section 'bufer'"),
        ("EDGESTREAM__BUFFER__CAPACITY", "ten", "not a valid int"),
    ],
)
def test_a_bad_environment_variable_is_named(name, value, message):
    with pytest.raises(ConfigError) as caught:
        load_config(env={name: value})
    text = str(caught.value)
    assert text.startswith(f"environment variable {name}: ")
    assert message in text
    assert f"unset {name}" in text


def test_a_bad_override_is_not_blamed_on_the_environment():
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=["buffer.capacty=20"], env={"EDGESTREAM__BUFFER__CAPACITY": "20"})
    assert "environment" not in str(caught.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml", env={})
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[job\n"), env={})


def test_slowdown_cycles_over_workers():
    cfg = load_config(overrides=["workers.count=3", "workers.slowdown=1,4"], env={})
    assert [cfg.workers.slowdown_of(i) for i in range(3)] == [1.0, 4.0, 1.0]
    assert load_config(env={}).workers.slowdown_of(5) == 1.0
