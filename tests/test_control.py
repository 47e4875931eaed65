"""The control protocol over a real Unix socket."""

import json
import socket
import stat
import time

import pytest

from odtd.daemon.control import ControlServer, request
from odtd.errors import DaemonUnavailable, OdtdError, SessionBusy


@pytest.fixture
def server(tmp_path):
    def handler(op, args):
        if op == "ping":
            return {"pong": True}
        if op == "train-now":
            raise SessionBusy("a session is already running")
        if op == "status":
            raise ZeroDivisionError("bug")
        return {"op": op, "args": args}

    srv = ControlServer(tmp_path / "run" / "odtd.sock", handler)
    srv.start()
    yield srv
    srv.stop()


def _raw(path, payload: bytes) -> dict:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    sock.sendall(payload)
    data = sock.makefile("rb").readline()
    sock.close()
    return json.loads(data)


def test_socket_mode_and_ping(server):
    assert stat.S_IMODE(server.path.stat().st_mode) == 0o660
    assert request(server.path, "ping") == {"pong": True}
    assert request(server.path, "pause", {"x": 1}) == {"op": "pause", "args": {"x": 1}}


def test_every_request_gets_a_reply(server):
    assert _raw(server.path, b"not json\n")["error"].startswith("malformed request")
    assert "protocol version 7" in _raw(server.path, b'{"v": 7, "op": "ping"}\n')["error"]
    assert "unknown operation 'dance'" in _raw(server.path, b'{"v": 1, "op": "dance"}\n')["error"]
    with pytest.raises(OdtdError, match="already running"):
        request(server.path, "train-now")
    with pytest.raises(OdtdError, match="internal error: ZeroDivisionError"):
        request(server.path, "status")
    assert request(server.path, "ping") == {"pong": True}  # still serving


def test_no_daemon_is_one_clear_error(tmp_path):
    with pytest.raises(DaemonUnavailable, match="--foreground.*systemctl start odtd"):
        request(tmp_path / "run" / "odtd.sock", "ping")


def test_stale_socket_is_replaced_and_live_one_refused(tmp_path, server):
    with pytest.raises(OdtdError, match="already running"):
        ControlServer(server.path, lambda op, args: None)
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # the file stays, nobody listens
    srv = ControlServer(stale, lambda op, args: "ok")
    srv.start()
    try:
        assert request(stale, "ping") == "ok"
    finally:
        srv.stop()


def test_a_silent_or_slow_client_is_dropped_and_others_are_served(tmp_path):
    srv = ControlServer(tmp_path / "run" / "odtd.sock", lambda op, args: {"pong": True},
                        client_timeout_s=0.5)
    srv.start()
    try:
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect(str(srv.path))
        silent.settimeout(5)
        slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        slow.connect(str(srv.path))
        slow.settimeout(5)
        for _ in range(3):  # a byte every 0.12 s, never a whole line: dropped at 0.5 s all the same
            slow.sendall(b"{")
            time.sleep(0.12)
        assert request(srv.path, "ping") == {"pong": True}  # served meanwhile
        for client in (silent, slow):
            reply = client.makefile("rb").readline()
            assert json.loads(reply)["error"] == "no request within 0.5 s; closing"
            assert client.recv(1) == b""  # and the server closed the connection
            client.close()
    finally:
        srv.stop()


def test_a_request_over_64_kb_is_refused(server):
    reply = _raw(server.path, b"{" + b" " * (64 * 1024) + b"}\n")
    assert reply["error"].startswith("malformed request")
