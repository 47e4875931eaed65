"""deploy/install.sh on a TX2's layout: a fake JetPack 4.6 tree whose ``/usr/bin/python3.6`` is a
Python 3.6 with TensorFlow (make test-tx2's worker venv), a Python 3.8 for the daemon.

First into a scratch root (``--root``), then the installed layout driven as far as systemd
allows here: in a mount namespace of its own, the tree laid over the machine's /etc, /usr, /opt
and /var (overlayfs: everything written lands in the tree, the machine is not touched),
install.sh runs as on a board (user, venv, config, unit), then ``odtctl doctor``, ``init`` and
``odtd run --config /etc/odtd/odtd.yaml`` as the unit's ExecStart, with a notify socket standing in
for systemd's, and a session through the control socket whose worker is JetPack's Python. No
systemd runs here: the service's user, sandbox and cgroup limits are not applied (root runs it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from conftest import REPO, WORKER_PYTHON, write_images

INSTALL = REPO / "deploy" / "install.sh"
JETPACK_PYTHON = "/usr/bin/python3.6"

pytestmark = [
    pytest.mark.trains,
    pytest.mark.skipif(WORKER_PYTHON == sys.executable,
                       reason="make test-tx2 runs these: a Python 3.6 worker (ODTD_TEST_WORKER_PYTHON)"),
]


def worker_version() -> str:
    proc = subprocess.run([WORKER_PYTHON, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                          capture_output=True, text=True, check=True)
    return proc.stdout.strip()


def jetpack_tree(root: Path, group_file: str) -> Path:
    """A JetPack 4.6 root: its release file, groups, and ``/usr/bin/python3.6`` with TensorFlow.

    That Python is a script that runs the worker's venv: a link to a venv's python would not be
    that venv (Python finds ``pyvenv.cfg`` beside the path it was started by).
    """
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "nv_tegra_release").write_text(
        "# R32 (release), REVISION: 6.1, GCID: 27863751, BOARD: t186ref, EABI: aarch64\n")
    (root / "etc" / "group").write_text(group_file)
    python = root / JETPACK_PYTHON.lstrip("/")
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {WORKER_PYTHON} "$@"\n')
    python.chmod(0o755)
    return root


def install(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_install_on_a_jetpack_4_root_names_its_python36_as_the_worker(tmp_path):
    assert worker_version().startswith("3.6."), "a JetPack 4 tree needs the Python 3.6 worker"
    root = jetpack_tree(tmp_path / "root", "video:x:44:\njtop:x:998:\n")
    out = install("--root", str(root), "--python", "python3.8").stdout
    assert "jetson: yes" in out and "==> worker:" in out
    config = (root / "etc/odtd/odtd.yaml").read_text()
    assert f"\n  python: {JETPACK_PYTHON}\n" in config and "\n  python: null\n" not in config
    assert f"ok: {JETPACK_PYTHON}: Python {worker_version()}, TensorFlow 2.6.2" in out
    assert "/opt/odtd/venv/bin/odtctl doctor --home /var/lib/odtd" in out
    # Again: the config is the default this board gets, nothing to do.
    again = install("--root", str(root), "--python", "python3.8").stdout
    assert [line for line in again.splitlines() if line.startswith("+ ")] == []
    assert "is the current default" in again

    # The daemon on JetPack's own Python 3.6 would be the worker's too (and is refused on /).
    same = jetpack_tree(tmp_path / "same", "")
    install("--root", str(same), "--python", "python3.6", "--no-venv")
    assert "\n  python: null\n" in (same / "etc/odtd/odtd.yaml").read_text()
    # A config of the user's own is kept, and told what to set.
    kept = jetpack_tree(tmp_path / "kept", "")
    (kept / "etc/odtd").mkdir()
    (kept / "etc/odtd/odtd.yaml").write_text("trainer:\n  python: null\n")
    out = install("--root", str(kept), "--python", "python3.8", "--no-venv").stdout
    assert (kept / "etc/odtd/odtd.yaml").read_text() == "trainer:\n  python: null\n"
    assert f"does not name {JETPACK_PYTHON} as trainer.python; set it there" in out
    # Without TensorFlow there, the installer says what to install.
    bare = jetpack_tree(tmp_path / "bare", "")
    (bare / JETPACK_PYTHON.lstrip("/")).write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    out = install("--root", str(bare), "--python", "python3.8", "--no-venv").stdout
    assert f"{JETPACK_PYTHON} cannot import TensorFlow: install NVIDIA's wheel" in out


DRIVE = r"""
set -euo pipefail
for dir in etc usr opt var; do
  mkdir -p "$ROOT/$dir" "$WORK/$dir"
  mount -t overlay overlay -o "lowerdir=/$dir,upperdir=$ROOT/$dir,workdir=$WORK/$dir" "/$dir"
