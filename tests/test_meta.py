"""Project-wide promises: lean imports, help everywhere, README in step, shipped policies valid."""

import re
import subprocess
import sys

import pytest
from conftest import REPO, odtctl

from odtd.cli import build_parser
from odtd.policy import load_policy


def test_importing_cli_and_daemon_loads_no_tensorflow():
    code = ("import sys, odtd.cli, odtd.daemon.service, odtd.session.runner, odtd.sim.simulate, "
            "odtd.profiling.sweep; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'keras', 'jtop'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_idle_daemon_imports_no_session_machinery():
    # What only a session needs (numpy, sqlite-utils, Pillow, telemetry) runs in child processes:
    # importing them would put 20 MB more into the idle daemon.
    code = ("import sys, odtd.daemon.service; print(sorted({m.split('.')[0] for m in sys.modules}"
            " & {'numpy', 'sqlite_utils', 'PIL', 'tensorflow'}), 'odtd.telemetry' in sys.modules,"
            " 'odtd.store.database' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False False"


def test_the_worker_compiles_only_through_networks_compiled():
    # One place decides how the worker compiles (without AutoGraph); a bare tf.function elsewhere
    # would bring back the conversion and its source reads.
    compiling = re.compile(r"@tf\.function|tf\.function\(")
    uses = {str(path.relative_to(REPO)): len(compiling.findall(path.read_text()))
            for path in (REPO / "odtd").rglob("*.py")}
    assert {path: count for path, count in uses.items() if count} == {"odtd/trainer/models/networks.py": 1}


def _commands():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sorted(sub.choices)


@pytest.mark.parametrize("name", _commands())
def test_every_command_has_help_and_is_in_the_readme(name):
    proc = odtctl(name, "--help")
    assert "usage: odtctl" in proc.stdout and len(proc.stdout.splitlines()) > 3
    assert f"odtctl {name}" in (REPO / "README.md").read_text()


def test_daemon_has_help():
    proc = subprocess.run([sys.executable, "-m", "odtd.daemon.service", "run", "--help"],
                          capture_output=True, text=True, check=True)
    assert "--config" in proc.stdout


@pytest.mark.parametrize("path", sorted((REPO / "policies").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_policy_validates(path):
    load_policy(path, missing_ok=False)
