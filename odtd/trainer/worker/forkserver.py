"""Workers forked from one process that imported TensorFlow once (``ODTD_WORKER_SERVER``).

Importing TensorFlow and Keras is most of what a short job costs: 4 to 6 s of CPU on the
development machine, where the test suite starts over 160 workers. ``python -m
odtd.trainer.worker.forkserver SOCKET`` imports them once, with the worker's environment defaults, and
listens on the Unix socket SOCKET. With ``ODTD_WORKER_SERVER=SOCKET`` in its environment,
``python -m odtd.trainer.worker JOB.json`` hands its job to the server (``handed_over``) and
stays as its stand-in: the server forks, the fork takes over the stand-in's standard input,
output and error, working directory, environment and arguments, and runs the worker's ``main``;
the stand-in passes on the signals it gets (the stop request, SIGTERM) and exits as the fork
did, so whoever started it (``launch.WorkerRun``) sees a worker. The fork exits 3 when the
stand-in dies, and watches the job's ``parent_pid`` as the stand-in's parent.

The server runs a job only for a worker it could be: the same Python and the same
TensorFlow-related environment (``IMPORT_ENVIRONMENT``, read at import). Otherwise, or with no
server listening yet, the worker runs the job itself, as without the variable. The daemon never
sets it: one session a day does not pay for a TensorFlow process kept in memory all day. The
test suite does (``tests/conftest.py``). A fork's peak memory counts only the pages it touches
after the fork, not the libraries and imports it shares with the server (tinycnn's train job:
275 MB forked against 581 MB fresh), so no memory figure is taken under a server. Nothing the
server imports may run a TensorFlow operation: a fork of a process whose runtime has started its
thread pools would wait on locks held by threads it does not have.

What a server imports and what its forks run is a ``Program``; the worker's is the default. The
tests serve others with the same machinery (tests/python_server.py: their ``odtctl`` calls, and
checks that need TensorFlow and Keras but nothing of odtd's), asking with ``request_fork``.
Standard library only; Python 3.6-compatible.
"""

import array
import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from odtd.trainer.protocol.procfs import parent_of, watch_parent

SERVER_VARIABLE = "ODTD_WORKER_SERVER"
# Environment variables TensorFlow, Keras, oneDNN, the loader or Python read when they are
# imported: a fork runs with the server's reading of them, so a worker whose own differ runs itself.
IMPORT_ENVIRONMENT = ("TF_", "KERAS_", "CUDA_", "XLA_", "OMP_", "MKL", "ONEDNN", "LD_", "PYTHON")
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# What a server runs unless told otherwise: the trainer worker (odtd/trainer/worker/process.py).
WORKER_PROGRAM = "odtd.trainer.worker.process:WorkerProgram"
_FD_COUNT = 4  # stdin, stdout, stderr, and the read end of the stand-in's liveness pipe
_MAX_REQUEST = 1 << 20


def import_environment(env: Dict[str, str], defaults: Dict[str, str]) -> Dict[str, str]:
    """The variables of ``env`` that importing TensorFlow reads, ``defaults`` where unset."""
    chosen = dict(defaults)
    chosen.update(env)
    return {name: value for name, value in chosen.items() if name.startswith(IMPORT_ENVIRONMENT)}


class Program(object):
    """What a server imports once, and what each of its forks runs.

    The server takes its program by name (``load_program``), so this module imports nothing of
    what it serves: the worker's is ``WORKER_PROGRAM``, in the worker's own module.
    """

    def environment_defaults(self) -> Dict[str, str]:
        """Variables a fresh process sets, where unset, before it imports TensorFlow."""
        return {}

    def prepare(self) -> None:
        """Import, in the server, what each fork would otherwise import (no operation run)."""

    def run(self, args: List[str], watch: Callable[[int], None]) -> int:
        """Run the job in a fork that took on the client's files, place and environment.

        ``args`` are the program's command-line arguments; ``watch`` watches a parent pid.
        """
        raise NotImplementedError


