"""The daemon on a disk that goes read-only, is pulled out, or is missing at start.

Real filesystems (tests/mounts.py): an ext4 image the kernel remounts read-only after an
injected error (as an SD card after I/O errors), a tmpfs remounted read-only, a bind mount
unmounted under the daemon (a USB disk pulled out). The daemon must keep running, say what is
wrong in ``odtctl status`` and its log, hold sessions, and resume when the disk is back.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, odtctl, odtctl_json, wait_for, write_images
from mounts import MB, bind, ext4_image, fill, fs_error, remount, tmpfs, unmount
from test_daemon import FAST_CONFIG
from test_storage import one_error_line, storage_config


class Daemon:
    """``odtd run`` on a home, its log in a file (read while it runs)."""

    def __init__(self, home: Path, log: Path, env: dict | None = None) -> None:
        self.log = log
        self._log_handle = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "odtd.daemon.service", "run", "--home",
                                      str(home)], stdout=subprocess.DEVNULL,
                                     stderr=self._log_handle, cwd=REPO,
                                     env=dict(os.environ, **(env or {})))

    def says(self, text: str, timeout_s: float = 30) -> bool:
        return bool(wait_for(lambda: text in self.log.read_text() or self.proc.poll() is not None,
                             timeout_s, 0.1)) and text in self.log.read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self._log_handle.close()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self._log_handle.close()


@pytest.fixture
def daemons():
    started: list = []
    yield lambda home, log, env=None: started.append(Daemon(home, log, env)) or started[-1]
    for daemon in started:  # never leave a daemon behind when a test fails half-way
        daemon.kill()


def daemon_on(home: Path, target: Path) -> Path:
    shutil.copytree(home, target)
    (target / "odtd.yaml").write_text(FAST_CONFIG)
    storage_config(target, 1)
    return target


def fresh_heartbeat(home: Path) -> bool:
    try:
        return odtctl_json("status", home=home)["daemon"]["running"]
    except AssertionError:  # the home is not there
        return False


def test_a_home_the_kernel_remounts_read_only_keeps_the_daemon_running_and_says_so(
        home, tmp_path, daemons):
    with ext4_image(tmp_path / "sdcard", 48) as card:
        odtd_home = daemon_on(home, card / "odtd")
        daemon = daemons(odtd_home, tmp_path / "daemon.log")
        assert wait_for(lambda: fresh_heartbeat(odtd_home), 30)
        fs_error(card)  # as after an I/O error: errors=remount-ro
        assert daemon.says("read-only file system (EROFS)")
        status = odtctl_json("status", home=odtd_home)  # reading still works
        assert "read-only file system (EROFS)" in status["storage"]["problem"]
        assert "PROBLEM" in odtctl("status", home=odtd_home).stdout
        write_images(tmp_path / "imgs", per_class=1)
        line = one_error_line(odtctl("ingest", str(tmp_path / "imgs"), home=odtd_home, check=False))
        assert "(EROFS)" in line and str(odtd_home) in line
        line = one_error_line(odtctl("train-now", "--wait", home=odtd_home, check=False))
        assert "no session while the home cannot be written" in line
        wait_for(lambda: not daemon.alive(), 3)  # several heartbeats later, still there
        assert daemon.alive()
        assert daemon.stop() == 0
        log = daemon.log.read_text()
        assert "Traceback" not in log
        assert log.count("sessions and inbox scans wait") == 1  # said once, not every heartbeat


def notifications(sock: socket.socket, until: str, timeout_s: float = 30) -> list[str]:
    """sd_notify messages received until one contains ``until``."""
    messages: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(until in m for m in messages):
        messages.append(sock.recv(4096).decode())
    return messages


def test_a_home_read_only_at_start_is_waited_for_and_used_once_writable(home, tmp_path, daemons):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(30)
    with tmpfs(tmp_path / "disk", 16) as disk, notify:
        odtd_home = daemon_on(home, disk / "odtd")
        remount(disk, "ro")
        daemon = daemons(odtd_home, tmp_path / "daemon.log",
                         {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "2000000"})
        assert daemon.says("read-only file system (EROFS)")
        assert "EROFS" in odtctl_json("status", home=odtd_home)["storage"]["problem"]
        # systemd sees it (STATUS=, in `systemctl status odtd`) and keeps getting its pings.
        seen = notifications(notify, "STATUS=storage: ")
        assert any("READY=1" in m for m in seen) and "read-only" in seen[-1]
        assert sum("WATCHDOG=1" in m for m in notifications(notify, "never", 2.5)) >= 2
        assert daemon.alive()  # under systemd: no exit, so no restart loop
        remount(disk, "rw")
        assert daemon.says("the home can be written again")
        assert notifications(notify, "STATUS=idle")[-1].startswith("STATUS=idle; next session")
        assert wait_for(lambda: fresh_heartbeat(odtd_home), 30)
        status = odtctl_json("status", home=odtd_home)
        assert status["storage"]["problem"] is None
        assert odtctl_json("pause", home=odtd_home)["paused"] is True  # its socket is up now
        assert daemon.stop() == 0


def test_a_disk_pulled_out_and_put_back(home, tmp_path, daemons):
    with tmpfs(tmp_path / "backing", 16) as backing:
        daemon_on(home, backing / "odtd")
        with bind(backing, tmp_path / "mnt") as mnt:
            odtd_home = mnt / "odtd"
            daemon = daemons(odtd_home, tmp_path / "daemon.log")
            assert wait_for(lambda: fresh_heartbeat(odtd_home), 30)
            unmount(mnt)  # pulled out
            assert daemon.says("no odtd home there")
            line = one_error_line(odtctl("status", home=odtd_home, check=False))
            assert "not an odtd home (no such directory): if the home lives on a data disk, " \
                "mount it" in line
            assert daemon.alive()
            with bind(backing, mnt):  # put back
                assert daemon.says("the home can be written again")
                assert wait_for(lambda: fresh_heartbeat(odtd_home), 30)
                assert daemon.stop() == 0


def test_a_home_missing_at_start_is_one_line_and_exit_78(tmp_path):
    missing = tmp_path / "data" / "odtd"  # its disk not mounted
    proc = subprocess.run([sys.executable, "-m", "odtd.daemon.service", "run", "--home", str(missing)],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=dict(os.environ))
    assert proc.returncode == 78  # EX_CONFIG: the unit does not restart it in a loop
    line = one_error_line(proc)
    assert str(missing) in line and "mount it" in line


def test_a_full_disk_keeps_the_inbox_files_until_space_is_freed(home, tmp_path, daemons):
    write_images(tmp_path / "drop", per_class=10, size=48)
    with tmpfs(tmp_path / "disk", 12) as disk:
        odtd_home = daemon_on(home, disk / "odtd")
        fill(disk, int(1.5 * MB))  # above the 1 MB floor, too little for the day's images
        daemon = daemons(odtd_home, tmp_path / "daemon.log")
        assert wait_for(lambda: fresh_heartbeat(odtd_home), 30)
        shutil.copytree(tmp_path / "drop", odtd_home / "inbox", dirs_exist_ok=True)
        dropped = sorted(p for p in (odtd_home / "inbox").rglob("*") if p.is_file())
        assert daemon.says("inbox ingest failed: not enough disk space")
        wait_for(lambda: not daemon.alive(), 2)  # a few scans later
        assert sorted(p for p in (odtd_home / "inbox").rglob("*") if p.is_file()) == dropped
        assert daemon.log.read_text().count("inbox ingest failed") == 1  # said once
        (disk / "ballast").unlink()
        assert wait_for(lambda: not any(p.is_file() for p in (odtd_home / "inbox").rglob("*")), 30)
        assert odtctl_json("status", home=odtd_home)["samples"]["total"] == 100
        assert daemon.stop() == 0
