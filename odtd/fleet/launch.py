"""Flower's processes, started as a user would: a SuperLink, SuperNodes, ``flwr run``.

``odtctl fleet run`` uses ``run_app`` against any SuperLink; ``odtctl fleet simulate`` and the
tests start everything on localhost (``LocalFleet``). Flower >= 1.40: the SuperLink serves its
Fleet, Control and Runtime APIs over HTTP on one port; each SuperNode serves its own Runtime API
on another. No Flower import here: the processes are Flower's own command-line programs of the
venv this Python belongs to (its bin directory goes first on their PATH, where the SuperLink
finds ``flower-superexec``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

from odtd.errors import OdtdError

# The Flower app `flwr run` submits: odtd's ServerApp and ClientApp, installed in the venv on
# both ends (the bundle holds only this file: nothing of odtd is shipped in it).
APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "odtd-fleet"
version = "1.0.0"
description = "odtd's fleet: each round an odtd session under the device's own policy"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "odtd"

[tool.flwr.app.components]
serverapp = "odtd.fleet.server:app"
clientapp = "odtd.fleet.client:app"

[tool.flwr.app.config]
fleet-config = ""
"""
SUPERLINK_NAME = "odtd-fleet"


def flower_bin() -> Path:
    """The directory of this venv's Flower programs."""
    return Path(sys.executable).parent


# How often a SuperNode's SuperExec asks it for a message to start a ClientApp on (Flower's
# FLWR_SUPEREXEC_TASK_POLL_INTERVAL; its default is 1 s).
SUPEREXEC_POLL_S = "0.25"


def environment(flwr_home: Path) -> dict:
    """The environment of Flower's processes: this venv's bin first, a private FLWR_HOME.

    The SuperExec polls at ``SUPEREXEC_POLL_S`` unless the caller's environment sets its own.
    """
    env = dict(os.environ, FLWR_HOME=str(flwr_home), PYTHONUNBUFFERED="1")
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", SUPEREXEC_POLL_S)
    env["PATH"] = f"{flower_bin()}{os.pathsep}{env.get('PATH', '')}"
    return env


def free_port() -> int:
    """A TCP port nobody listens on now (localhost)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_listening(port: int, process: subprocess.Popen, what: str, timeout_s: float = 180) -> None:
    """Wait until ``port`` accepts connections.

    A process that exits is reported at once; one still starting is given ``timeout_s``: on a
    2-core machine under a load of 35 (a fleet benchmark of eight DenseNet40 devices) the
    SuperLink did not listen within the minute this used to allow.

    Raises:
        OdtdError: The process exited first, or the port stayed closed.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise OdtdError(f"{what} exited with status {process.returncode} before listening on "
                            f"port {port}; see its log")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise OdtdError(f"{what} does not listen on port {port} after {timeout_s:g} s")


def write_app(work: Path, address: str, insecure: bool = True,
              root_certificates: Optional[Path] = None) -> tuple[Path, Path]:
    """Write the Flower app's directory and a FLWR_HOME naming the SuperLink at ``address``.

    Returns:
        (app directory, FLWR_HOME).
    """
    app, flwr_home = work / "app", work / "flwr-home"
    app.mkdir(parents=True, exist_ok=True)
    flwr_home.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(APP_PYPROJECT, encoding="utf-8")
    connection = [f'[superlink]\ndefault = "{SUPERLINK_NAME}"\n', f"[superlink.{SUPERLINK_NAME}]",
                  f'address = "{address}"']
    if insecure:
        connection.append("insecure = true")
    elif root_certificates is not None:
        connection.append(f'root-certificates = "{Path(root_certificates).resolve()}"')
    (flwr_home / "config.toml").write_text("\n".join(connection) + "\n", encoding="utf-8")
    return app, flwr_home


def run_app(config: Path, work: Path, address: str, insecure: bool = True,
            root_certificates: Optional[Path] = None,
            progress: Callable[[str], None] = print, timeout_s: Optional[float] = None) -> int:
    """Submit odtd's Flower app with ``flwr run`` and follow its log to the run's end.

    Args:
        config: The server's YAML (``settings``), as the SuperLink's machine sees it.
        work: Where the app's directory and FLWR_HOME are written.
        address: The SuperLink's ``host:port``.
        insecure: Without TLS.
        root_certificates: With TLS: the CA certificate that verifies the SuperLink's.
        progress: Called with the run's lines that odtd's ServerApp prints.
        timeout_s: Stop waiting (and the ``flwr run`` process) after this long.

    Returns:
        ``flwr run``'s exit status.
    """
    app, flwr_home = write_app(work, address, insecure, root_certificates)
    command = [str(flower_bin() / "flwr"), "run", str(app), SUPERLINK_NAME, "--stream",
               "--run-config", f'fleet-config="{Path(config).resolve()}"']
    log_path = work / "flwr-run.log"
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=environment(flwr_home), cwd=work)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            text = line.rstrip()
            if text.startswith(("round ", "run ")) or "Error" in text or "error" in text:
                progress(text)
            if deadline is not None and time.monotonic() > deadline:
                process.kill()
                break
        return process.wait()


class LocalFleet:
    """A SuperLink and SuperNodes on localhost, each logging to a file in ``work``.

    Args:
        work: The directory of their logs and FLWR_HOME.
    """

    def __init__(self, work: Path) -> None:
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.flwr_home = self.work / "flwr-home"
        self.flwr_home.mkdir(exist_ok=True)
        self.superlink: Optional[subprocess.Popen] = None
        self.supernodes: List[subprocess.Popen] = []

    def _start(self, name: str, command: List[str]) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "w", encoding="utf-8")  # noqa: SIM115 - the process's
        try:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env=environment(self.flwr_home), cwd=self.work)
        finally:
            log.close()

    def start_superlink(self) -> None:
        """Start the SuperLink (insecure, localhost) and wait until it listens."""
        # Its state in memory (Flower's default): with a state file, 16 devices' replies coming
        # back together met "database is locked" and the round was never aggregated.
        self.superlink = self._start("superlink", [
            str(flower_bin() / "flower-superlink"), "--insecure", "--port", str(self.port),
            "--disable-runtime-dependency-installation"])
        wait_listening(self.port, self.superlink, "flower-superlink")

    def start_supernode(self, socket_path: Path, name: str) -> subprocess.Popen:
        """Start a SuperNode whose ClientApp asks the daemon on ``socket_path``."""
        port = free_port()
        process = self._start(name, [
            str(flower_bin() / "flower-supernode"), "--insecure", "--superlink", self.address,
            "--port", str(port), "--node-config", f'socket="{Path(socket_path).resolve()}"'])
        wait_listening(port, process, f"flower-supernode {name}")
        self.supernodes.append(process)
        return process

    def run(self, config: Path, progress: Callable[[str], None] = print,
            timeout_s: Optional[float] = None) -> int:
        """``flwr run`` odtd's app on this SuperLink (``run_app``)."""
        return run_app(config, self.work / "run", self.address, progress=progress, timeout_s=timeout_s)

    def stop(self) -> None:
        """Stop the SuperNodes, then the SuperLink (each its Flower children with it)."""
        for process in self.supernodes + ([self.superlink] if self.superlink else []):
            if process.poll() is None:
                process.terminate()
        for process in self.supernodes + ([self.superlink] if self.superlink else []):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.supernodes = []
        self.superlink = None
