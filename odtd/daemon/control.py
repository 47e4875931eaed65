"""The control socket: versioned JSON request/reply over a Unix stream socket.

One request per connection, one JSON object per line each way:

    -> {"v": 1, "op": "train-now", "args": {"wait": true, "force": false}}
    <- {"v": 1, "ok": true, "result": {...}}   or   {"v": 1, "ok": false, "error": "..."}

Every request gets a reply, errors included. Operations: ping, status, train-now, pause,
resume, reload, federated-session (a Flower round's session: odtd.session.federated),
federated-evaluate (a Flower evaluate round: odtd.session.federated_evaluation).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from odtd.errors import DaemonUnavailable, OdtdError
from odtd.home.paths import Home

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
OPERATIONS = ("ping", "status", "train-now", "pause", "resume", "reload", "federated-session",
              "federated-evaluate")
MAX_REQUEST_BYTES = 64 * 1024
CLIENT_TIMEOUT_S = 10.0  # a client must send its request line within this long
REPLY_TIMEOUT_S = 10.0
NO_DAEMON_HINT = ("run it in this process with `odtctl train-now --foreground`, or start the daemon "
                  "with `systemctl start odtd` (or `odtd run`)")

Handler = Callable[[str, Dict[str, Any]], Any]  # typing.Dict: a value, evaluated on Python 3.8


class _RequestHandler(socketserver.BaseRequestHandler):
    def _read_line(self, timeout_s: float) -> Optional[bytes]:
        """The request line (at most MAX_REQUEST_BYTES), or None if it did not come in time.

        The deadline is for the whole line: a client that trickles bytes is dropped like one
        that sends nothing, so no client holds a thread of the daemon for long.
        """
        deadline = time.monotonic() + timeout_s
        data = b""
        while b"\n" not in data and len(data) <= MAX_REQUEST_BYTES:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.request.settimeout(remaining)
            try:
                chunk = self.request.recv(4096)
            except socket.timeout:
                return None
            if not chunk:
                break
            data += chunk
        line = data.split(b"\n", 1)[0]
        return line if len(line) <= MAX_REQUEST_BYTES else b""

    def handle(self) -> None:
        server: ControlServer = self.server  # type: ignore[assignment]
        raw = self._read_line(server.client_timeout_s)
        if raw is None:
            self._reply({"v": PROTOCOL_VERSION, "ok": False,
                         "error": f"no request within {server.client_timeout_s:g} s; closing"})
            return
        try:
            request = json.loads(raw)
            if not isinstance(request, dict):
                raise ValueError("request is not a JSON object")
        except ValueError as exc:
            self._reply({"v": PROTOCOL_VERSION, "ok": False, "error": f"malformed request: {exc}"})
            return
        version, op = request.get("v"), request.get("op")
        args = request.get("args") or {}
        if version != PROTOCOL_VERSION:
            reply = {"ok": False, "error": f"protocol version {version!r} not supported "
                                           f"(this daemon speaks {PROTOCOL_VERSION})"}
        elif op not in OPERATIONS:
            reply = {"ok": False, "error": f"unknown operation {op!r}; known: {', '.join(OPERATIONS)}"}
        elif not isinstance(args, dict):
            reply = {"ok": False, "error": "args must be a JSON object"}
        else:
            try:
                reply = {"ok": True, "result": server.handler(op, args)}
            except OdtdError as exc:
                reply = {"ok": False, "error": str(exc)}
            except Exception as exc:  # the daemon must answer, and must not die, on any request
                logger.exception("control request %r failed", op)
                reply = {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}
        self._reply({"v": PROTOCOL_VERSION, **reply})

    def _reply(self, reply: dict[str, Any]) -> None:
        try:
            self.request.settimeout(REPLY_TIMEOUT_S)
            self.request.sendall(json.dumps(reply, default=str).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            logger.debug("control client went away before the reply")


class ControlServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Serves control requests on ``path`` (mode 0660) in threads, calling ``handler(op, args)``.

    Args:
        path: the socket file (``ODTD_HOME/run/odtd.sock``).
        handler: answers an operation; raises ``OdtdError`` for a refused request.
        client_timeout_s: a client that has not sent its request line within this long gets an
            error reply and is disconnected (its thread ends).
    """

    daemon_threads = True

    def __init__(self, path: Path, handler: Handler,
                 client_timeout_s: float = CLIENT_TIMEOUT_S) -> None:
        self.handler = handler
        self.client_timeout_s = client_timeout_s
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_socket(self.path)
        super().__init__(str(self.path), _RequestHandler)
        os.chmod(self.path, 0o660)
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and remove the socket file."""
        self.shutdown()
        self.server_close()
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:  # a read-only home: the next start finds it stale and removes it
            logger.warning("cannot remove %s: %s", self.path, exc)


def _remove_stale_socket(path: Path) -> None:
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # left by a daemon that died; nobody listens
        return
    finally:
        probe.close()
    raise OdtdError(f"{path}: another odtd daemon is already running on this home")


def request(path: Path, op: str, args: Optional[dict[str, Any]] = None,
            timeout_s: Optional[float] = 10.0) -> Any:
    """Send one request and return its result.

    Raises:
        DaemonUnavailable: nobody answers on the socket.
        OdtdError: the daemon refused the request (its message).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonUnavailable(f"no odtd daemon is running on {path.parent.parent}; "
                                    f"{NO_DAEMON_HINT}") from None
        except PermissionError:
            raise DaemonUnavailable(f"{path}: permission denied; join the odtd group "
                                    "(sudo usermod -aG odtd $USER) and log in again") from None
        message = {"v": PROTOCOL_VERSION, "op": op, "args": args or {}}
        sock.sendall(json.dumps(message).encode() + b"\n")
        with sock.makefile("rb") as stream:
            raw = stream.readline()
    except socket.timeout:
        raise DaemonUnavailable(f"the daemon did not answer {op!r} within {timeout_s} s") from None
    finally:
        sock.close()
    if not raw:
        raise DaemonUnavailable(f"the daemon closed the connection without answering {op!r}")
    reply = json.loads(raw)
    if not reply.get("ok"):
        raise OdtdError(reply.get("error") or "the daemon refused the request")
    return reply.get("result")


def request_train_now(home: Home, wait: bool = False, force: bool = False) -> dict[str, Any]:
    """Ask the daemon for a session now; with ``wait``, block until it ends and return it."""
    home.require()
    return request(home.socket_path, "train-now", {"wait": wait, "force": force},
                   timeout_s=None if wait else 10.0)


def request_federated_session(socket_path: Path, args: dict[str, Any],
                              timeout_s: Optional[float] = None) -> dict[str, Any]:
    """Ask the daemon for a federated session (``FederatedRound``'s fields) and wait for it.

    Returns:
        The session object; ``details.federated.handed_back`` says whether trained weights are in
        ``args["weights_out"]``.

    Raises:
        DaemonUnavailable: No daemon answers on ``socket_path``.
        OdtdError: The daemon refused (a session already running, bad request fields).
    """
    return request(socket_path, "federated-session", args, timeout_s=timeout_s)


def request_federated_evaluate(socket_path: Path, args: dict[str, Any],
                               timeout_s: Optional[float] = None) -> dict[str, Any]:
    """Ask the daemon to score a round's weights (``FederatedRound``'s fields) on its own set.

    Returns:
        ``odtd.session.federated_evaluation.evaluate_round``'s metrics.

    Raises:
        DaemonUnavailable: No daemon answers on ``socket_path``.
        OdtdError: The daemon refused (a session running, weights that do not fit, no set).
    """
    return request(socket_path, "federated-evaluate", args, timeout_s=timeout_s)
