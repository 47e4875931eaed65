"""Deployment: the systemd unit, the default config, install/uninstall, and sd_notify.

The unit is checked by Debian's real ``systemd-analyze verify``; the scripts run for real
into scratch roots; sd_notify talks to a real AF_UNIX datagram socket this test owns.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from odtd.config import Config, load_config
from odtd.daemon.sdnotify import NOTIFY_ENV_VARS, Notifier, child_environment, watchdog_interval_s

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "odtd.service"
INSTALL = DEPLOY / "install.sh"
UNINSTALL = DEPLOY / "uninstall.sh"
DEFAULT_POLICY = REPO / "policies" / "default.yaml"

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not installed (Debian: apt-get install systemd; .ci/run does this)",
)
STEPS = ("user", "venv", "config", "worker", "state", "unit", "odtctl", "systemd")


# -- the unit file -------------------------------------------------------------------------


def parse_unit(text: str) -> list[tuple[int, str, str, str]]:
    """Return (line number, section, key, value) for every directive line."""
    directives = []
    section = ""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", ";")):
            continue
        if stripped.startswith("["):
            section = stripped.strip("[]")
            continue
        key, _, value = stripped.partition("=")
        directives.append((number, section, key.strip(), value.strip()))
    return directives


def unit_values() -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for _, _, key, value in parse_unit(UNIT.read_text()):
        values.setdefault(key, []).append(value)
    return values


def seconds(value: str) -> float:
    """Parse the systemd time spans this unit uses: 90s, 2min, 1h."""
    units = {"s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    match = re.fullmatch(r"(\d+)\s*([a-z]*)", value)
    assert match, value
    return int(match.group(1)) * units[match.group(2) or "s"]


def make_systemd_root(root: Path) -> Path:
    """Build a minimal root for `systemd-analyze verify --root`: systemd's own units, kill,
    and an executable stand-in for /opt/odtd/venv/bin/odtd (this machine has no odtd venv).
    """
    system_units = next(
        (p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()),
        None,
    )
    if system_units is None:
        pytest.skip("systemd's unit directory is missing; install Debian's systemd package")
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    (root / "bin").symlink_to("usr/bin")
    (root / "lib").symlink_to("usr/lib")
    shutil.copy2(shutil.which("kill") or "/usr/bin/kill", root / "usr/bin/kill")
    odtd = root / "opt/odtd/venv/bin/odtd"
    odtd.parent.mkdir(parents=True)
    odtd.write_text("#!/bin/sh\nexit 0\n")
    odtd.chmod(0o755)
    (root / "etc/systemd/system").mkdir(parents=True, exist_ok=True)
    return root


def verify(root: Path) -> subprocess.CompletedProcess[str]:
    # `verify` exits 0 even after "Unknown key" or "Invalid ..." warnings, so a clean unit
    # is one that makes it print nothing at all.
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", f"--root={root}", "odtd.service"],
        capture_output=True, text=True, timeout=60,
    )


@needs_systemd_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path):
    root = make_systemd_root(tmp_path / "root")
    shutil.copy(UNIT, root / "etc/systemd/system/odtd.service")
    result = verify(root)
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == ""


@needs_systemd_analyze
def test_verify_reports_a_broken_directive(tmp_path):
    # The check above means something only if a typo would make verify speak.
    root = make_systemd_root(tmp_path / "root")
    broken = UNIT.read_text().replace("Nice=10", "Nice=10\nNicee=3\nMemoryMax=lots")
    (root / "etc/systemd/system/odtd.service").write_text(broken)
    output = verify(root).stderr
    assert "Unknown key" in output and "Nicee" in output
    assert "lots" in output


def test_unit_has_every_required_directive():
    values = unit_values()

    def one(key: str) -> str:
        assert key in values, f"odtd.service lacks {key}="
        return values[key][-1]

    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main"
    assert one("Restart") == "on-failure"
    assert one("User") == "odtd" and one("Group") == "odtd"
    assert "jtop" in one("SupplementaryGroups").split()
    assert one("StateDirectory") == "odtd" and one("StateDirectoryMode") == "0770"
    assert one("RuntimeDirectory") == "odtd"
    assert one("ConfigurationDirectory") == "odtd"
    assert one("Environment") == "ODTD_HOME=/var/lib/odtd"
    assert one("ExecStart") == "/opt/odtd/venv/bin/odtd run --config /etc/odtd/odtd.yaml"
    assert one("ExecReload") == "/bin/kill -HUP $MAINPID"
    assert int(one("Nice")) > 0
    assert "CPUWeight" in values or one("CPUSchedulingPolicy") == "idle"
    assert one("IOSchedulingClass") == "idle"
    assert one("MemoryHigh") and one("MemoryMax")
    assert "jtop.service" in one("After").split()
    assert "jtop.service" in one("Wants").split()
    assert one("KillMode") == "mixed"
    assert one("UMask") == "0007"
    assert one("NoNewPrivileges") == "yes"
    assert one("ProtectSystem") == "strict"
    assert one("ProtectHome") == "yes"
    assert one("PrivateTmp") == "yes"
    assert one("ProtectKernelTunables") == "yes"
    assert one("ProtectControlGroups") == "yes"
    assert one("RestrictAddressFamilies").split()[0] == "AF_UNIX"
    # TensorFlow on Jetson needs /dev/nvhost-* and /dev/nvmap, and JITs code.
    assert values.get("PrivateDevices", ["no"])[-1] == "no"
    assert values.get("MemoryDenyWriteExecute", ["no"])[-1] == "no"
    assert one("WantedBy") == "multi-user.target"


def test_unit_timeouts_fit_the_daemon_config():
    values = unit_values()
    config = load_config(DEPLOY / "odtd.yaml")
    # Stop: the daemon's orderly stop (grace, then terminate/kill, then recording) must fit.
    assert seconds(values["TimeoutStopSec"][-1]) >= 2 * config.trainer.stop_grace_s + 30
    # Watchdog: pinged at half the period; several heartbeats must fit in that half.
    assert seconds(values["WatchdogSec"][-1]) / 2 >= 4 * config.heartbeat_interval_s


def test_every_unit_directive_has_a_comment_above_it():
    lines = UNIT.read_text().splitlines()
    missing = [
        f"line {number}: {key}="
        for number, _, key, _ in parse_unit(UNIT.read_text())
        if not lines[number - 2].lstrip().startswith("#")
    ]
    assert not missing, "directives without an explanatory comment: " + ", ".join(missing)
    # systemd has no trailing comments: "Nice=10 # why" would make the value "10 # why".
    assert not [v for _, _, _, v in parse_unit(UNIT.read_text()) if "#" in v]


# -- the default config --------------------------------------------------------------------


def test_default_config_validates_and_points_at_etc_policy():
    config = load_config(DEPLOY / "odtd.yaml")
    assert isinstance(config, Config)
    assert config.policy == "/etc/odtd/policy.yaml"
    assert config.trainer.python is None


# -- install.sh / uninstall.sh -------------------------------------------------------------


def sh(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"{script.name} {args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def actions(output: str) -> list[str]:
    """The commands a script ran (or, with --dry-run, would run)."""
    return [line for line in output.splitlines() if line.startswith("+ ")]


def files_under(root: Path) -> set[str]:
    return {
        str(path.relative_to(root))
        for path in root.rglob("*")
        if path.is_file() or path.is_symlink()
    }


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_scripts_are_shellcheck_clean():
    result = subprocess.run(
        ["shellcheck", str(INSTALL), str(UNINSTALL)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path):
    out = sh(INSTALL, "--dry-run", "--root", str(tmp_path)).stdout
    for name in STEPS:
        assert f"==> {name}:" in out
    assert "useradd --system --gid odtd --home-dir /var/lib/odtd" in out
    assert "-m venv /opt/odtd/venv" in out
    assert f"pip install --upgrade {REPO}[trainer]" in out
    assert f"{tmp_path}/etc/odtd/odtd.yaml" in out
    assert f"{tmp_path}/etc/systemd/system/odtd.service" in out
    assert f"ln -sfn /opt/odtd/venv/bin/odtctl {tmp_path}/usr/local/bin/odtctl" in out
    assert f"ln -s /etc/odtd/odtd.yaml {tmp_path}/var/lib/odtd/odtd.yaml" in out
    assert "enable odtd.service" in out
    assert "systemctl start odtd" in out
    assert list(tmp_path.iterdir()) == []


def test_dry_run_on_a_jetson_root_uses_system_site_packages(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("# R32 (release), REVISION: 6.1\n")
    (tmp_path / "etc/group").write_text("video:x:44:\njtop:x:998:\n")
    out = sh(INSTALL, "--dry-run", "--root", str(tmp_path)).stdout
    assert "jetson: yes" in out
    assert "-m venv --system-site-packages /opt/odtd/venv" in out
    assert f"{REPO}[jetson]" in out
    # Both of the unit's supplementary groups exist: no override drop-in.
    assert "10-groups.conf" not in out


def test_dry_run_no_trainer_installs_no_extra(tmp_path):
    out = sh(INSTALL, "--dry-run", "--no-jetson", "--no-trainer", "--root", str(tmp_path)).stdout
    assert re.search(rf"pip install --upgrade {re.escape(str(REPO))}$", out, re.M)


def test_dry_run_on_this_system_plans_the_real_steps():
    # Reads this machine's state (user, groups, venv) and prints; --dry-run changes nothing.
    out = sh(INSTALL, "--dry-run", "--no-jetson", "--python", sys.executable).stdout
    for name in STEPS:
        assert f"==> {name}:" in out
    assert "useradd" in out or "ok: user odtd exists" in out
    assert "pip install --upgrade" in out


def test_install_is_idempotent_keeps_edits_and_uninstall_keeps_state(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    out = sh(INSTALL, "--root", str(root), "--no-venv").stdout
    assert "skipped (--no-venv)" in out
    assert "skipped: --root" in out  # the user step, with its reason
    etc = root / "etc/odtd"
    assert (etc / "odtd.yaml").read_bytes() == (DEPLOY / "odtd.yaml").read_bytes()
    if DEFAULT_POLICY.exists():
        assert (etc / "policy.yaml").read_bytes() == DEFAULT_POLICY.read_bytes()
    unit = root / "etc/systemd/system/odtd.service"
    assert unit.read_bytes() == UNIT.read_bytes()
    # No jtop or video group in this root: the drop-in clears SupplementaryGroups=.
    dropin = root / "etc/systemd/system/odtd.service.d/10-groups.conf"
    assert dropin.read_text().splitlines()[-1] == "SupplementaryGroups="
    link = root / "usr/local/bin/odtctl"
    assert os.readlink(link) == "/opt/odtd/venv/bin/odtctl"
    assert stat.S_IMODE((root / "var/lib/odtd").stat().st_mode) == 0o770
    # odtctl (ODTD_HOME/odtd.yaml) and the service (--config) read one file.
    assert os.readlink(root / "var/lib/odtd/odtd.yaml") == "/etc/odtd/odtd.yaml"
    if shutil.which("systemctl"):
        wants = root / "etc/systemd/system/multi-user.target.wants/odtd.service"
        assert os.readlink(wants) == "/etc/systemd/system/odtd.service"

    # Again: nothing to do.
    assert actions(sh(INSTALL, "--root", str(root), "--no-venv").stdout) == []

    # A user's edit survives; the new default lands beside it.
    edited = (etc / "odtd.yaml").read_text() + "heartbeat_interval_s: 7\n"
    (etc / "odtd.yaml").write_text(edited)
    out = sh(INSTALL, "--root", str(root), "--no-venv").stdout
    assert (etc / "odtd.yaml").read_text() == edited
    assert (etc / "odtd.yaml.default").read_bytes() == (DEPLOY / "odtd.yaml").read_bytes()
    assert f"the new default is at {etc}/odtd.yaml.default" in out
    assert actions(sh(INSTALL, "--root", str(root), "--no-venv").stdout) == []

    # State the daemon made, then uninstall: only the configuration and the state remain.
    (root / "var/lib/odtd/models/tinycnn/v0").mkdir(parents=True)
    (root / "var/lib/odtd/odtd.db").write_bytes(b"SQLite format 3\0")
    (root / "var/lib/odtd/models/tinycnn/v0/weights.npz").write_bytes(b"PK")
    kept = {"etc/odtd/odtd.yaml", "etc/odtd/odtd.yaml.default", "var/lib/odtd/odtd.yaml",
            "var/lib/odtd/odtd.db", "var/lib/odtd/models/tinycnn/v0/weights.npz"}
    if DEFAULT_POLICY.exists():
        kept.add("etc/odtd/policy.yaml")
    out = sh(UNINSTALL, "--root", str(root)).stdout
    assert files_under(root) == kept
    assert "kept: user and group odtd" in out
    assert actions(sh(UNINSTALL, "--root", str(root)).stdout) == []

    out = sh(UNINSTALL, "--root", str(root), "--purge").stdout
    assert files_under(root) == set()
    assert "userdel odtd" in out  # named as the step the target would run


def test_uninstall_keeps_other_drop_ins_unless_purge(tmp_path):
    sh(INSTALL, "--root", str(tmp_path), "--no-venv")
    override = tmp_path / "etc/systemd/system/odtd.service.d/override.conf"
    override.write_text("[Service]\nMemoryMax=3G\n")
    sh(UNINSTALL, "--root", str(tmp_path))
    assert override.exists()
    assert not (tmp_path / "etc/systemd/system/odtd.service.d/10-groups.conf").exists()
    sh(UNINSTALL, "--root", str(tmp_path), "--purge")
    assert not override.parent.exists()


@needs_systemd_analyze
def test_installed_unit_and_group_drop_in_verify_clean(tmp_path):
    root = make_systemd_root(tmp_path / "root")
    (root / "etc/group").write_text("jtop:x:998:\n")
    sh(INSTALL, "--root", str(root), "--no-venv", "--no-jetson")
    dropin = root / "etc/systemd/system/odtd.service.d/10-groups.conf"
    lines = dropin.read_text().splitlines()
    assert lines[-2:] == ["SupplementaryGroups=", "SupplementaryGroups=jtop"]
    result = verify(root)
    assert result.stdout + result.stderr == ""


# -- sd_notify -----------------------------------------------------------------------------


@pytest.fixture
def receiver():
    """A bound AF_UNIX datagram socket standing in for systemd's notify socket."""
    # A short directory: sun_path holds at most 107 bytes, and tmp_path can be long.
    directory = tempfile.mkdtemp(prefix="odtd-sd-")
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()
    shutil.rmtree(directory)


