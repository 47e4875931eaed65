"""Another interpreter as the worker's (``trainer.python``): how odtd starts it, and `odtctl doctor`.

The interpreter here is this one behind a wrapper that starts it without its site-packages
(``python -S``): odtd, installed there, is then reachable only the way odtd hands it to another
interpreter, and numpy (and TensorFlow) not at all. `make test-tx2` runs the real thing, a Python
3.6 with TensorFlow 2.6 beside a Python 3.8 daemon (tests/test_tx2.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, odtctl

from odtd.config import TrainerConfig


def bare_python(tmp_path: Path) -> Path:
    """An interpreter without site-packages: no odtd, no numpy, unless odtd hands it over."""
    wrapper = tmp_path / "python-bare"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_another_interpreter_imports_the_daemons_own_odtd_package_and_nothing_else(tmp_path):
    python = bare_python(tmp_path)
    plain = subprocess.run([str(python), "-c", "import odtd"], capture_output=True, text=True,
                           cwd=tmp_path)
    assert plain.returncode == 1 and "No module named 'odtd'" in plain.stderr
    command = TrainerConfig(python=str(python)).command("odtd.trainer.worker.stack")
    assert command[:2] == [str(python), "-c"] and len(command) == 3  # the shape of -m MODULE
    assert TrainerConfig().command() == [sys.executable, "-m", "odtd.trainer.worker"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["odtd_path"] == str(REPO / "odtd")  # this process's package, by path
    assert found["numpy"] is None and found["numpy_error"] == "No module named 'numpy'"


def test_doctor_names_what_is_missing_and_the_fix_in_one_line_each(tmp_path):
    python = bare_python(tmp_path)
    proc = odtctl("doctor", "--python", str(python), home=tmp_path / "home", check=False)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0] == f"interpreter {python} (--python)"
    assert lines[1].startswith("python      {}.{}.".format(*sys.version_info[:2]))
    assert lines[2] == f"odtd        0.1.0 from {REPO / 'odtd'} (the daemon's)"
    assert lines[3] == (f"numpy       missing (No module named 'numpy'); fix: {sys.executable} -m "
                        "pip install numpy")
    assert [line for line in proc.stderr.splitlines() if line.startswith("Error:")] == [
        f"Error: the worker cannot run under {python}: numpy missing (No module named 'numpy')"]
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "odtd.yaml").write_text("trainer:\n  python: /no/such/python3.6\n")
    gone = odtctl("doctor", "--json", home=tmp_path / "home", check=False)
    assert gone.returncode == 1 and json.loads(gone.stdout)["problems"] == [
        "/no/such/python3.6: no such file"]
    assert gone.stderr.splitlines()[-1].startswith(
        "Error: the worker's interpreter does not run odtd: /no/such/python3.6: no such file. "
        f"Set trainer.python in {tmp_path / 'home' / 'odtd.yaml'}")


@pytest.mark.trains
def test_the_worker_stack_imports_every_module_a_worker_server_imports(tmp_path):
    # Every module a worker needs, by its dotted name (WORKER_MODULES): a path missed in a move
    # is a worker_error here, on this stack, before a TX2's doctor finds it.
    command = TrainerConfig().command("odtd.trainer.worker.stack")
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["tensorflow"] and found["worker_error"] is None