def load_program(name: str) -> Program:
    """The program named ``MODULE:CLASS``, imported and built (no arguments)."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)()


# --- the stand-in: the worker process that hands its job over ---

def handed_over(args: List[str]) -> Optional[int]:
    """Run this worker's job in a fork of the server named by ``ODTD_WORKER_SERVER``.

    Returns:
        The fork's exit status, to exit with (a fork killed by a signal: this process kills
        itself with the same signal); None when no server took the job, which this process then
        runs itself.
    """
    path = os.environ.get(SERVER_VARIABLE)
    if not path:
        return None
    target = []  # type: List[int]  # the fork's pid, once known
    pending = []  # type: List[int]  # signals that came before it

    def forward(signum: int, frame: Any) -> None:
        if target:
            _kill(target[0], signum)
        else:
            pending.append(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    fork = request_fork(path, args, dict(os.environ), os.getcwd(), [0, 1, 2])
    if fork.pid is None:  # no server, or it refused
        if fork.refused is not None:
            print("odtd worker: the worker server cannot run this job ({}); running it here"
                  .format(fork.refused), file=sys.stderr, flush=True)
        fork.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in pending:
            os.kill(os.getpid(), signum)
        return None
    target.append(fork.pid)
    for signum in pending:
        _kill(fork.pid, signum)
    code = fork.ended()  # this process holds the liveness pipe open until it exits
    if code is None:
        print("odtd worker: the worker server closed before worker {} ended".format(fork.pid),
              file=sys.stderr)
        return 1
    if code < 0:
        sys.stdout.flush()
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # their handlers cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal whose default is not to end the process
    return code


class Fork(object):
    """A run asked of a server (``request_fork``).

    ``pid`` is the fork's once one runs; None when the server refused (``refused`` says why)
    or none answered. The fork exits 3 once ``close`` (or this process's end) closes the
    liveness pipe whose read end it was given.
    """

    def __init__(self, connection: socket.socket, alive: int, sent: bool) -> None:
        self._connection = connection
        self._replies = connection.makefile("rb")
        self._alive = alive
        reply = self._read() if sent else {}
        self.pid = int(reply["pid"]) if "pid" in reply else None  # type: Optional[int]
        self.refused = reply.get("refused")  # type: Optional[str]

    def ended(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait for the fork's exit status (minus the signal that killed it).

        None if the server closed first; ``socket.timeout`` after ``timeout`` seconds.
        """
        self._connection.settimeout(timeout)
        code = self._read().get("returncode")
        return None if code is None else int(code)

    def close(self) -> None:
        """Close the connection and the liveness pipe."""
        self._replies.close()
        self._connection.close()
        if self._alive >= 0:
            os.close(self._alive)
            self._alive = -1

    def _read(self) -> Dict[str, Any]:
        try:
            return json.loads(self._replies.readline().decode("utf-8") or "{}")
        except socket.timeout:
            raise
        except (OSError, ValueError):
            return {}


def request_fork(path: str, args: List[str], env: Dict[str, str], cwd: str, stdio: List[int],
                 executable: str = sys.executable) -> Fork:
    """Ask the server listening on ``path`` to fork a run of ``args`` in ``env`` and ``cwd``.

    The descriptors ``stdio`` become its standard input, output and error; ``executable`` is the
    Python the run is for (a server runs only its own).
    """
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    alive_read, alive_write = os.pipe()  # the fork sees end-of-file on it when we are gone
    try:
        connection.connect(path)
        request = {"args": list(args), "env": env, "cwd": cwd, "executable": executable,
                   "pid": os.getpid()}
        connection.sendmsg([json.dumps(request).encode("utf-8") + b"\n"], [(
            socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", list(stdio) + [alive_read]))])
        sent = True
    except OSError:  # no server listening
        sent = False
    finally:
        os.close(alive_read)
    return Fork(connection, alive_write, sent)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # it has ended; the server reports how


# --- the server ---

def serve(path: str, program: Optional[Program] = None) -> None:
    """Import what ``program`` imports (the worker's by default), then fork a run of it per job.

    Jobs are handed over on the Unix socket ``path``.
    """
    program = program or load_program(WORKER_PROGRAM)
    started = time.monotonic()
    defaults = program.environment_defaults()
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    program.prepare()
    expected = import_environment(dict(os.environ), defaults)
    # The waiters below are reaped by the kernel; a stop request before the worker's own
    # handler is set is ignored, as it is before a fresh worker's.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for stale in (path, path + ".new"):  # a server's that was killed
        if os.path.exists(stale):
            os.unlink(stale)
    listener.bind(path + ".new")
    listener.listen(64)
    os.replace(path + ".new", path)  # clients connect only once it listens
    print("odtd worker server: listening on {} (pid {}; the imports took {:.1f} s)".format(
        path, os.getpid(), time.monotonic() - started), file=sys.stderr, flush=True)
    try:
        while True:
            connection, _ = listener.accept()
            fds = []  # type: List[int]
            try:
                request, fds = _receive(connection)
                refusal = _refusal(request, expected, defaults)
                if refusal is not None:
                    _send(connection, refused=refusal)
                elif os.fork() == 0:
                    listener.close()
                    _supervise(connection, request, fds, program)  # never returns
            except (OSError, ValueError) as error:
                print("odtd worker server: {}".format(error), file=sys.stderr, flush=True)
            finally:
                for fd in fds:
                    os.close(fd)
                connection.close()
    finally:
        listener.close()
        if os.path.exists(path):
            os.unlink(path)


def _receive(connection: socket.socket):
    """The request (a JSON line) and the four descriptors that came with it."""
    fds = array.array("i")
    size = socket.CMSG_LEN(_FD_COUNT * fds.itemsize)
    data, ancillary, _, _ = connection.recvmsg(_MAX_REQUEST, size)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    received = list(fds)
    while not data.endswith(b"\n"):
        more = connection.recv(_MAX_REQUEST)
        if not more or len(data) > _MAX_REQUEST:
            break
        data += more
    if len(received) != _FD_COUNT:
        for fd in received:
            os.close(fd)
        raise ValueError("a request came with {} descriptors, not {}".format(
            len(received), _FD_COUNT))
    try:
        return json.loads(data.decode("utf-8")), received
    except ValueError:
        for fd in received:
            os.close(fd)
        raise


def _refusal(request: Dict[str, Any], expected: Dict[str, str],
             defaults: Dict[str, str]) -> Optional[str]:
    """Why this server cannot run the request as that process would run itself, or None."""
    if request.get("executable") != sys.executable:
        return "another Python ({})".format(request.get("executable"))
    differing = sorted(set(expected.items())
                       ^ set(import_environment(request["env"], defaults).items()))
    if differing:
        return "another environment for TensorFlow ({})".format(
            ", ".join(sorted({name for name, _ in differing})))
    return None


def _send(connection: socket.socket, **fields: Any) -> None:
    connection.sendall(json.dumps(fields).encode("utf-8") + b"\n")


def _supervise(connection: socket.socket, request: Dict[str, Any], fds: List[int],
               program: Program) -> None:
    """In a fork of the server: fork the run, tell the client its pid, then how it ended."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this process waits for its worker
        pid = os.fork()
        if pid == 0:
            connection.close()
            _become(request, fds, program)  # never returns
        for fd in fds:
            os.close(fd)
        _send(connection, pid=pid)
        started = time.monotonic()
        _, status, usage = os.wait4(pid, 0)
        returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print("odtd worker server: worker {} ({:.200}) exited {} after {:.1f} s, {:.1f} s of CPU"
              .format(pid, " ".join(request["args"]), returncode, time.monotonic() - started,
                      usage.ru_utime + usage.ru_stime), file=sys.stderr, flush=True)
        code = 0
        try:
            _send(connection, returncode=returncode)
        except OSError:
            pass  # the stand-in is gone (which is why its worker ended): no one to tell
    except BaseException:  # nothing may unwind into the server's loop in a fork
        traceback.print_exc()
    finally:
        os._exit(code)


def _become(request: Dict[str, Any], fds: List[int], program: Program) -> None:
    """In the run's fork: take on the client's files, place and environment; run the job."""
    code = 1
    try:
        os.setsid()
        for fd, standard in zip(fds[:3], (0, 1, 2)):
            os.dup2(fd, standard)
        for fd in fds[:3]:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stand_in, alive = int(request["pid"]), fds[3]

        def watch(parent_pid: int) -> None:
            watch_parent(parent_pid, lambda: parent_of(stand_in))

        threading.Thread(target=_exit_when_closed, args=(alive,), name="stand-in-watch",
                         daemon=True).start()
        code = program.run(request["args"], watch)
    except SystemExit as exit_:
        code = _exit_status(exit_.code)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_status(value: Any) -> int:
    """The status Python exits with on ``sys.exit(value)``, printing a message it was given."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _exit_when_closed(fd: int) -> None:
    """Exit 3 (parent gone) once the stand-in, the only writer of ``fd``'s pipe, is gone."""
    while os.read(fd, 1):
        pass
    print("odtd worker: the process that started it is gone, exiting", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m odtd.trainer.worker.forkserver SOCKET [MODULE:PROGRAM]")
    serve(sys.argv[1], load_program(sys.argv[2]) if len(sys.argv) == 3 else None)