def test_messages_arrive_byte_exact(receiver):
    sock, path = receiver
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready() is True
    assert sock.recv(4096) == b"READY=1"
    assert notifier.status("training: day 3, step 40/120") is True
    assert sock.recv(4096) == b"STATUS=training: day 3, step 40/120"
    assert notifier.watchdog() is True
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert notifier.stopping() is True
    assert sock.recv(4096) == b"STOPPING=1"
    assert notifier.notify(READY=1, STATUS="two\nlines") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=two lines"
    assert notifier.reloading() is True
    assert re.fullmatch(rb"RELOADING=1\nMONOTONIC_USEC=\d+", sock.recv(4096))
    notifier.close()
    assert notifier.watchdog() is True  # reopens after close
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_abstract_namespace_socket():
    name = f"odtd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        notifier = Notifier.from_environ({"NOTIFY_SOCKET": "@" + name})
        assert notifier.address == b"\0" + name.encode()
        assert notifier.ready() is True
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_reads_notify_socket_from_the_environment(receiver, monkeypatch):
    sock, path = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert Notifier.from_environ().watchdog() is True
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_unset_notify_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier.from_environ()
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.status("x") is False
    assert notifier.watchdog() is False
    assert notifier._sock is None  # not even a socket was made
    assert Notifier.from_environ({"NOTIFY_SOCKET": ""}).enabled is False


