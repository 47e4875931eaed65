"""The tests' forked Python processes (tests/python_server.py) behave as fresh ones."""

import os
import subprocess
import sys

import pytest
import python_server
from conftest import REPO, _server, dealt_longest_first, listening, start_server

SCRIPT = "import os, sys\nprint(sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n"
COMMANDS = [
    ("-c", "import sys; print(sys.argv); print('to stderr', file=sys.stderr); sys.exit(3)", "a b"),
    ("-c", "import sys; sys.exit('a message for stderr')"),
    ("-c", "import sys; sys.exit()"),
    ("-c", "import os; print(os.getcwd(), os.environ['ODTD_PROBE'])"),
    ("-c", "import atexit; atexit.register(print, 'at exit'); print('first')"),
    ("-c", "import threading, time\n"
           "threading.Thread(target=lambda: (time.sleep(0.3), print('joined'))).start()"),
    ("-m", "json.tool", "--help"),
    ("-m", "odtd.cli", "--version"),
    ("-m", "odtd.cli", "status", "--home"),  # an argparse error: status 2
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The suite's ``cli`` server, or where the suite's are off this module's own."""
    shared = _server("cli")
    if shared is not None:
        yield shared
        return
    directory = tmp_path_factory.mktemp("cli")
    own = start_server(directory, dict(os.environ), (str(REPO / "tests" / "python_server.py"), "cli"))
    assert listening(directory / "sock"), (directory / "server.log").read_text()
    yield directory / "sock"
    own.terminate()
    own.wait(timeout=60)


@pytest.mark.parametrize("args", COMMANDS, ids=lambda args: " ".join(args)[:40])
def test_a_forked_command_line_runs_as_a_fresh_python(server, args):
    env = dict(os.environ, ODTD_PROBE="probe")
    fresh = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                           cwd=REPO, timeout=60)
    forked = python_server._forked(list(args), env, REPO, 60, server)
    assert forked is not None, "the server refused the run"
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_forked_script_and_an_exception(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    crash = ("-c", "def f():\n    raise ValueError('boom')\nf()")
    for args in [(str(script), "x"), crash]:
        fresh = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                               cwd=REPO, timeout=60)
        forked = python_server._forked(list(args), dict(os.environ), REPO, 60, server)
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
        assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
    assert "ValueError: boom" in forked.stderr and 'line 2, in f' in forked.stderr


def test_another_tensorflow_environment_runs_fresh(server):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")
    assert python_server._forked(["-c", "pass"], env, REPO, 60, server) is None
    # A fresh interpreter: nothing the server imported is there.
    done = python_server.run(["-c", "import sys; print('sqlite_utils' in sys.modules)"], env,
                             REPO, 60, server)
    assert (done.returncode, done.stdout) == (0, "False\n")


def test_the_longest_tests_are_dealt_out_first_to_each_pytest_worker():
    durations = {"a": 1, "b": 50, "c": 3, "d": 40, "e": 0, "f": 30, "g": 0}
    order = dealt_longest_first(list("abcdefg"), durations.get, 3)
    # pytest-xdist gives the three workers consecutive runs, here b c g / d a / f e: each
    # starts with one of the three longest.
    assert order == ["b", "c", "g", "d", "a", "f", "e"]
    assert sorted(order) == sorted(durations)
    assert dealt_longest_first(list("abc"), durations.get, 1) == ["b", "c", "a"]
