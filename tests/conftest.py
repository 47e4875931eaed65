"""Shared fixtures: real image files, real homes (tinycnn), the CLI in a real subprocess."""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import python_server
from PIL import Image

from odtd.atomic import pid_alive

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
# later that day, when the machine itself ran a quarter slower: CHANGELOG.md, 2026-11-26). A real
# worker keeps TensorFlow's defaults.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
# The interpreter the tests' TensorFlow runs under: their workers (homes `odtctl init` creates get
# it as `trainer.python`, `worker_config()` for the tests' own), the worker server and the plain
# Keras checks. `make test-tx2` names an old stack's (Python 3.6 with TensorFlow 2.6) while the
# tests and odtctl run on the daemon's Python 3.8; by default, the tests' own.
WORKER_PYTHON = os.environ.get("ODTD_TEST_WORKER_PYTHON") or sys.executable


# How long each test took in the last run that ran it (pytest's cache, .pytest_cache), so the
# next run starts the longest first: a run on several pytest workers then does not end on one
# of them working through a long test alone. pytest-xdist hands each worker a run of
# consecutive tests (`--dist worksteal` then moves tests from the end of a queue), so the
# longest are dealt out in turn: the N-th run of tests starts with every N-th longest.
DURATIONS_KEY = "odtd/durations"
_DURATIONS: dict = {}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.trains)
    cache = getattr(config, "cache", None)
    known = cache.get(DURATIONS_KEY, {}) if cache is not None else {}
    # Without a last run: the fleet's test first (a minute, most of it waiting on Flower's polls,
    # so it overlaps the others), then the tests that start a TensorFlow worker (the long ones).
    items[:] = dealt_longest_first(items, lambda item: known.get(
        item.nodeid, 60.0 if item.get_closest_marker("fleet")
        else 1.0 if item.get_closest_marker("trains") else 0.0),
        getattr(config, "workerinput", {}).get("workercount", 1))


def dealt_longest_first(items: list, duration: Callable, workers: int) -> list:
    """``items`` longest first, dealt out in turn into ``workers`` consecutive runs (a stable
    sort: every pytest worker collects the same order)."""
    longest = sorted(items, key=lambda item: -duration(item))
    return [item for turn in range(workers) for item in longest[turn::workers]]


def pytest_runtest_logreport(report):
    # In the process that reports (pytest-xdist's controller): setup, call and teardown.
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    cache = getattr(session.config, "cache", None)
    if cache is not None and _DURATIONS and not hasattr(session.config, "workerinput"):
        cache.set(DURATIONS_KEY, {**cache.get(DURATIONS_KEY, {}), **_DURATIONS})


# Servers on odtd/trainer/worker/forkserver.py's machinery, by (kind, Python): "worker" (the worker
# server) and tests/python_server.py's kinds. The ones every pytest worker shares are started by
# the process that starts them (pytest-xdist's controller, or pytest itself without it) before
# they start, so they inherit the sockets' paths; a pytest worker starts another Python's at its
# first call. Each process stops its own and removes their directory at the end of the run.
SHARED_SERVER_VARIABLE = "ODTD_TEST_{}_SERVER"  # for tests/python_server.py's kinds
_SERVER_PYTHON = {"cli": sys.executable, "worker": WORKER_PYTHON, "keras": WORKER_PYTHON}
_SERVERS: dict = {}
_PLACE: list = []  # the directory this process's servers (and their server.log) go in
_LISTENING: set = set()  # the sockets seen listening, not waited for again


def pytest_configure(config):
    """Start the shared servers: forks of them run the TensorFlow workers the tests start and
    their ``odtctl`` calls, saving the 4 to 6 s of CPU a worker spends importing TensorFlow and
    Keras and the 0.6 s a call spends importing the CLI's libraries.

    ``ODTD_WORKER_SERVER`` hands each worker's job to the worker server
    (odtd/trainer/worker/forkserver.py); ``ODTD_TEST_CLI_SERVER`` and ``ODTD_TEST_KERAS_SERVER`` name
    tests/python_server.py's ``cli`` and ``keras`` servers (``forked_python``). The two that
    import TensorFlow only where the run has the tests marked `trains` (not `make quick`). A
    test that starts a worker with an environment of its own, or before the server listens,
    gets one that runs itself, as the daemon's do. ``ODTD_TEST_FORK=0`` turns them off.
    """
    if hasattr(config, "workerinput") or os.environ.get("ODTD_TEST_FORK") == "0":
        return
    kinds = ["cli"]
    if "not trains" not in (config.getoption("markexpr", "") or ""):
        kinds += ["worker", "keras"]
    for kind in kinds:
        variable = "ODTD_WORKER_SERVER" if kind == "worker" else \
            SHARED_SERVER_VARIABLE.format(kind.upper())
        os.environ[variable] = str(_start_server(kind, _SERVER_PYTHON[kind]))


