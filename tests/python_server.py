"""Python processes forked from one that imported their heavy modules once, for the tests.

The suite starts hundreds of short Python processes. Two kinds spend most of their CPU importing:
``odtctl`` (pydantic, sqlite-utils, numpy: about 0.6 s of CPU a call on the development machine)
and the checks that use Keras from outside odtd (a model file loaded by plain Keras, a network
built and counted, a gradient compared with Keras's own layer: 4 to 6 s importing TensorFlow).
``python tests/python_server.py KIND SOCKET`` imports KIND's modules (``KINDS``) and serves
``run`` on the Unix socket SOCKET: each call
is a fork that runs a Python command line (``-c CODE ARGS``, ``-m MODULE ARGS`` or ``SCRIPT
ARGS``) as a fresh interpreter would, on odtd's worker server's machinery
(odtd/trainer/worker/forkserver.py): its own process, arguments, environment, working directory and
files; non-daemon threads joined and exit handlers run at the end. A call for another Python or
another TensorFlow environment, or with no server listening, runs in a fresh process.

The servers ``tests/conftest.py`` starts: ``keras`` imports TensorFlow and Keras and nothing of
odtd's (so plain Keras is what loads a file), ``cli`` imports ``odtd.cli`` and the libraries
every command uses (no TensorFlow).
"""

# No `from __future__ import annotations`: the servers of `make test-tx2` run on Python 3.6.
import atexit
import importlib
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Callable, Optional

from odtd.trainer.worker import forkserver

# What each kind of server imports before it forks, and the environment it and its runs get
# beside the caller's (runs in another TensorFlow environment are refused).
KINDS = {"keras": ("tensorflow", "keras"),
         "cli": ("odtd.cli", "numpy", "sqlite_utils", "PIL.Image", "yaml")}
ENVIRONMENT = {"keras": {"TF_CPP_MIN_LOG_LEVEL": "2"}}


class PlainPython(forkserver.Program):
    """Import ``modules``; run each fork's arguments as Python's command line."""

    def __init__(self, modules: tuple) -> None:
        self.modules = modules

    def environment_defaults(self) -> dict:
        return {}

    def prepare(self) -> None:
        for module in self.modules:
            importlib.import_module(module)

    def run(self, args: list, watch: Callable[[int], None]) -> int:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # the server ignores it, Python does not
        try:
            if args[0] == "-c":
                sys.argv = ["-c", *args[2:]]
                sys.path[0] = ""
                exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
            elif args[0] == "-m":
                sys.argv = [args[1], *args[2:]]  # runpy puts the module's file first
                sys.path[0] = os.getcwd()
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(args)
                sys.path[0] = str(Path(args[0]).resolve().parent)
                runpy.run_path(args[0], run_name="__main__")
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as error:  # as Python prints it: without this function's frame
            traceback.print_exception(type(error), error, error.__traceback__.tb_next)
            return 1
        finally:  # what Python does before it exits
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
            atexit._run_exitfuncs()
        return 0


def run(args: list, env: dict, cwd: Path, timeout: float, server: Optional[Path],
        python: str = sys.executable) -> subprocess.CompletedProcess:
    """``subprocess.run([python, *args], capture_output=True, text=True, ...)``, forked from
    ``server`` where it can take the run."""
    if server is not None:
        done = _forked(args, env, cwd, timeout, server, python)
        if done is not None:
            return done
    return subprocess.run([python, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def _forked(args, env, cwd, timeout, server,
            python=sys.executable) -> Optional[subprocess.CompletedProcess]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            open(os.devnull, "rb") as null:
        fork = forkserver.request_fork(str(server), list(args), env, str(cwd),
                                       [null.fileno(), out.fileno(), err.fileno()], python)
        try:
            if fork.pid is None:
                return None
            try:
                code = fork.ended(timeout)
            except socket.timeout:
                os.kill(fork.pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired([python, *args], timeout) from None
        finally:
            fork.close()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            [python, *args], 1 if code is None else code,
            out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace"))


if __name__ == "__main__":
    forkserver.serve(sys.argv[2], PlainPython(KINDS[sys.argv[1]]))
