"""Project-wide promises: lean imports, help everywhere, docs/cli.md in step, shipped policies valid."""

import argparse
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
    return sub.choices


# Options every command shares (docs/cli.md says them once, at the top).
COMMON_OPTIONS = {"-h", "--help", "--home", "--json"}


def _cli_doc_section(name):
    """Return the text of docs/cli.md under the heading that names `odtctl NAME`."""
    sections = re.split(r"^## ", (REPO / "docs" / "cli.md").read_text(), flags=re.M)
    found = [text for text in sections if f"`odtctl {name}`" in text.splitlines()[0]]
    assert found, f"docs/cli.md has no section headed `odtctl {name}`"
    return found[0]


def _undocumented(parser, text):
    """Return the options and choices of `parser` (and its sub-actions) that `text` never names."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for action_name, subparser in action.choices.items():
                if f"odtctl {parser.prog.split()[-1]} {action_name}" not in text:
                    missing.append(action_name)
                missing += _undocumented(subparser, text)
            continue
        missing += [o for o in action.option_strings if o.startswith("--") and o not in COMMON_OPTIONS
                    and not re.search(re.escape(o) + r"\b", text)]
        if not action.option_strings and action.choices:
            missing += [str(c) for c in action.choices if not re.search(rf"\b{re.escape(str(c))}\b", text)]
    return missing


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_has_help_and_is_documented_in_docs_cli(name):
    proc = odtctl(name, "--help")
    assert "usage: odtctl" in proc.stdout and len(proc.stdout.splitlines()) > 3
    # Each command has its section in docs/cli.md, which names every option and action it takes.
    assert _undocumented(_commands()[name], _cli_doc_section(name)) == []


def test_daemon_has_help():
    proc = subprocess.run([sys.executable, "-m", "odtd.daemon.service", "run", "--help"],
                          capture_output=True, text=True, check=True)
    assert "--config" in proc.stdout


@pytest.mark.parametrize("path", sorted((REPO / "policies").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_policy_validates(path):
    load_policy(path, missing_ok=False)
