"""The systemd notification protocol (sd_notify), with the standard library only.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET``, an ``AF_UNIX`` datagram
socket, and waits for ``READY=1`` before it calls the service started; with
``WatchdogSec=`` it also passes ``WATCHDOG_USEC`` and kills the service when
``WATCHDOG=1`` pings stop coming. A message is newline-separated ``KEY=VALUE``
lines in one datagram. See sd_notify(3) and sd_watchdog_enabled(3).

Outside systemd (tests, a developer's shell) ``NOTIFY_SOCKET`` is unset and every
call is a cheap no-op, so the daemon calls the notifier unconditionally.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from typing import Mapping

logger = logging.getLogger(__name__)

# Variables systemd hands to the service only (sd_notify(3)): no child of the daemon (a session,
# an ingest, and so their trainer workers) may ping systemd in the daemon's name, so every child
# is started without them (``child_environment``).
NOTIFY_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# sd_notify(3) reserves upper-case names; custom ones must start with X_.
_FIELD_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")

# A full receive queue on systemd's side must not stall the daemon's main loop
# or the session runner: drop the datagram (and log) after this long.
_SEND_TIMEOUT_S = 1.0


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) without systemd's notification variables."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k not in NOTIFY_ENV_VARS}


class Notifier:
    """Send sd_notify messages to the service manager; thread-safe, never raises on send.

    Build it with :meth:`from_environ`. The daemon's main loop and the session
    runner may call it concurrently: one lock serialises socket creation and
    sends, and every datagram is one whole message, so messages never interleave.

    Each method returns True when the datagram was handed to the kernel, False
    when notification is disabled or the send failed (the reason is logged at
    debug level; a failed ping is retried by the next one).

    Attributes:
        address: the socket address datagrams go to (bytes; a leading NUL byte
            marks Linux's abstract namespace), or None when disabled.
    """

    def __init__(self, address: str | bytes | None = None) -> None:
        """Create a notifier for ``address``.

        Args:
            address: the ``NOTIFY_SOCKET`` value: an absolute path, or ``@name``
                for the abstract namespace. None or empty disables the notifier.

        Raises:
            ValueError: if ``address`` is neither an absolute path nor ``@name``.
        """
        self.address = _parse_address(address) if address else None
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """Build a notifier from ``NOTIFY_SOCKET``; disabled when it is unset or unusable.

        An address this module cannot use (systemd 254 added ``vsock:`` addresses)
        is logged as a warning and disables the notifier rather than failing start-up.

        Args:
            environ: the environment to read; default ``os.environ``.
        """
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        if not raw:
            return cls(None)
        try:
            return cls(raw)
        except ValueError as exc:
            logger.warning("NOTIFY_SOCKET ignored: %s", exc)
            return cls(None)

    @property
    def enabled(self) -> bool:
        """Whether messages are sent at all (``NOTIFY_SOCKET`` was set and usable)."""
        return self.address is not None

    def notify(self, **fields: str | int) -> bool:
        """Send one message made of ``fields``, in the order given.

        Example: ``notify(READY=1, STATUS="idle")`` sends one datagram of two
        lines, ``READY=1`` and ``STATUS=idle``.

        Args:
            **fields: upper-case names (``X_`` prefix for custom ones) to values;
                a newline inside a value is replaced by a space, since newlines
                separate fields.

        Returns:
            True if sent, False if disabled or the send failed.

        Raises:
            ValueError: for an empty message or a malformed field name (a bug in the
                caller, not a delivery problem).
        """
        if not fields:
            raise ValueError("sd_notify message needs at least one field, e.g. READY=1")
        lines = []
        for name, value in fields.items():
            if not _FIELD_NAME.match(name):
                raise ValueError(
                    f"sd_notify field {name!r} must be upper case, e.g. STATUS or X_ODTD_DAY"
                )
            text = str(value).replace("\r", " ").replace("\n", " ")
            lines.append(f"{name}={text}")
        return self._send("\n".join(lines).encode("utf-8"))

    def ready(self) -> bool:
        """Tell systemd start-up finished (``READY=1``); ``Type=notify`` waits for this."""
        return self.notify(READY=1)

    def status(self, text: str) -> bool:
        """Set the one-line status ``systemctl status odtd`` shows (``STATUS=...``)."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """Ping the watchdog (``WATCHDOG=1``); call every :func:`watchdog_interval_s`."""
        return self.notify(WATCHDOG=1)

    def stopping(self) -> bool:
        """Tell systemd a clean shutdown began (``STOPPING=1``)."""
        return self.notify(STOPPING=1)

    def reloading(self) -> bool:
        """Tell systemd a reload began (``RELOADING=1``); send :meth:`ready` when done.

        ``MONOTONIC_USEC`` rides along: systemd 253+ requires it for
        ``Type=notify-reload`` and older versions ignore it.
        """
        return self.notify(RELOADING=1, MONOTONIC_USEC=time.monotonic_ns() // 1000)

    def close(self) -> None:
        """Close the socket; a later message opens a new one."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _send(self, message: bytes) -> bool:
        if self.address is None:
            return False
        with self._lock:
            try:
                if self._sock is None:
                    # Python sockets are close-on-exec by default, so the trainer
                    # worker never inherits this descriptor.
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    sock.settimeout(_SEND_TIMEOUT_S)
                    self._sock = sock
                self._sock.sendto(message, self.address)
            except OSError as exc:
                logger.debug(
                    "sd_notify %r to %r not sent: %s", message[:40], self.address, exc
                )
                return False
        return True


def _parse_address(address: str | bytes) -> bytes:
    raw = os.fsencode(address)
    if raw.startswith(b"@"):
        # Abstract namespace: the name is the rest after a NUL, not NUL-terminated.
        return b"\0" + raw[1:]
    if raw.startswith(b"/"):
        return raw
    raise ValueError(
        f"{os.fsdecode(raw)!r} is neither an absolute socket path nor an @abstract name"
    )


def watchdog_interval_s(
    environ: Mapping[str, str] | None = None, pid: int | None = None
) -> float | None:
    """Return how often to send ``WATCHDOG=1``: half of ``WATCHDOG_USEC``, in seconds.

    Follows sd_watchdog_enabled(3): the watchdog applies to this process only when
    ``WATCHDOG_USEC`` is a positive integer and ``WATCHDOG_PID`` is unset or equal
    to our PID (a child that inherited the variables must not ping). Half the
    period leaves a whole half for a late ping.

    Args:
        environ: the environment to read; default ``os.environ``.
        pid: the process ID to compare with ``WATCHDOG_PID``; default ``os.getpid()``.

    Returns:
        The ping interval in seconds, or None when no watchdog applies to this process.
    """
    env = os.environ if environ is None else environ
    raw_usec = env.get("WATCHDOG_USEC", "")
    if not raw_usec:
        return None
    try:
        usec = int(raw_usec)
    except ValueError:
        logger.debug("WATCHDOG_USEC=%r is not an integer; watchdog off", raw_usec)
        return None
    if usec <= 0:
        logger.debug("WATCHDOG_USEC=%r is not positive; watchdog off", raw_usec)
        return None
    raw_pid = env.get("WATCHDOG_PID", "")
    if raw_pid:
        own_pid = os.getpid() if pid is None else pid
        try:
            target_pid = int(raw_pid)
        except ValueError:
            logger.debug("WATCHDOG_PID=%r is not an integer; watchdog off", raw_pid)
            return None
        if target_pid != own_pid:
            logger.debug("WATCHDOG_PID=%d is not this process (%d)", target_pid, own_pid)
            return None
    return usec / 2 / 1_000_000
