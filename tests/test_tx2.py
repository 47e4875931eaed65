"""A Jetson TX2's stack, run as its user runs it: the daemon on Python 3.8, the worker under another
interpreter (``trainer.python``: Python 3.6 with TensorFlow 2.6, or 3.7 with 2.7).

`make test-tx2` runs this file in its Python 3.8 venv (.venv-tx2-daemon, odtd installed there as
``pip install .`` installs it, not editable), with ``ODTD_TEST_WORKER_PYTHON`` naming a worker's
venv; the main suite skips it. Every command is the installed ``odtctl`` or ``odtd`` in a
process of its own, started in an empty directory with no ``PYTHONPATH``: nothing tells the
worker's interpreter where odtd is but odtd itself. Every worker is a fresh process (no worker
server), as under systemd. The exports are opened by plain Keras on both stacks: the worker's
tf.keras 2 and the main venv's Keras 3 on Python 3.11 (.venv, which `make test-tx2` builds).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, WORKER_PYTHON, wait_for, write_images

pytestmark = [
    pytest.mark.trains,
    pytest.mark.skipif(WORKER_PYTHON == sys.executable,
                       reason="make test-tx2 runs these: a worker under another interpreter "
                              "(ODTD_TEST_WORKER_PYTHON)"),
]

BIN = Path(sys.executable).parent  # the daemon's venv: its odtctl and odtd
KERAS3_PYTHON = REPO / ".venv" / "bin" / "python"  # Keras 3 on Python 3.11: the other stack
FIXTURES = REPO / "tests" / "fixtures" / "keras"
# A user's models: one Keras 3 wrote on Python 3.11 (.keras), one tf.keras 2 wrote (.h5), as
# tests/make_keras_models.py wrote them (its .ref.npz: probe images and the writer's outputs).
MODELS = {
    "densenet40": None,
    "keras3_cnn_softmax": (FIXTURES / "k3" / "cnn_softmax.keras", "cat,dog,owl,fox"),
    "keras2_gray_logits": (FIXTURES / "k2" / "gray_logits.h5", "red,green,blue"),
}
POLICY = """\
# Small sessions on the TX2's stack: precision auto (fp32 where bfloat16 cannot run, and why),
# recomputation on, BatchNorm recalibrated (the passes outside a step run pooling first).
batch:
  size: 8
training:
  epochs: 1
  optimizer: sgd
  learning_rate: 0.01
  momentum: 0.9
  augment: true
  precision: auto
  recompute: "on"
  recalibrate_bn: true
  max_samples_per_session: 48
replay:
  ratio: 1.0
  capacity_samples: 200
  max_samples: 24
acceptance:
  tolerance: 1.0
"""
PREDICT = r"""
import json, sys
import numpy as np
try:
    import keras
    load = keras.models.load_model
except ImportError:  # tf.keras 2.6 and 2.7 keep it under tensorflow
    import tensorflow as tf
    load = tf.keras.models.load_model
for path, images in zip(sys.argv[1::2], sys.argv[2::2]):
    x = np.load(images)["x"].astype("float32")
    print(json.dumps(load(path, compile=False).predict(x, verbose=0).tolist()))
"""


def user_env(home: Path | None = None) -> dict:
    """The environment a person's shell (or systemd) gives: none of the tests' own variables."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("PYTHON", "ODTD_", "TF_NUM_"))}
    if home is not None:
        env["ODTD_HOME"] = str(home)
    return env


def odtctl(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "odtctl"), *args], capture_output=True, text=True,
                          env=user_env(home), cwd=home.parent, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"odtctl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def odtctl_json(home: Path, *args: str):
    return json.loads(odtctl(home, *args, "--json").stdout)