done
bash "$CHECKOUT/deploy/install.sh" --python "$PYTHON38" >"$OUT/install.log" 2>&1
/opt/odtd/venv/bin/odtctl doctor --home /var/lib/odtd --json >"$OUT/doctor.json"
export ODTD_HOME=/var/lib/odtd
umask 0007
/opt/odtd/venv/bin/odtctl init --model tinycnn --validation "$IMAGES/validation" >"$OUT/init.log" 2>&1
/opt/odtd/venv/bin/odtctl ingest "$IMAGES/day1" --json >"$OUT/ingest.json"
NOTIFY_SOCKET="$NOTIFY" /opt/odtd/venv/bin/odtd run --config /etc/odtd/odtd.yaml >"$OUT/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 600); do [ -S /var/lib/odtd/run/odtd.sock ] && break; sleep 0.1; done
/opt/odtd/venv/bin/odtctl train-now --wait --json >"$OUT/session.json"
kill -TERM "$daemon"
status=0
wait "$daemon" || status=$?
echo "$status" >"$OUT/daemon.status"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace and overlays need root")
def test_the_installed_layout_runs_a_session_on_jetpacks_python(tmp_path):
    host_groups = Path("/etc/group").read_text()
    extra = "".join(f"{name}:x:{gid}:\n" for name, gid in (("video", 44), ("jtop", 998))
                    if f"\n{name}:" not in "\n" + host_groups)
    root = jetpack_tree(tmp_path / "root", host_groups + extra)
    out, work, images = tmp_path / "out", tmp_path / "work", tmp_path / "images"
    out.mkdir()
    write_images(images / "validation", per_class=2, seed=1)
    write_images(images / "day1", per_class=3, seed=2)
    python38 = Path(sys.base_prefix) / "bin" / "python{}.{}".format(*sys.version_info[:2])
    notify_dir = Path(tempfile.mkdtemp(prefix="odtd-notify-"))  # sun_path: 107 bytes at most
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(notify_dir / "notify"))
    receiver.settimeout(0.2)
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("PYTHON", "ODTD_", "TF_NUM_", "VIRTUAL_ENV"))}
    env.update(ROOT=str(root), WORK=str(work), OUT=str(out), IMAGES=str(images),
               CHECKOUT=str(REPO), PYTHON38=str(python38), NOTIFY=str(notify_dir / "notify"))
    messages: list = []
    done = threading.Event()

    def receive() -> None:  # as systemd reads them: at once (the queue of datagrams is short)
        while not done.is_set():
            try:
                messages.append(receiver.recv(4096).decode())
            except socket.timeout:
                continue

    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(["unshare", "--mount", "bash", "-c", DRIVE], env=env,
                              capture_output=True, text=True, timeout=1200)
        logs = "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in
                         sorted(out.iterdir()))
        assert proc.returncode == 0, proc.stderr + logs
    finally:
        done.set()
        reader.join(timeout=10)
        receiver.close()
        shutil.rmtree(notify_dir)
    installed = (out / "install.log").read_text()
    assert f"ok: {JETPACK_PYTHON}: Python {worker_version()}, TensorFlow 2.6.2" in installed
    assert (root / "opt/odtd/venv/bin/odtd").exists() and not Path("/opt/odtd").exists()
    assert f"\n  python: {JETPACK_PYTHON}\n" in (root / "etc/odtd/odtd.yaml").read_text()
    doctor = json.loads((out / "doctor.json").read_text())
    assert doctor["ok"] and doctor["interpreter"] == JETPACK_PYTHON
    assert doctor["python"] == worker_version() and doctor["tensorflow"] == "2.6.2"
    assert doctor["odtd_path"] == "/opt/odtd/venv/lib/python{}.{}/site-packages/odtd".format(
        *sys.version_info[:2])
    session = json.loads((out / "session.json").read_text())
    assert session["trigger"] == "socket" and session["steps"] > 0, logs
    assert session["outcome"] in ("promoted", "rolled_back"), session["reason"]
    assert (out / "daemon.status").read_text().strip() == "0", logs
    assert (root / "var/lib/odtd/odtd.db").exists()  # the state is the layout's
    # systemd's view: ready once it serves, a session's status, a clean stop.
    assert messages[0] == "READY=1" and "STATUS=training" in messages, messages[:5]
    assert "STOPPING=1" in messages, messages[-5:]