def pytest_unconfigure(config):
    for server in _SERVERS.values():
        if server.poll() is not None:  # the tests then ran fresh processes, slower
            log = Path(server.args[-1]).parent / "server.log"
            print(f"\n{server.args[1:-1]} server exited early ({server.returncode}); "
                  f"its log: {log.read_text()[-2000:]}", file=sys.stderr)
        server.terminate()
        server.wait(timeout=60)
    _SERVERS.clear()
    if _PLACE:
        shutil.rmtree(_PLACE.pop(), ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _worker_server(request):
    """Wait, before the first test that starts a worker, for the shared worker server to listen:
    a worker started before would import TensorFlow itself, while the server does."""
    path = os.environ.get("ODTD_WORKER_SERVER")
    if path and any(item.get_closest_marker("trains") for item in request.session.items):
        listening(path)


def start_server(directory: Path, env: dict, command: tuple = ("-m", "odtd.trainer.worker.forkserver"),
                 python: str = sys.executable) -> subprocess.Popen:
    """Start ``python -m odtd.trainer.worker.forkserver directory/sock`` (or another ``command`` that
    serves with it), its log in ``directory/server.log`` and its pid in ``directory/pid``; it
    listens once it has imported (``listening``)."""
    with open(directory / "server.log", "wb") as log:
        server = subprocess.Popen([str(python), *command, str(directory / "sock")],
                                  stdout=subprocess.DEVNULL, stderr=log,
                                  stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    (directory / "pid").write_text(str(server.pid))
    return server


def listening(socket_path: str | Path, timeout_s: float = 180) -> bool:
    """Wait until a server listens on ``socket_path``; False at once if the one
    ``start_server`` started there has died (its log says why), or after ``timeout_s``."""
    socket_path = Path(socket_path)
    pid_file = socket_path.parent / "pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None  # None: started by hand
    wait_for(lambda: socket_path.exists() or (pid is not None and not pid_alive(pid)), timeout_s,
             interval_s=0.05)
    return socket_path.exists()


def _start_server(kind: str, python: str) -> Path:
    """Start the ``kind`` server for ``python`` (not waiting for it); its socket's path."""
    if not _PLACE:
        _PLACE.append(Path(tempfile.mkdtemp(prefix="odtd-test-servers-")))
    directory = Path(tempfile.mkdtemp(prefix=kind, dir=_PLACE[0]))
    if kind == "worker":
        _SERVERS[kind, python] = start_server(directory, dict(os.environ), python=python)
    else:
        env = _python_env(dict(os.environ, **python_server.ENVIRONMENT.get(kind, {})), python)
        _SERVERS[kind, python] = start_server(
            directory, env, (str(REPO / "tests" / "python_server.py"), kind), python)
    return directory / "sock"


def _python_env(env: dict, python: str) -> dict:
    """``env`` for a ``python`` script or ``-c`` run: another interpreter than the tests' has
    odtd on ``PYTHONPATH`` (the repository), as the tests' own has it installed."""
    if python != sys.executable:
        env["PYTHONPATH"] = str(REPO)
    return env


def forked_python(kind: str, *args: str, env: dict | None = None, timeout: float = 240,
                  python: str | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` (``-c CODE ...``, ``-m MODULE ...`` or ``SCRIPT ...``) in REPO, its output
    captured as text, in ``env`` with the ``kind``'s own variables: forked from the server of
    that ``kind`` for that Python (tests/python_server.py: ``keras`` imported TensorFlow and
    Keras and nothing of odtd's, ``cli`` imported odtd's CLI; the shared ones where the run
    started them, else started at the first call; ``ODTD_TEST_FORK=0`` for none), or a fresh
    process."""
    python = python or _SERVER_PYTHON[kind]
    env = _python_env(dict(os.environ if env is None else env,
                           **python_server.ENVIRONMENT.get(kind, {})), python)
    return python_server.run(list(args), env, REPO, timeout, _server(kind, python), python)


def plain_python(*args: str, timeout: float = 240,
                 python: str | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` with TensorFlow's logging quiet, forked from the ``keras`` server (by
    default the workers' Python: the one with TensorFlow)."""
    return forked_python("keras", *args, timeout=timeout, python=python)


_VERSIONS: dict = {}


def worker_version(package: str) -> tuple:
    """(major, minor) of the workers' ``tensorflow`` or ``keras``."""
    if package not in _VERSIONS and WORKER_PYTHON == sys.executable:
        _VERSIONS[package] = importlib.metadata.version(package)
    if package not in _VERSIONS:  # Python 3.6 has no importlib.metadata: the package says
        proc = plain_python("-c", f"import {package}; print({package}.__version__)")
        assert proc.returncode == 0, proc.stderr[-2000:]
        _VERSIONS[package] = proc.stdout.split()[-1]
    return tuple(int(part) for part in _VERSIONS[package].split(".")[:2])


def worker_keras_major() -> int:
    """The major version of the workers' Keras (2: tf.keras 2; 3: Keras 3)."""
    return worker_version("keras")[0]


def native_suffix(suffix: str) -> str:
    """``suffix`` where the workers' Keras writes it (``models export``), else ``.h5``: a
    tf.keras before 2.13 writes no ``.keras`` files (make test-tx2's TensorFlow 2.6 and 2.7)."""
    if suffix == ".keras" and worker_keras_major() == 2 and worker_version("tensorflow") < (2, 13):
        return ".h5"
    return suffix


def bfloat16_refused(report: dict) -> bool:
    """Whether the TensorFlow of a ``tensorflow_report`` could not run bfloat16 here (its
    ``bfloat16_error``: ``odtd.trainer.plans.precision.bfloat16_error``). Only one before 2.9 may
    refuse: 2.6 and 2.7 have bfloat16 kernels for a CPU only with oneDNN, off by default there
    (`make test-tx2`'s stacks); from 2.9 on it is on, and a refusal fails the test."""
    error = report.get("bfloat16_error")
    if error is not None:
        assert tuple(int(part) for part in report["tensorflow"].split(".")[:2]) < (2, 9), error
    return error is not None


def trainer_python_yaml() -> str:
    """The ``trainer:`` section's line naming the workers' Python (nothing for the tests' own)."""
    return f"  python: {WORKER_PYTHON}\n" if WORKER_PYTHON != sys.executable else ""


def worker_home(root: Path) -> Path:
    """``root``, a home to create, with an ``odtd.yaml`` naming the workers' Python where it is not
    the tests' own (an existing one is kept)."""
    config = root / "odtd.yaml"
    if trainer_python_yaml() and not config.exists():
        root.mkdir(parents=True, exist_ok=True)
        config.write_text("trainer:\n" + trainer_python_yaml())
    return root


def worker_config():
    """The daemon configuration the tests' own sessions and jobs run with: the workers' Python."""
    from odtd.config import Config, TrainerConfig

    if WORKER_PYTHON == sys.executable:
        return Config()
    return Config(trainer=TrainerConfig(python=WORKER_PYTHON))


def _server(kind: str, python: str = sys.executable) -> Path | None:
    """The socket of the ``kind`` server for ``python``, listening (None: ``ODTD_TEST_FORK=0``)."""
    if os.environ.get("ODTD_TEST_FORK") == "0":
        return None
    shared = os.environ.get(SHARED_SERVER_VARIABLE.format(kind.upper()))
    path = Path(shared) if shared and python == _SERVER_PYTHON[kind] else None
    if path is None and (kind, python) in _SERVERS:
        path = Path(_SERVERS[kind, python].args[-1])
    if path is None:
        path = _start_server(kind, python)
    if path not in _LISTENING and listening(path):
        _LISTENING.add(path)
    return path


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
    """Run `odtctl` in a process of its own, the way a person does (a fork of the ``cli``
    server: ``forked_python``)."""
    env = dict(os.environ)
    if home is not None:
        env["ODTD_HOME"] = str(home)
        created = not Path(home).exists()
        if args[:1] == ("init",):
            worker_home(Path(home))
    proc = forked_python("cli", "-m", "odtd.cli", *args, env=env, timeout=timeout)
    if home is not None and created and proc.returncode != 0 and Path(home).exists() and \
            [path.name for path in Path(home).iterdir()] == ["odtd.yaml"]:
        shutil.rmtree(home)  # a refused init leaves nothing, but for worker_home's config
    if check and proc.returncode != 0:
        raise AssertionError(f"odtctl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def tensorflow_report(script: str, timeout: float = 240):
    """Run ``script`` in a child Python (TensorFlow stays out of the test process); the JSON it
    printed last."""
    proc = plain_python("-c", script, timeout=timeout)
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