def test_send_failure_never_raises_and_says_why(tmp_path, caplog):
    notifier = Notifier(str(tmp_path / "nobody-listens"))
    with caplog.at_level(logging.DEBUG, logger="odtd.daemon.sdnotify"):
        assert notifier.ready() is False
    assert "not sent" in caplog.text and "READY=1" in caplog.text


def test_unusable_address_disables_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="odtd.daemon.sdnotify"):
        notifier = Notifier.from_environ({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert "vsock:2:1234" in caplog.text
    with pytest.raises(ValueError, match="absolute socket path"):
        Notifier("relative/notify")


def test_malformed_fields_are_caller_bugs():
    notifier = Notifier(None)
    with pytest.raises(ValueError, match="upper case"):
        notifier.notify(ready=1)
    with pytest.raises(ValueError, match="at least one field"):
        notifier.notify()


def test_concurrent_pings_arrive_whole_and_carry_our_pid(receiver):
    # NotifyAccess=main accepts a datagram when its sender credentials name the main PID;
    # a thread's datagrams carry the process ID, so the session runner thread may ping.
    sock, path = receiver
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    notifier = Notifier(path)
    threads_n, pings_n = 8, 50
    received: list[tuple[bytes, int]] = []

    def drain() -> None:
        ucred = struct.calcsize("3i")
        for _ in range(threads_n * pings_n):
            data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(ucred))
            pid = next(
                struct.unpack("3i", cdata[:ucred])[0]
                for level, kind, cdata in ancillary
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
            )
            received.append((data, pid))

    def ping(index: int) -> None:
        for _ in range(pings_n):
            notifier.notify(WATCHDOG=1, STATUS=f"thread {index}")

    reader = threading.Thread(target=drain)
    reader.start()
    senders = [threading.Thread(target=ping, args=(i,)) for i in range(threads_n)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    reader.join(timeout=10)
    assert len(received) == threads_n * pings_n
    assert all(re.fullmatch(rb"WATCHDOG=1\nSTATUS=thread \d", data) for data, _ in received)
    assert {pid for _, pid in received} == {os.getpid()}


def test_watchdog_interval_is_half_the_period_for_this_process():
    pid = os.getpid()
    assert watchdog_interval_s({"WATCHDOG_USEC": "120000000"}) == 60.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": str(pid)}) == 60.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "7"}, pid=7) == 1.5
    # Inherited by a child: the watchdog is someone else's.
    assert watchdog_interval_s({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": ""}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "-5"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "me"}) is None


def test_watchdog_interval_reads_the_environment(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval_s() == 5.0
    assert set(NOTIFY_ENV_VARS) == {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"}
    # What the daemon's children (and so their workers) get: everything but those.
    assert child_environment({"NOTIFY_SOCKET": "/run/n", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2",
                              "PATH": "/bin"}) == {"PATH": "/bin"}
