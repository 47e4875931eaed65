"""Shared fixtures: real image files, real homes (tinycnn), the CLI in a real subprocess."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
# The CIFAR-10 JPEG archive is never part of the project: tests that need it skip without it.
CIFAR = Path(os.environ.get("ODTD_CIFAR10", REPO.parent / "shared" / "datasets" / "cifar10-jpeg.tar.gz"))
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
# Fixtures that run a TensorFlow worker (init, pre-training, sessions, profiles): a test using one
# is marked `trains`, which `make quick` leaves out. Tests that start a worker by other means
# carry the mark themselves.
TRAINING_FIXTURES = {"_base_home", "home", "daemon_home", "pretrained", "trained_home", "profiled"}
# Three pytest workers share this machine's two cores (most tests wait on a subprocess), so each
# TensorFlow worker the tests start gets one thread per pool: tinycnn's ops are too small to
# gain from more. Measured on the development machine (2026-11-26): two pytest workers with
# TensorFlow's default pools 5 min 30 s (7 min 50 s of user CPU), with one thread per pool
# 5 min 24 s (7 min 22 s), three pytest workers with one thread 4 min 39 s-4 min 52 s (6.5 min
# later that day, when the machine itself ran a quarter slower: README, Development). A real
# worker keeps TensorFlow's defaults.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        if TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.trains)


@pytest.fixture(scope="session", autouse=True)
def _worker_server(request, tmp_path_factory):
    """A process that imported TensorFlow once, whose forks run the workers the tests start.

    Started by each pytest worker whose run has tests marked `trains` (so not by `make quick`):
    ``ODTD_WORKER_SERVER`` in the environment hands each worker's job to it
    (odtd/trainer/forkserver.py), saving the 4 to 6 s of CPU a worker spends importing
    TensorFlow and Keras. Until it listens, and for a test that starts a worker with an
    environment of its own, workers run themselves as the daemon's do. ``ODTD_TEST_FORK=0``
    turns it off.
    """
    if os.environ.get("ODTD_TEST_FORK") == "0" or not any(
            item.get_closest_marker("trains") for item in request.session.items):
        yield None
        return
    directory = tmp_path_factory.mktemp("server")
    server = start_worker_server(directory, dict(os.environ))
    os.environ["ODTD_WORKER_SERVER"] = str(directory / "sock")
    yield directory / "sock"
    del os.environ["ODTD_WORKER_SERVER"]
    server.terminate()
    server.wait(timeout=60)


def start_worker_server(directory: Path, env: dict) -> subprocess.Popen:
    """Start ``python -m odtd.trainer.forkserver directory/sock``, its log in
    ``directory/server.log``; it listens once it has imported TensorFlow."""
    with open(directory / "server.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "odtd.trainer.forkserver",
                                 str(directory / "sock")], stdout=subprocess.DEVNULL,
                                stderr=log, stdin=subprocess.DEVNULL, cwd=REPO, env=env)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2):
    """Poll ``predicate`` until it returns something true or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


def write_images(root: Path, per_class: int = 2, classes=CLASSES, seed: int = 0, size: int = 32,
                 fmt: str = "png") -> list[Path]:
    """Write distinct random images under root/<class>/ and return their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for label in classes:
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
            path = root / label / f"{i}.{fmt}"
            Image.fromarray(pixels).save(path)
            paths.append(path)
    return paths


def odtctl(*args: str, home: Path | None = None, check: bool = True,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `odtctl` in a real subprocess, the way a person does."""
    env = dict(os.environ)
    if home is not None:
        env["ODTD_HOME"] = str(home)
    proc = subprocess.run([sys.executable, "-m", "odtd.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"odtctl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def tensorflow_report(script: str, timeout: float = 240):
    """Run ``script`` in a child Python (TensorFlow stays out of the test process); the JSON it
    printed last."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def odtctl_json(*args: str, home: Path | None = None):
    return json.loads(odtctl(*args, "--json", home=home).stdout)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory that ``build`` fills once per test run, shared by every pytest-xdist worker.

    For files tests only read or copy (an initialised home, model files, a profile): the first
    worker to ask builds them under a lock, the others wait and use them (pytest-xdist's recipe
    for a session fixture that runs once). Each build starts TensorFlow workers; `make test`'s
    three pytest workers would otherwise each run it.
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, above each worker's own
    root = base / name
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".built").exists():
            shutil.rmtree(root, ignore_errors=True)  # a build that failed part-way
            root.mkdir()
            build(root)
            (root / ".built").touch()
    return root


@pytest.fixture(scope="session")
def _base_home(tmp_path_factory) -> Path:
    """One initialised tinycnn home (a worker run), copied for each test that needs one."""
    return built_once(tmp_path_factory, "base",
                      lambda root: odtctl("init", "--model", "tinycnn", home=root / "home")) / "home"


@pytest.fixture
def home(_base_home, tmp_path) -> Path:
    """A fresh copy of an initialised tinycnn home with the test policy."""
    target = tmp_path / "home"
    shutil.copytree(_base_home, target, symlinks=True)
    shutil.copyfile(REPO / "policies" / "tinycnn-test.yaml", target / "policy.yaml")
    return target
