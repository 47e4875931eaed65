"""`odtd run` as a real background process: liveness, inbox, socket, signals, crash recovery."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, odtctl, odtctl_json, trainer_python_yaml, wait_for, write_images

from odtd.store.records import SESSION_KEYS

FAST_CONFIG = """\
schedule:
  cron: "0 2 * * *"
inbox:
  scan_interval_s: 0.5
heartbeat_interval_s: 0.5
trainer:
  stop_grace_s: 5
"""


def start_daemon(home: Path, env_extra=None) -> subprocess.Popen:
    env = dict(os.environ, ODTD_HOME=str(home), **(env_extra or {}))
    proc = subprocess.Popen([sys.executable, "-m", "odtd.daemon.service", "run"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    _STARTED.append(proc)
    wait_for(lambda: _running(home) or proc.poll() is not None, 30)
    if proc.poll() is not None:
        raise AssertionError(f"daemon exited {proc.returncode}: {proc.stderr.read()}")
    return proc


def _running(home: Path) -> bool:
    try:
        return odtctl_json("status", home=home)["daemon"]["running"]
    except (AssertionError, ValueError):
        return False


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM the daemon; its exit status. A failed stop's stderr goes to the test's output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=60)
        if status != 0:  # seen once (exit 1) under load in the TX2 daemon's tests, stderr unseen
            print(f"the daemon exited {status}; its stderr ends:\n{proc.stderr.read()[-4000:]}")
        return status
    finally:
        for stream in (proc.stdout, proc.stderr):
            stream.close()


@pytest.fixture
def daemon_home(home):
    (home / "odtd.yaml").write_text(FAST_CONFIG + trainer_python_yaml())
    yield home
    # Never leave a daemon behind when a test fails half-way.
    for proc in list(_STARTED):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _STARTED.clear()


_STARTED: list = []


def _long_policy(home: Path) -> None:
    text = (home / "policy.yaml").read_text().replace("epochs: 2", "epochs: 500")
    (home / "policy.yaml").write_text(text)


def _running_session(db: Path):
    row = sqlite3.connect(db).execute(
        "SELECT id, worker_pid, steps FROM sessions WHERE state = 'running'").fetchone()
    return row if row and row[1] and (row[2] or 0) > 0 else None


def test_status_inbox_and_train_now_wait(daemon_home, tmp_path):
    proc = start_daemon(daemon_home)
    try:
        status = odtctl_json("status", home=daemon_home)
        assert status["daemon"]["running"] is True
        assert status["daemon"]["pid"] == proc.pid
        from datetime import datetime

        next_at = datetime.fromisoformat(status["daemon"]["next_session_at"])
        assert (next_at.hour, next_at.minute) in {(2, m) for m in range(0, 6)}  # 02:00 + jitter
        assert status["daemon"]["heartbeat_age_s"] < 5
        write_images(tmp_path / "drop", per_class=7)
        for label_dir in (tmp_path / "drop").iterdir():
            shutil.copytree(label_dir, daemon_home / "inbox" / label_dir.name)
        inbox_empty = lambda: not any(p.is_file() for p in (daemon_home / "inbox").rglob("*"))
        assert wait_for(inbox_empty, 60)  # a wait, not a speed goal: loaded 2-core CI hosts are slow
        counts = odtctl_json("status", home=daemon_home)["samples"]
        assert counts["pending"] + counts["holdout"] == 70
        session = odtctl_json("train-now", "--wait", home=daemon_home)
        assert set(SESSION_KEYS) <= set(session)
        assert session["outcome"] == "promoted" and session["trigger"] == "socket"
        assert _children(proc.pid) == []  # no worker process remains
        odtctl("pause", home=daemon_home)
        assert odtctl_json("status", home=daemon_home)["daemon"]["paused"] is True
        odtctl("resume", home=daemon_home)
        assert odtctl_json("status", home=daemon_home)["daemon"]["paused"] is False
    finally:
        assert stop(proc) == 0
    assert odtctl_json("status", home=daemon_home)["daemon"]["running"] is False


def test_sigterm_during_session_interrupts_it(daemon_home, tmp_path):
    write_images(tmp_path / "imgs", per_class=7)
    odtctl("ingest", str(tmp_path / "imgs"), home=daemon_home)
    _long_policy(daemon_home)
    before = (daemon_home / "models/tinycnn/current").read_text()
    pending = odtctl_json("status", home=daemon_home)["samples"]["pending"]
    proc = start_daemon(daemon_home)
    odtctl("train-now", home=daemon_home)
    row = wait_for(lambda: _running_session(daemon_home / "odtd.db"), 60)
    assert row, "no session started"
    assert stop(proc) == 0
    session = odtctl_json("history", "--limit", "1", home=daemon_home)[0]
    assert session["outcome"] == "interrupted" and "SIGTERM" in session["reason"]
    assert (daemon_home / "models/tinycnn/current").read_text() == before
    assert odtctl_json("status", home=daemon_home)["samples"]["pending"] == pending
    assert not _alive(row[1])


def test_kill_9_daemon_then_restart_recovers(daemon_home, tmp_path):
    write_images(tmp_path / "imgs", per_class=7)
    odtctl("ingest", str(tmp_path / "imgs"), home=daemon_home)
    _long_policy(daemon_home)
    proc = start_daemon(daemon_home)
    odtctl("train-now", home=daemon_home)
    row = wait_for(lambda: _running_session(daemon_home / "odtd.db"), 60)
    assert row
    proc.kill()
    stop(proc)
    # The orphaned worker notices its parent died and exits within seconds.
    assert wait_for(lambda: not _alive(row[1]), 10)
    (daemon_home / "policy.yaml").write_text(
        (daemon_home / "policy.yaml").read_text().replace("epochs: 500", "epochs: 1"))
    proc = start_daemon(daemon_home)
    try:
        stale = odtctl_json("history", home=daemon_home)[0]
        assert stale["id"] == row[0] and stale["outcome"] == "interrupted"
        assert sqlite3.connect(daemon_home / "odtd.db").execute(
            "PRAGMA integrity_check").fetchone()[0] == "ok"
        session = odtctl_json("train-now", "--wait", home=daemon_home)
        assert session["outcome"] == "promoted"
    finally:
        assert stop(proc) == 0


def test_bad_config_exits_with_one_line(daemon_home):
    (daemon_home / "odtd.yaml").write_text("schedule:\n  cron: 'every night'\n")
    proc = subprocess.run([sys.executable, "-m", "odtd.daemon.service", "run", "--home", str(daemon_home)],
                          capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == 78  # EX_CONFIG: systemd does not restart-loop on it
    assert proc.stderr.count("\n") == 1
    assert "odtd.yaml: schedule.cron='every night'" in proc.stderr
    (daemon_home / "odtd.yaml").write_text("inbox:\n  scan_every: 3\n")
    proc = subprocess.run([sys.executable, "-m", "odtd.daemon.service", "run", "--home", str(daemon_home)],
                          capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == 78 and "unknown key 'inbox.scan_every'" in proc.stderr


def test_sighup_with_broken_policy_keeps_the_old_one(daemon_home):
    proc = start_daemon(daemon_home)
    try:
        good = (daemon_home / "policy.yaml").read_text()
        (daemon_home / "policy.yaml").write_text(good + "surprise: 1\n")
        proc.send_signal(signal.SIGHUP)
        events = lambda: [e for e in _events(daemon_home) if e[0] == "reload_rejected"]
        rejected = wait_for(events, 10)
        assert rejected and "unknown key 'surprise'" in rejected[0][1]
        assert _running(daemon_home)
        with pytest.raises(AssertionError, match="unknown key 'surprise'"):
            odtctl("reload", home=daemon_home)
        (daemon_home / "policy.yaml").write_text(good.replace("size: 8", "size: 4"))
        odtctl("reload", home=daemon_home)
    finally:
        assert stop(proc) == 0


def test_sd_notify_ready_and_watchdog_also_while_training(daemon_home, tmp_path):
    address = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(30)
    write_images(tmp_path / "imgs", per_class=7)
    odtctl("ingest", str(tmp_path / "imgs"), home=daemon_home)
    proc = start_daemon(daemon_home, {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000"})
    try:
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
        odtctl("train-now", home=daemon_home)
        # Collect until the session is over; count pings sent while it was training.
        during, training = 0, False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            message = sock.recv(4096).decode()
            if "STATUS=training" in message:
                training = True
            elif "STATUS=idle" in message and training:
                break
            if training and "WATCHDOG=1" in message:
                during += 1
        assert training and during >= 3
    finally:
        assert stop(proc) == 0
        sock.close()


def _events(home):
    return sqlite3.connect(home / "odtd.db").execute(
        "SELECT kind, message FROM events ORDER BY id").fetchall()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _next_session(home):
    from datetime import datetime

    text = odtctl_json("status", home=home)["daemon"]["next_session_at"]
    return datetime.fromisoformat(text) if text else None


def test_the_policys_schedule_drives_the_daemon_and_reload_applies_it(daemon_home, tmp_path):
    from datetime import datetime

    # odtd.yaml: 03:00 on 1 January; the policy: none yet, then every minute.
    (daemon_home / "odtd.yaml").write_text(
        FAST_CONFIG.replace('cron: "0 2 * * *"', 'cron: "0 3 1 1 *"\n  jitter_s: 0')
        + trainer_python_yaml())
    proc = start_daemon(daemon_home)
    try:
        january = _next_session(daemon_home)
        assert (january.month, january.day, january.hour) == (1, 1, 3)
        policy = daemon_home / "policy.yaml"
        policy.write_text(policy.read_text() + 'schedule:\n  cron: "* * * * *"\n')
        odtctl("reload", home=daemon_home)
        soon = _next_session(daemon_home)
        # Within the next minute; across a minute's turn the status can still name the one just
        # due while it fires (seen once at 02:52:00.84 against 02:52:00).
        assert -5 < (soon - datetime.now(soon.tzinfo)).total_seconds() <= 61
        # The next minute comes, and a scheduled session runs (no samples: it is skipped). Each
        # look at the history is an odtctl process: none before the minute turns.
        time.sleep(max(0.0, (soon - datetime.now(soon.tzinfo)).total_seconds()))
        ran = wait_for(lambda: [s for s in odtctl_json("history", home=daemon_home)
                                if s["trigger"] == "schedule"], 75, interval_s=1.0)
        assert ran and ran[0]["outcome"] == "skipped"
    finally:
        assert stop(proc) == 0
    # At start, the policy's schedule is the one in force (and the one a missed run is owed for).
    proc = start_daemon(daemon_home)
    try:
        assert (_next_session(daemon_home) - datetime.now().astimezone()).total_seconds() <= 61
    finally:
        assert stop(proc) == 0
