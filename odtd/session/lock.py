"""One session at a time per home: the lock, and recovery of sessions a dead process left.

``SessionLock`` is held by every process that trains or profiles (``SessionRunner``,
``odtctl profile``); ``recover_stale_sessions`` runs under it when the daemon's session process
starts.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import Optional

from odtd.errors import SessionBusy
from odtd.store.database import Store

logger = logging.getLogger(__name__)


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


def recover_stale_sessions(store: Store) -> list[int]:
    """Mark sessions left ``running`` by a dead process as interrupted; return their ids.

    Call it only while holding the session lock: then no live process can own such a row.
    Their samples were never marked trained, so they stay pending.
    """
    stale = store.running_sessions()
    for record in stale:
        record.outcome = "interrupted"
        record.reason = ("the process running this session died (crash, kill or power loss); "
                         "its samples stay pending")
        store.finish_session(record)
        store.log_event("recovered", f"session {record.id} marked interrupted", session_id=record.id)
        logger.warning("session %d was left running by a dead process: marked interrupted", record.id)
    return [record.id for record in stale]
