"""The home's locks: one session at a time, and no clean-up beside an ingest.

``SessionLock`` is held by every process that trains or profiles (``session.runner``,
``odtctl profile``), and by whoever prunes the home to make room (``home.disk``): pruning never
runs beside a session that is reading the samples and versions it would delete.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from odtd.errors import SessionBusy


class SessionLock:
    """An exclusive ``flock`` on ``run/session.lock``: one session at a time across processes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: Optional[int] = None

    def __enter__(self) -> SessionLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o660)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise SessionBusy(f"a session is already running (pid {holder}); wait for it to finish") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextmanager
def ingest_lock(path: Path, exclusive: bool = False) -> Iterator[bool]:
    """An ``flock`` on ``run/ingest.lock``: shared by every ingest, exclusive for the clean-up.

    An ingest writes a sample's files before its row commits; the clean-up after a crash
    (``home.repair``) removes sample files without a row, so it must never run beside an
    ingest. Ingests share the lock (and wait for a clean-up); the clean-up takes it only if no
    ingest holds it, without waiting: it yields False then, and skips.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o660)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