def predictions(python: Path | str, pairs: list) -> list:
    """Each (model file, images .npz) loaded and run by plain Keras under ``python``."""
    env = dict(user_env(), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([str(python), "-c", PREDICT, *[str(p) for pair in pairs for p in pair]],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [np.array(json.loads(line)) for line in proc.stdout.strip().splitlines()[-len(pairs):]]


def worker_stack() -> dict:
    """The worker interpreter's own Python, numpy and TensorFlow versions."""
    code = ("import json, sys, numpy, tensorflow as tf; print(json.dumps({'python': "
            "'%d.%d.%d' % sys.version_info[:3], 'numpy': numpy.__version__, "
            "'tensorflow': tf.__version__}))")
    proc = subprocess.run([WORKER_PYTHON, "-c", code], capture_output=True, text=True,
                          env=dict(user_env(), TF_CPP_MIN_LOG_LEVEL="3"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The odtd package the daemon's venv runs: installed, not the checkout (an editable install
    or the repository on the path would hide a package that lacks a file)."""
    proc = subprocess.run([sys.executable, "-c", "import odtd; print(odtd.__file__)"],
                          capture_output=True, text=True, env=user_env(),
                          cwd=tmp_path_factory.mktemp("nowhere"), check=True)
    package = Path(proc.stdout.strip()).parent
    assert "site-packages" in package.parts and package != REPO / "odtd", package
    return package


def new_home(root: Path) -> Path:
    home = root / "home"
    home.mkdir(parents=True)
    (home / "odtd.yaml").write_text(f"""\
schedule:
  cron: "0 2 1 1 *"
inbox:
  scan_interval_s: 0.5
heartbeat_interval_s: 0.5
trainer:
  python: {WORKER_PYTHON}
""")
    return home


def test_doctor_reports_the_worker_stack_and_the_fix_for_a_missing_part(tmp_path, installed):
    home = new_home(tmp_path)
    stack = worker_stack()
    found = odtctl_json(home, "doctor")
    assert found["ok"] is True and found["problems"] == []
    assert found["origin"] == f"trainer.python in {home / 'odtd.yaml'}"
    assert (found["python"], found["numpy"], found["tensorflow"]) == (
        stack["python"], stack["numpy"], stack["tensorflow"])
    # The daemon's own odtd package, and none of its environment: numpy is the worker's.
    assert found["odtd_path"] == str(installed) and found["worker_error"] is None
    import numpy as daemon_numpy

    assert found["numpy"] != daemon_numpy.__version__
    text = odtctl(home, "doctor").stdout.splitlines()
    assert text[0].split()[:2] == ["interpreter", WORKER_PYTHON]
    assert [line.split()[0] for line in text[1:]] == [
        "python", "odtd", "numpy", "tensorflow", "keras", "gpu", "worker"]
    assert f"keras       {found['keras']} (tf.keras 2)" in text
    # The daemon's own Python has no TensorFlow: said, with the fix, and exit status 1.
    missing = odtctl(home, "doctor", "--python", sys.executable, check=False)
    assert missing.returncode == 1
    assert "tensorflow  missing (No module named 'tensorflow'); fix: install TensorFlow >= 2.6" \
        in missing.stdout
    assert [line for line in missing.stderr.splitlines() if line.startswith("Error:")] == [
        f"Error: the worker cannot run under {sys.executable}: tensorflow missing "
        "(No module named 'tensorflow')"]


@pytest.mark.parametrize("model", list(MODELS))
def test_a_session_through_the_daemon_then_profile_and_an_export_both_kerases_open(
        tmp_path, installed, model):
    home = new_home(tmp_path)
    source = MODELS[model]
    classes = (source[1] if source else "airplane,automobile,bird,cat,deer").split(",")
    write_images(tmp_path / "validation", per_class=3, classes=classes, seed=1)
    write_images(tmp_path / "day1", per_class=8, classes=classes, seed=2)
    args = (["--model", model, "--classes", ",".join(classes)] if source is None else
            ["--model-file", str(source[0]), "--classes", source[1]])
    summary = json.loads(odtctl(home, "init", *args, "--validation", str(tmp_path / "validation"),
                                "--json").stdout)
    assert summary["validation_samples"] == 3 * len(classes)
    (home / "policy.yaml").write_text(POLICY)
    assert odtctl_json(home, "ingest", str(tmp_path / "day1"))["rejected"] == 0

    # A session through the daemon's socket, its worker started by the daemon's session child.
    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen([str(BIN / "odtd"), "run"], stdout=log, stderr=subprocess.STDOUT,
                              env=user_env(home), cwd=tmp_path)
    try:
        assert wait_for(lambda: (home / "run" / "odtd.sock").exists() or daemon.poll() is not None,
                        60) and daemon.poll() is None, (tmp_path / "daemon.log").read_text()
        session = odtctl_json(home, "train-now", "--wait")
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=120)
        log.close()
    assert code == 0, (tmp_path / "daemon.log").read_text()[-3000:]
    assert session["trigger"] == "socket" and session["steps"] > 0, session
    assert session["outcome"] in ("promoted", "rolled_back"), session["reason"]
    details = session["details"]
    assert details["admission"]["recompute"] == 1.0
    # Precision auto on this stack's CPU: fp32, and the session says why.
    assert details["precision"] == "fp32"
    assert ("bfloat16 convolutions cannot run on this CPU with TensorFlow"
            in details["precision_reason"]
            or details["precision_reason"] == "no bfloat16 instructions on this CPU"), details

    profile = odtctl_json(home, "profile", "--batch-sizes", "4,8", "--steps", "2")
    rows = profile["rows"]
    assert [(row["batch_size"], row["status"]) for row in rows] == [(4, "ok"), (8, "ok")], rows
    assert all(row["samples_per_s"] > 0 and row["peak_memory_mb"] > 100 for row in rows)
    assert {row["precision_resolved"] for row in rows} == {"fp32"}

    version = odtctl_json(home, "status")["model"]["version"]
    current, v0 = tmp_path / "current.h5", tmp_path / "v0.h5"
    odtctl(home, "models", "export", str(version), "--out", str(current))
    odtctl(home, "models", "export", "0", "--out", str(v0))
    refused = odtctl(home, "models", "export", "0", "--out", str(tmp_path / "v0.keras"),
                     check=False)
    assert refused.returncode == 1 and not (tmp_path / "v0.keras").exists()
    assert "writes no .keras files (tf.keras 2.13 and later do); export as .h5" in refused.stderr
    shape = summary["input_shape"]
    probe = tmp_path / "probe.npz"
    np.savez(probe, x=np.random.default_rng(3).integers(0, 256, (6, *shape), dtype=np.uint8))
    pairs = [(current, probe), (v0, probe)]
    if source is not None:  # the user's probe images and what their own Keras predicted
        pairs.append((v0, source[0].with_suffix(".ref.npz")))
    assert KERAS3_PYTHON.exists(), "make test-tx2 builds .venv (Keras 3) to open the exports"
    on_worker, on_keras3 = predictions(WORKER_PYTHON, pairs), predictions(KERAS3_PYTHON, pairs)
    for ours, theirs in zip(on_worker, on_keras3):
        assert ours.shape[1] == len(classes) and np.abs(ours - theirs).max() < 1e-5
    if source is not None:
        reference = np.load(source[0].with_suffix(".ref.npz"))["y"]
        assert np.abs(on_worker[2] - reference).max() < 1e-5  # imported exactly, on this stack
        assert np.abs(on_keras3[2] - reference).max() < 1e-5  # and its export opens in Keras 3
