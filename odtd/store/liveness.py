"""The daemon's own rows in ``odtd.db``, with the standard library alone.

The idle daemon stays small (DESIGN.md: it must not hold what only a session needs): importing
sqlite-utils brings numpy and click, about 20 MB. What the daemon itself writes and reads is a
handful of statements: its liveness row (pid, heartbeat, next session, paused), events
(reloads), and two reads for the missed-run catch-up. Everything else goes through ``Store`` in
the processes that need it (sessions, ingest, the CLI). Parameterised SQL only.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from odtd.errors import StoreError, disk_full

# The liveness row's columns (schema migration 1's ``daemon`` table).
DAEMON_FIELDS = ("pid", "started_at", "heartbeat_at", "next_session_at", "paused", "state")


def open_database(path: Path, timeout_s: float,
                  factory: type[sqlite3.Connection] = sqlite3.Connection) -> sqlite3.Connection:
    """Open ``odtd.db`` in WAL mode, or for reading only where its disk cannot be written.

    SQLite reads a WAL database through its ``-shm`` file, which it cannot create on a
    read-only filesystem, nor extend on a full one: it refuses to open the database ("unable
    to open database file", "disk I/O error"). Where the log holds nothing (after a clean
    close there is none, or it is empty), all the content is in the database file itself,
    which SQLite reads as immutable: ``odtctl status`` still works on an SD card remounted
    read-only or filled by another program, and the daemon waits instead of exiting.
    """
    conn = sqlite3.connect(str(path), timeout=timeout_s, check_same_thread=False,
                           isolation_level=None, factory=factory)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        return conn
    except sqlite3.OperationalError:
        conn.close()
        log = Path(f"{path}-wal")
        unwritable = (os.statvfs(path.parent).f_flag & os.ST_RDONLY) or disk_full(str(path))
        if not (path.exists() and (not log.exists() or log.stat().st_size == 0) and unwritable):
            raise
    return sqlite3.connect(f"{path.resolve().as_uri()}?immutable=1", uri=True, timeout=timeout_s,
                           check_same_thread=False, isolation_level=None, factory=factory)


def utc_now() -> str:
    """Return the current time as ISO 8601 UTC with seconds, e.g. 2026-11-22T02:00:07+00:00."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Liveness:
    """The daemon's connection to ``odtd.db`` (a home the CLI initialised and migrated).

    Args:
        path: the database file.
        busy_timeout_s: how long a write waits for a session's transaction.
    """

    def __init__(self, path: Path, busy_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._conn = open_database(self.path, busy_timeout_s)
            # NORMAL: a heartbeat every few seconds need not flush the disk (an SD card wears);
            # one lost at a power cut costs nothing. The store's own writes are FULL.
            self._conn.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: cannot open the database ({exc})") from None

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def write_daemon(self, **fields: Any) -> None:
        """Upsert the daemon's liveness row (``DAEMON_FIELDS``)."""
        unknown = set(fields) - set(DAEMON_FIELDS)
        if unknown:
            raise ValueError(f"not columns of the daemon row: {sorted(unknown)}")
        columns = [name for name in DAEMON_FIELDS if name in fields]  # names from the constant
        assignments = ", ".join(f"{name} = ?" for name in columns)
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute("INSERT OR IGNORE INTO daemon (id) VALUES (1)")
                if columns:
                    self._conn.execute(f"UPDATE daemon SET {assignments} WHERE id = 1",
                                       [fields[name] for name in columns])
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def log_event(self, kind: str, message: str, **data: Any) -> None:
        """Append an event (reloads, rejected reloads, crashed session processes)."""
        with self._lock:
            self._conn.execute(
                "INSERT INTO events (at, kind, message, data) VALUES (?, ?, ?, ?)",
                [utc_now(), kind, message, json.dumps(data, sort_keys=True) if data else None])

    def last_scheduled_start(self) -> Optional[str]:
        """When the latest session started by the schedule began (ISO 8601), or None."""
        row = self._conn.execute("SELECT started_at FROM sessions WHERE trigger = 'schedule' "
                                 "ORDER BY id DESC LIMIT 1").fetchone()
        return row[0] if row else None

    def created_at(self) -> Optional[str]:
        """When ``odtctl init`` made this home (ISO 8601), or None."""
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'created_at'").fetchone()
        return json.loads(row[0]) if row else None
