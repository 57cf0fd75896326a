"""The systemd units of deploy/systemd/: systemd's own checks (``systemd-analyze verify`` and
``security --offline``) on the installed layout, the properties the service contract needs
(restart, watchdog, stop timeout above the shutdown grace, limits, sandbox), and their
command lines against the CLI's parser. Running the command lines:
tests/integration/test_systemd_exec.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edgestream.job.config import ServiceSection, load_config
from edgestream.pipeline.exits import EXIT_CONFIG, EXIT_NO_CHECKPOINT
from tests.unit.deploy.unitfile import (
    INSTALLED_EDGESTREAM,
    UNIT_DIR,
    UNITS,
    exec_argv,
    expand_specifiers,
    parse_assignments,
    parse_unit,
    read_environment_file,
    seconds,
    size_bytes,
    unit_specifiers,
)

SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "systemd-analyze"  # scripts/system-deps.sh installs it
HOST_UNITS = Path("/usr/lib/systemd/system")
ENV_EXAMPLE = UNIT_DIR / "edgestream.env"
#: Highest ``systemd-analyze security`` exposure accepted (0 = fully sandboxed, 10 = none);
#: the units score 1.4 with systemd 252: what is left is network access (they need it),
#: no W^X (torch JITs) and no IP allow list (the brokers' addresses are the site's).
MAX_EXPOSURE = 2.0
#: The Kafka credentials drop-in of each unit (README "Kafka credentials"), installed as
#: /etc/systemd/system/<unit>.d/kafka.conf, and the principal it logs in as.
DROPINS = {
    "edgestream-worker@.service": "kafka-workers.conf",
    "edgestream-server.service": "kafka-workers.conf",
    "edgestream-simulate@.service": "kafka-devices.conf",
    "edgestream-bridge@.service": "kafka-devices.conf",
    "edgestream-serve@.service": "kafka-workers.conf",
}
PRINCIPAL_SUFFIX = {"kafka-workers.conf": "-workers", "kafka-devices.conf": "-devices"}
CREDENTIALS_SOURCE_DIR = "/etc/edgestream/credentials/"


# --- systemd's own checks -------------------------------------------------------------------
def install_root(root: Path, units: dict[str, str] | None = None, dropins: dict[str, str] | None = None) -> Path:
    """A file-system root as on an edge host after README's install steps: the units in
    /etc/systemd/system (``units``: name -> text, default the repository's), ``dropins``
    (unit name -> text) as /etc/systemd/system/<unit>.d/kafka.conf, the host's
    system units (sysinit.target, network-online.target ...), and an executable at
    /opt/edgestream/bin/edgestream (verify checks that ExecStart's binary exists)."""
    etc = root / "etc" / "systemd" / "system"
    etc.mkdir(parents=True)
    for name in UNITS:
        text = units[name] if units and name in units else (UNIT_DIR / name).read_text()
        (etc / name).write_text(text)
    for name, text in (dropins or {}).items():
        (etc / f"{name}.d").mkdir()
        (etc / f"{name}.d" / "kafka.conf").write_text(text)
    if HOST_UNITS.is_dir():
        # Copied, not linked: the alias links in it are absolute and resolve inside the root.
        shutil.copytree(HOST_UNITS, root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    binary = root / INSTALLED_EDGESTREAM.lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    return root


def verify(root: Path, instance: str) -> list[str]:
    """Problems ``systemd-analyze verify`` reports for ``instance`` of the units in ``root``:
    a non-zero exit, and every line it prints about our units. Settings systemd cannot
    parse (an unknown key, a bad value) are only warnings for it, ignored at start: a
    misspelt hardening key would silently do nothing, so every such line counts."""
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", f"--root={root}", "--man=no", "--recursive-errors=no", instance],
        capture_output=True, text=True, timeout=60,
    )
    ours = [line for line in (proc.stdout + proc.stderr).splitlines()
            if "edgestream" in line or str(root) in line]
    return ([f"exit {proc.returncode}"] if proc.returncode else []) + ours


def exposure(root: Path, instance: str) -> tuple[float, int]:
    """``systemd-analyze security --offline=yes``'s overall exposure of ``instance``, and its
    exit status with ``--threshold`` at ``MAX_EXPOSURE`` (non-zero above it; the option counts
    in tenths: 0..100 for the printed 0.0..10.0)."""
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=yes", f"--root={root}", f"--threshold={round(MAX_EXPOSURE * 10)}",
         "--no-pager", instance],
        capture_output=True, text=True, timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", proc.stdout)
    assert m, f"no overall exposure in the output:\n{proc.stdout}\n{proc.stderr}"
    return float(m.group(1)), proc.returncode


def offline_security_supported() -> bool:
    help_text = subprocess.run([SYSTEMD_ANALYZE, "--help"], capture_output=True, text=True).stdout
    return "--offline" in help_text and "--threshold" in help_text


@pytest.mark.parametrize("name", UNITS)
def test_systemd_analyze_verify_accepts_each_unit(name, tmp_path):
    root = install_root(tmp_path / "root")
    assert verify(root, UNITS[name]) == []


BREAKAGES = {
    "misspelt key": ("WatchdogSec=30s", "WatchdogSecs=30s"),
    "bad value": ("ProtectSystem=strict", "ProtectSystem=strictest"),
    "unknown address family": ("AF_INET6 AF_UNIX\n", "AF_INET6 AF_UNIXX\n"),
    "missing binary": (INSTALLED_EDGESTREAM + " ", INSTALLED_EDGESTREAM + "d "),
    "relative binary": (INSTALLED_EDGESTREAM + " ", "edgestream/bin/edgestream "),
    "bad specifier": ("--worker %i", "--worker %Z"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_verify_catches_a_broken_unit(breakage, tmp_path):
    """The check above fails on real unit errors: a broken copy of the worker unit is reported."""
    old, new = BREAKAGES[breakage]
    name = "edgestream-worker@.service"
    text = (UNIT_DIR / name).read_text()
    assert old in text
    root = install_root(tmp_path / "root", {name: text.replace(old, new, 1)})
    problems = verify(root, UNITS[name])
    assert problems, f"verify did not notice the {breakage}"


@pytest.mark.parametrize("name", UNITS)
def test_security_exposure_is_below_the_threshold(name, tmp_path):
    assert offline_security_supported(), "this systemd-analyze has no security --offline/--threshold (needs systemd >= 250)"
    root = install_root(tmp_path / "root")
    score, code = exposure(root, UNITS[name])
    assert score <= MAX_EXPOSURE and code == 0, f"{UNITS[name]}: exposure {score} > {MAX_EXPOSURE}"


def test_security_threshold_fails_a_unit_without_its_sandbox(tmp_path):
    assert offline_security_supported(), "this systemd-analyze has no security --offline/--threshold (needs systemd >= 250)"
    name = "edgestream-worker@.service"
    text = (UNIT_DIR / name).read_text()
    head, sandbox = text.split("# --- sandbox", 1)
    root = install_root(tmp_path / "root", {name: head + "[Install]" + sandbox.split("[Install]", 1)[1]})
    score, code = exposure(root, UNITS[name])
    assert score > MAX_EXPOSURE and code != 0


# --- the properties the service contract needs ----------------------------------------------
@pytest.fixture(params=list(UNITS), ids=lambda name: name.split(".")[0])
def unit(request):
    return parse_unit(UNIT_DIR / request.param)


def example_grace_s() -> float:
    env = read_environment_file(ENV_EXAMPLE)
    return float(env.get("EDGESTREAM__SERVICE__SHUTDOWN_GRACE_S", ServiceSection().shutdown_grace_s))


def test_type_notify_with_the_watchdog(unit):
    assert unit.get("Service", "Type") == "notify"
    assert unit.get("Service", "NotifyAccess") == "main"  # sd_notify comes from the main process
    watchdog = seconds(unit.get("Service", "WatchdogSec") or "0")
    # Pinged every WatchdogSec/2 from the event loop: long enough for a slow board's step,
    # and the process is ready (the watchdog is armed) well before TimeoutStartSec.
    assert 10 <= watchdog <= seconds(unit.get("Service", "TimeoutStartSec"))


def test_restarts_on_failure_with_a_delay_and_a_start_limit(unit):
    assert unit.get("Service", "Restart") == "on-failure"
    restart_s = seconds(unit.get("Service", "RestartSec") or "0")
    assert restart_s >= 1
    burst = int(unit.get("Unit", "StartLimitBurst"))
    interval = seconds(unit.get("Unit", "StartLimitIntervalSec"))
    # The limit can trip on automatic restarts: `burst` of them fit in the interval.
    assert burst >= 2 and interval > (burst - 1) * restart_s
    # A config error stays one; so does a checkpoint directory without a usable file (the
    # processes that restore checkpoints: worker and server, not the simulator, the bridge or
    # serve, which keeps waiting for a good model instead).
    restores = not unit.path.name.startswith(("edgestream-simulate", "edgestream-bridge", "edgestream-serve@"))
    expected = [str(EXIT_CONFIG)] + ([str(EXIT_NO_CHECKPOINT)] if restores else [])
    assert unit.words("Service", "RestartPreventExitStatus") == expected
    assert "143" in unit.words("Service", "SuccessExitStatus")  # second SIGTERM: 128 + 15


def test_stop_timeout_is_above_the_shutdown_grace(unit):
    grace = max(ServiceSection().shutdown_grace_s, example_grace_s())
    assert seconds(unit.get("Service", "TimeoutStopSec")) >= grace + 5
    assert unit.get("Service", "KillMode") in ("mixed", "control-group")
    assert unit.get("Service", "KillSignal") in (None, "SIGTERM")


def test_runs_as_the_edgestream_user_with_its_state_directory(unit):
    assert unit.get("Service", "User") == "edgestream" and unit.get("Service", "Group") == "edgestream"
    assert unit.get("Service", "DynamicUser") in (None, "no")
    assert unit.get("Service", "StateDirectory") == "edgestream"
    env = {k: v for value in unit.values("Service", "Environment") for k, v in parse_assignments(value).items()}
    assert env["EDGESTREAM__RUN__STATE_DIR"] == "%S/edgestream"  # /var/lib/edgestream, writable
    assert env["EDGESTREAM_METRICS_PORT"] == "0"  # default when the instance file sets none
    assert int(env["OMP_NUM_THREADS"]) >= 1


def test_reads_the_shared_then_the_instance_environment_file(unit):
    files = unit.values("Service", "EnvironmentFile")
    assert files[0] == "/etc/edgestream/edgestream.env"  # required: missing is an error
    assert len(files) == 2 and files[1].startswith("-/etc/edgestream/")  # optional, read last
    if "@" in unit.path.name:
        assert "%i" in files[1]


def test_waits_for_the_network_and_is_enabled_for_multi_user(unit):
    assert "network-online.target" in unit.words("Unit", "After")
    assert "network-online.target" in unit.words("Unit", "Wants")
    assert unit.get("Install", "WantedBy") == "multi-user.target"


def test_has_resource_limits(unit):
    assert size_bytes(unit.get("Service", "MemoryHigh")) < size_bytes(unit.get("Service", "MemoryMax"))
    assert re.fullmatch(r"\d+%", unit.get("Service", "CPUQuota"))
    assert int(unit.get("Service", "TasksMax")) >= 64


HARDENING = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    "PrivateDevices": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes", "RestrictNamespaces": "yes",
    "LockPersonality": "yes", "SystemCallArchitectures": "native", "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes", "ProtectClock": "yes", "ProtectHostname": "yes",
}


def test_is_sandboxed(unit):
    for key, value in HARDENING.items():
        assert unit.get("Service", key) == value, key
    assert unit.values("Service", "CapabilityBoundingSet") == []  # present and empty: no capabilities
    assert "CapabilityBoundingSet" in unit.sections["Service"]
    assert sorted(unit.words("Service", "RestrictAddressFamilies")) == ["AF_INET", "AF_INET6", "AF_UNIX"]
    assert unit.values("Service", "SystemCallFilter")[0] == "@system-service"
    # W^X breaks torch's JIT-compiled convolution kernels (README "Hardening"): only the
    # simulator and the bridge, which do not load torch, have it.
    wx_denied = unit.get("Service", "MemoryDenyWriteExecute") == "yes"
    assert wx_denied == unit.path.name.startswith(("edgestream-simulate@", "edgestream-bridge@"))


# --- Kafka credentials ------------------------------------------------------------------------
def uncommented(text: str) -> str:
    """A drop-in with its commented-out settings (``#Key=value``) switched on: the client
    certificate, and LoadCredentialEncrypted= in place of the LoadCredential= it replaces."""
    text = re.sub(r"^#(?=[A-Za-z]+=)", "", text, flags=re.M)
    for ident in re.findall(r"^LoadCredentialEncrypted=([^:]+):", text, flags=re.M):
        text, n = re.subn(rf"^LoadCredential={re.escape(ident)}:.*\n", "", text, flags=re.M)
        assert n == 1, f"LoadCredentialEncrypted={ident} replaces no LoadCredential="
    return text


def merged(name: str, dropin_text: str | None = None, tmp_path: Path | None = None):
    """The unit ``name`` with its Kafka drop-in applied, as systemd merges them (a drop-in's
    assignments come after the unit's)."""
    unit = parse_unit(UNIT_DIR / name)
    path = UNIT_DIR / DROPINS[name]
    if dropin_text is not None:
        path = tmp_path / DROPINS[name]
        path.write_text(dropin_text)
    for section, keys in parse_unit(path).sections.items():
        for key, values in keys.items():
            unit.sections.setdefault(section, {}).setdefault(key, []).extend(values)
    return unit


def credentials(unit) -> dict[str, str]:
    """Credential id -> source file, from LoadCredential= and LoadCredentialEncrypted=."""
    out = {}
    for key in ("LoadCredential", "LoadCredentialEncrypted"):
        for value in unit.values("Service", key):
            ident, _, source = value.partition(":")
            assert ident not in out, f"credential {ident} loaded twice"
            out[ident] = source
    return out


def test_units_carry_no_credentials(unit):
    """Plaintext works without the drop-in, and no unit (nor the example env file) holds or
    loads a secret: that is the drop-in's job, with files."""
    assert not credentials(unit)
    text = unit.path.read_text()
    assert DROPINS[unit.path.name] in text and "$CREDENTIALS_DIRECTORY" in text
    env = default_env(unit)
    assert not [k for k in env if k.startswith("EDGESTREAM__KAFKA__") or k == "EDGESTREAM_KAFKA_PASSWORD"]
    assert not [k for k in read_environment_file(ENV_EXAMPLE) if "PASSWORD" in k or "SASL" in k or "SSL" in k]


@pytest.mark.parametrize("name", UNITS)
@pytest.mark.parametrize("variant", ["as shipped", "every commented setting on"])
def test_systemd_analyze_verify_accepts_each_unit_with_its_kafka_dropin(name, variant, tmp_path):
    text = (UNIT_DIR / DROPINS[name]).read_text()
    if variant != "as shipped":
        text = uncommented(text)
    root = install_root(tmp_path / "root", dropins={name: text})
    assert verify(root, UNITS[name]) == []


def test_verify_reads_the_dropin(tmp_path):
    """The check above does see the drop-in: a misspelt key in it is reported."""
    name = "edgestream-worker@.service"
    text = (UNIT_DIR / DROPINS[name]).read_text().replace("\nLoadCredential=", "\nLoadCredentials=", 1)
    root = install_root(tmp_path / "root", dropins={name: text})
    assert any("LoadCredentials" in line for line in verify(root, UNITS[name]))


@pytest.mark.parametrize("name", UNITS)
def test_security_exposure_with_the_dropin_is_below_the_threshold(name, tmp_path):
    assert offline_security_supported(), "this systemd-analyze has no security --offline/--threshold (needs systemd >= 250)"
    root = install_root(tmp_path / "root", dropins={name: (UNIT_DIR / DROPINS[name]).read_text()})
    score, code = exposure(root, UNITS[name])
    assert score <= MAX_EXPOSURE and code == 0, f"{UNITS[name]} + {DROPINS[name]}: exposure {score} > {MAX_EXPOSURE}"


@pytest.mark.parametrize("name", UNITS)
def test_dropin_hands_the_secrets_over_as_credential_files(name):
    """The password and the CA come in as systemd credentials (root-only files read by PID 1),
    and the kafka.* keys name them in $CREDENTIALS_DIRECTORY (%d): no secret in the unit, its
    environment or an env file."""
    dropin = UNIT_DIR / DROPINS[name]
    unit = merged(name)
    loaded = credentials(unit)
    assert set(loaded) == {"kafka-password", "kafka-ca.pem"}
    for source in loaded.values():
        assert source.startswith(CREDENTIALS_SOURCE_DIR), source
    env = default_env(unit)
    assert env["EDGESTREAM__KAFKA__SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["EDGESTREAM__KAFKA__SASL_PASSWORD_FILE"] == "%d/kafka-password"
    assert env["EDGESTREAM__KAFKA__SSL_CAFILE"] == "%d/kafka-ca.pem"
    assert env["EDGESTREAM__KAFKA__SASL_USERNAME"].endswith(PRINCIPAL_SUFFIX[dropin.name])
    # Settings that would put a secret into the unit or the process environment.
    text = dropin.read_text()
    assert not re.search(r"^#?\s*(SetCredential|SetCredentialEncrypted|EnvironmentFile|PassEnvironment)=", text, re.M)
    assert "EDGESTREAM_KAFKA_PASSWORD" not in text
    assert not re.search(r"PASSWORD=", text.replace("PASSWORD_FILE=", ""))


@pytest.mark.parametrize("name", UNITS)
@pytest.mark.parametrize("variant", ["as shipped", "every commented setting on"])
def test_dropin_settings_load_as_a_secure_job(name, variant, tmp_path):
    """With %d expanded to a credentials directory as systemd makes it, the unit's and the
    drop-in's environment is a valid SASL_SSL job whose client reads the password from the
    credential file; the password itself is in no setting and not in the client's repr."""
    from edgestream.pipeline.security import ClientSecurity

    text = (UNIT_DIR / DROPINS[name]).read_text()
    if variant != "as shipped":
        text = uncommented(text)
    unit = merged(name, text, tmp_path)
    creds = tmp_path / "run-credentials"
    creds.mkdir()
    secret = "canary-Pa55word-of-the-unit-test"
    for ident in credentials(unit):
        (creds / ident).write_text(secret + "\n" if ident == "kafka-password" else f"{ident} contents\n")
    specifiers = {**unit_specifiers(UNITS[name], "/var/lib", "/var/cache"), "d": str(creds)}
    env = {k: expand_specifiers(v, specifiers) for k, v in default_env(unit).items()}
    env.update(read_environment_file(ENV_EXAMPLE))  # EnvironmentFile= wins over Environment=
    for key, value in env.items():
        if key.startswith("EDGESTREAM__KAFKA__") and key.endswith("FILE") and value.startswith(str(creds)):
            assert Path(value).name in credentials(unit), f"{key} names a file no credential provides"
    cfg = load_config(env={k: v for k, v in env.items() if k.startswith("EDGESTREAM__")})
    assert cfg.kafka.security_protocol == "SASL_SSL"
    assert bool(cfg.kafka.ssl_certfile) == (variant != "as shipped")
    assert ("LoadCredentialEncrypted" in unit.sections["Service"]) == (variant != "as shipped")
    security = ClientSecurity.from_config(cfg.kafka, env=env)
    assert security.password() == secret
    assert secret not in repr(security) and secret not in "\n".join(env.values())


# --- the command lines --------------------------------------------------------------------
def default_env(unit) -> dict[str, str]:
    env = {}
    for value in unit.values("Service", "Environment"):
        env.update(parse_assignments(value))
    return env


@pytest.mark.parametrize("name, command", [
    ("edgestream-worker@.service", "worker"),
    ("edgestream-simulate@.service", "simulate"),
    ("edgestream-server.service", "server"),
    ("edgestream-bridge@.service", "bridge"),
    ("edgestream-serve@.service", "serve"),
])
def test_exec_start_is_a_valid_edgestream_command(name, command):
    from edgestream.cli.main import build_parser

    unit = parse_unit(UNIT_DIR / name)
    (line,) = unit.values("Service", "ExecStart")
    argv = exec_argv(line.replace("%i", "w0"), {**default_env(unit), **read_environment_file(ENV_EXAMPLE)})
    assert argv[0] == INSTALLED_EDGESTREAM
    args = build_parser().parse_args(argv[1:])  # SystemExit(2) on an unknown flag or bad value
    assert args.command == command
    assert str(args.job) == "/etc/edgestream/job.toml"
    assert args.metrics_port == 0
    if command == "worker":
        assert args.worker == "w0"
    if command == "simulate":
        assert args.forever and args.duration is None
    if command == "bridge":
        assert args.bridge_kind == "mqtt" and args.duration is None  # until stopped
    if command == "serve":
        assert args.name == "w0" and args.model_from is None  # the job's default model source


def test_exec_start_argv_expands_like_systemd():
    env = {"PORT": "9410", "TWO": "a b"}
    assert exec_argv("-/bin/x --p ${PORT} $TWO ${TWO} --x=${PORT}", env) == [
        "/bin/x", "--p", "9410", "a", "b", "a b", "--x=9410"]


# --- the example environment file and the user ----------------------------------------------
def test_example_environment_file_sets_valid_config_keys():
    """Every EDGESTREAM__ line of the example, also the commented-out ones, is a config key
    the job accepts with that value."""
    env = read_environment_file(ENV_EXAMPLE)
    commented = [line.lstrip("#").strip() for line in ENV_EXAMPLE.read_text().splitlines()
                 if re.match(r"#[A-Z_]+=", line)]
    for line in commented:
        key, _, value = line.partition("=")
        env.setdefault(key, value)
    config_env = {k: v for k, v in env.items() if k.startswith("EDGESTREAM__")}
    assert "EDGESTREAM__KAFKA__BOOTSTRAP" in config_env
    cfg = load_config(env=config_env)  # ConfigError on an unknown key or a bad value
    assert cfg.service.log_format == "json"
    assert "EDGESTREAM_METRICS_PORT" not in read_environment_file(ENV_EXAMPLE)  # per instance only


def test_sysusers_file_creates_the_user_with_its_state_directory_as_home(tmp_path):
    sysusers = shutil.which("systemd-sysusers")
    assert sysusers is not None, "systemd-sysusers is missing: `bash scripts/system-deps.sh` installs systemd"
    (tmp_path / "etc").mkdir()
    subprocess.run([sysusers, f"--root={tmp_path}", str(UNIT_DIR / "edgestream.sysusers")],
                   check=True, capture_output=True, timeout=60)
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc" / "passwd").read_text().splitlines()}
    user = users["edgestream"]
    assert int(user[2]) < 1000  # a system user
    assert user[5] == "/var/lib/edgestream" and user[6].endswith("nologin")
