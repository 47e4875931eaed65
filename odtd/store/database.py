"""The state database, ``odtd.db``: SQLite in WAL mode through sqlite-utils.

One writer at a time (the daemon or a foreground ``odtctl`` session), any number of readers:
WAL lets ``odtctl status`` read while a session writes. The schema version lives in
``PRAGMA user_version`` and advances through the ordered ``MIGRATIONS`` (``odtd.store.schema``).
Rows go in and out through sqlite-utils' table API (``insert``, ``upsert``, ``update``,
``rows_where``, ``get``); SQL is written by hand only where that API has no verb (aggregates,
``UPDATE ... WHERE`` over many rows).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import sqlite_utils
from sqlite_utils.db import NotFoundError

from odtd.errors import StoreError, sqlite_storage_error
from odtd.store.liveness import open_database, utc_now
from odtd.store.profiles import ProfileRows
from odtd.store.pruned import PrunedRows
from odtd.store.records import JUDGED, OUTCOMES, SessionRecord
from odtd.store.samples import SampleRows
from odtd.store.schema import MIGRATIONS

logger = logging.getLogger(__name__)


class _SavepointConnection(sqlite3.Connection):
    """A connection whose ``with`` block is a savepoint: it never ends an open transaction.

    sqlite-utils 3.x wraps each write (insert, update, delete_where) in ``with db.conn:``, and
    the stock context manager COMMITs whatever transaction is open: it would end
    ``Store.transaction()``'s ``BEGIN IMMEDIATE`` at the first write, and a promotion that
    fails half-way would stay half-written. A savepoint nests inside the open transaction
    instead (outside one, it is a transaction of its own). sqlite-utils 4 nests its writes in
    savepoints itself (``Database.atomic``) and never enters the connection.
    """

    def __enter__(self) -> _SavepointConnection:
        self.execute("SAVEPOINT odtd_write")
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> bool:
        if exc_type is None:
            self.execute("RELEASE odtd_write")
        elif self.in_transaction:  # an I/O error may have rolled everything back already
            self.execute("ROLLBACK TO odtd_write")
            self.execute("RELEASE odtd_write")
        return False


class Store(SampleRows, ProfileRows, PrunedRows):
    """Typed access to ``odtd.db``; the only module that imports sqlite_utils.

    Args:
        path: the database file; created (with its schema) when missing.
        busy_timeout_s: how long a writer waits for another writer's lock.
    """

    def __init__(self, path: Path, busy_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        try:
            # No implicit transactions (isolation_level=None): ``transaction()`` opens them
            # explicitly, so a multi-statement write is all-or-nothing.
            conn = open_database(self.path, busy_timeout_s, factory=_SavepointConnection)
            self._depth = 0
            self._lock = threading.RLock()
            self.db = sqlite_utils.Database(conn)
            self.db.execute("PRAGMA foreign_keys=ON")
            # FULL: in WAL mode each COMMIT is on disk when it returns. NORMAL may lose the
            # latest commits at a power cut, after odtd acted on them: an inbox file removed
            # once its row committed, a `current` pointer moved (docs/storage.md).
            self.db.execute("PRAGMA synchronous=FULL")
            self.migrate()
        except sqlite3.DatabaseError as exc:  # a read-only or full disk, no permission: its line
            raise (sqlite_storage_error(exc, str(self.path)) or
                   StoreError(f"{self.path}: cannot open the database ({exc})")) from None

    # -- schema ---------------------------------------------------------------------------

    @property
    def schema_version(self) -> int:
        """The applied migration count (``PRAGMA user_version``)."""
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def migrate(self) -> None:
        """Apply the migrations this database has not seen, each in its own transaction.

        Foreign keys are off meanwhile (SQLite's way to rebuild a table others reference:
        https://www.sqlite.org/lang_altertable.html#otheralter) and checked before each commit.

        Raises:
            StoreError: the database is newer than this odtd, or a migration left a reference
                without its row (rolled back).
        """
        current = self.schema_version
        if current > len(MIGRATIONS):
            raise StoreError(
                f"{self.path}: schema version {current} is newer than this odtd knows "
                f"({len(MIGRATIONS)}); upgrade odtd"
            )
        if current == len(MIGRATIONS):
            return
        self.db.execute("PRAGMA foreign_keys=OFF")  # a no-op inside a transaction: before it
        try:
            for number, script in enumerate(MIGRATIONS[current:], start=current + 1):
                logger.info("migrating %s to schema version %d", self.path, number)
                statements = [s.strip() for s in script.split(";") if s.strip()]
                with self.transaction():
                    for statement in statements:
                        self.db.execute(statement)
                    broken = self.db.execute("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise StoreError(f"{self.path}: migration {number} left {len(broken)} "
                                         f"references without their row (first: {broken[0]}); "
                                         "it was rolled back: report this with the database")
                    # PRAGMA takes no bound parameters; number is an int from enumerate.
                    self.db.execute(f"PRAGMA user_version = {number}")
        finally:
            self.db.execute("PRAGMA foreign_keys=ON")

    def close(self) -> None:
        """Close the connection (checkpointing the WAL)."""
        self.db.conn.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the enclosed writes as one transaction (nested calls join the outer one)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            try:
                self.db.conn.execute("BEGIN IMMEDIATE")
                self._depth = 1
                try:
                    yield
                except BaseException:
                    self._depth = 0
                    if self.db.conn.in_transaction:  # an I/O error may have rolled it back already
                        self.db.conn.execute("ROLLBACK")
                    raise
                self._depth = 0
                self.db.conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:  # a full, read-only or vanished disk: one line
                self._depth = 0
                if self.db.conn.in_transaction:  # a COMMIT that failed may leave it open
                    self.db.conn.execute("ROLLBACK")
                raise (sqlite_storage_error(exc, str(self.path)) or exc) from None

    def _rows(self, table: str, where: Optional[str] = None, where_args: Optional[Sequence[Any]] = None,
              **options: Any) -> list[dict[str, Any]]:
        """Return ``rows_where``'s rows as a list, read under the writers' lock.

        sqlite-utils 4 reads inside a savepoint, which opens a transaction on the connection the
        daemon's threads share: another thread's ``BEGIN IMMEDIATE`` meanwhile would fail
        ("cannot start a transaction within a transaction").
        """
        with self._lock:
            return list(self.db[table].rows_where(where, where_args, **options))

    def _get(self, table: str, key: Any) -> Optional[dict[str, Any]]:
        """Return the row with this primary key, or None."""
        with self._lock:
            try:
                return self.db[table].get(key)
            except NotFoundError:
                return None

    def _update(self, table: str, key: Any, values: dict[str, Any]) -> None:
        with self.transaction():
            try:
                self.db[table].update(key, values)
            except NotFoundError:
                raise StoreError(
                    f"{self.path}: no {table} row with key {key!r} to update; it was never "
                    "written or was deleted: write the row first"
                ) from None

    def integrity_check(self) -> str:
        """Return SQLite's ``PRAGMA integrity_check`` verdict ('ok' when sound)."""
        return self.db.execute("PRAGMA integrity_check").fetchone()[0]

    # -- meta -----------------------------------------------------------------------------

    def set_meta(self, **values: Any) -> None:
        """Store JSON-encodable settings of this home (model name, classes, ...)."""
        rows = [{"key": key, "value": json.dumps(value)} for key, value in values.items()]
        with self.transaction():
            self.db["meta"].insert_all(rows, replace=True)

    def meta(self, key: str, default: Any = None) -> Any:
        """Return a stored setting, or ``default``."""
        row = self._get("meta", key)
        return json.loads(row["value"]) if row else default

    # -- sessions -------------------------------------------------------------------------

    def start_session(self, record: SessionRecord) -> int:
        """Insert ``record`` as a ``running`` session row; set and return its id."""
        record.state, record.started_at = "running", utc_now()
        with self.transaction():
            record.id = self.db["sessions"].insert(record.to_row()).last_rowid
        return record.id

    def save_session(self, record: SessionRecord) -> None:
        """Write a running session's fields (progress: steps, batch size, the worker's pid)."""
        self._update("sessions", record.id, record.to_row())

    def finish_session(self, record: SessionRecord) -> None:
        """Mark a session done with its outcome and write all its fields (one transaction)."""
        if record.outcome not in OUTCOMES:
            raise StoreError(f"session {record.id}: outcome {record.outcome!r} not in {OUTCOMES}")
        record.finished_at = record.finished_at or utc_now()
        record.state = "done"
        self._update("sessions", record.id, record.to_row())

    def add_steps(self, session_id: int, steps: list[dict[str, Any]]) -> None:
        """Store a session's step spans (monotonic seconds) in one transaction."""
        rows = [
            {"session_id": session_id, "idx": s["index"], "epoch": s.get("epoch", 0),
             "batch_size": s["batch_size"], "loss": s.get("loss"), "start_mono": s["start"],
             "end_mono": s["end"], "energy_j": s.get("energy_j")}
            for s in steps
        ]
        with self.transaction():
            self.db["steps"].insert_all(rows, replace=True)

    def steps(self, session_id: int) -> list[dict[str, Any]]:
        """Return a session's steps in order."""
        return self._rows("steps", "session_id = ?", [session_id], order_by="idx")

    def session(self, session_id: int) -> Optional[SessionRecord]:
        """Return one session, or None."""
        row = self._get("sessions", session_id)
        return SessionRecord.from_row(row) if row else None

    def sessions(self, limit: Optional[int] = None, done_only: bool = False) -> list[SessionRecord]:
        """Return sessions, most recent first."""
        rows = self._rows("sessions", "state = 'done'" if done_only else None, order_by="id DESC",
                          limit=limit)
        return [SessionRecord.from_row(row) for row in rows]

    def last_kept_for_resume(self) -> Optional[SessionRecord]:
        """The latest finished session whose refused candidate was kept to resume from, or None."""
        rows = self._rows("sessions", "state = 'done' AND json_extract(details, '$.kept_for_resume')",
                          order_by="id DESC", limit=1)
        return SessionRecord.from_row(rows[0]) if rows else None

    def reference_origin(self) -> Optional[float]:
        """Version 0's accuracy on the reference set (the model the home started with), or None.

        As the first finished session that served version 0 measured it (its
        ``reference_accuracy_before``); None until such a session has run.
        """
        rows = self._rows("sessions", "state = 'done' AND model_version_before = 0 AND "
                          "json_extract(details, '$.reference_accuracy_before') IS NOT NULL",
                          order_by="id", limit=1)
        return SessionRecord.from_row(rows[0]).details.reference_accuracy_before if rows else None

    def last_judged_session(self) -> Optional[SessionRecord]:
        """The latest finished session whose candidate was promoted or rolled back, or None."""
        judged = ", ".join("?" * len(JUDGED))
        rows = self._rows("sessions", f"state = 'done' AND outcome IN ({judged})", JUDGED,
                          order_by="id DESC", limit=1)
        return SessionRecord.from_row(rows[0]) if rows else None

    def measured_accuracy(self, version: int) -> Optional[float]:
        """The latest judged session's accuracy of model ``version`` before it trained, or None.

        A version that was never promoted (version 0) has no accuracy of its own until a
        session measures it.
        """
        judged = ", ".join("?" * len(JUDGED))
        rows = self._rows("sessions", f"state = 'done' AND outcome IN ({judged}) AND "
                          "model_version_before = ? AND accuracy_before IS NOT NULL",
                          [*JUDGED, version], order_by="id DESC", limit=1)
        return rows[0]["accuracy_before"] if rows else None

    def running_sessions(self) -> list[SessionRecord]:
        """Return sessions still marked running (by a live or a crashed process)."""
        return [SessionRecord.from_row(row)
                for row in self._rows("sessions", "state = 'running'", order_by="id")]

    def outcome_counts(self) -> dict[str, int]:
        """Return the number of finished sessions per outcome."""
        counts = dict.fromkeys(OUTCOMES, 0)
        for row in self._query(
            "SELECT outcome, count(*) AS n FROM sessions WHERE state = 'done' GROUP BY outcome"
        ):
            counts[row["outcome"]] = row["n"]
        return counts

    # -- model versions -------------------------------------------------------------------

    def add_model_version(self, row: dict[str, Any]) -> None:
        """Record a model version (its files are written by ``odtd.home.versions``)."""
        row = dict(row)
        row.setdefault("created_at", utc_now())
        with self.transaction():
            self.db["model_versions"].insert(row, replace=True)

    def model_versions(self, model: str) -> list[dict[str, Any]]:
        """Return the versions of a model, newest first."""
        return self._rows("model_versions", "model = ?", [model], order_by="version DESC")

    def set_model_version_state(self, model: str, version: int, state: str) -> None:
        """Mark a version kept, pruned, ..."""
        self._update("model_versions", (model, version), {"state": state})

    # -- events and the daemon's heartbeat --------------------------------------------------

    def log_event(self, kind: str, message: str, **data: Any) -> None:
        """Append an event (promotions, rollbacks, reloads, recoveries)."""
        with self.transaction():
            self.db["events"].insert(
                {"at": utc_now(), "kind": kind, "message": message,
                 "data": json.dumps(data, sort_keys=True) if data else None})

    def events(self, limit: int = 20, kind: Optional[str] = None) -> list[dict[str, Any]]:
        """Return recent events, newest first."""
        if kind:
            return self._rows("events", "kind = ?", [kind], order_by="id DESC", limit=limit)
        return self._rows("events", order_by="id DESC", limit=limit)

    def daemon_row(self) -> Optional[dict[str, Any]]:
        """Return the daemon's liveness row, or None if no daemon ever ran here.

        The daemon writes it through ``store.liveness.Liveness``, without sqlite-utils.
        """
        return self._get("daemon", 1)

    # -- replay buffer ----------------------------------------------------------------------

    def replay_buffer(self) -> list[dict[str, Any]]:
        """Return the buffer's entries (sha256, label, size_bytes, added_session)."""
        return self._rows("replay_buffer", order_by="sha256")

    def replay_seen(self) -> dict[str, int]:
        """Return how many trained samples of each label the reservoir has been offered."""
        return {row["label"]: row["seen"] for row in self._rows("replay_seen")}

    def update_replay(self, added: list[dict[str, Any]], removed: list[str],
                      seen: dict[str, int]) -> None:
        """Apply one reservoir update (entries in and out, offered counts) in one transaction."""
        with self.transaction():
            if removed:
                self.db["replay_buffer"].delete_where(
                    "sha256 IN (SELECT value FROM json_each(?))", [json.dumps(removed)])
            self.db["replay_buffer"].insert_all(added, replace=True)
            self.db["replay_seen"].insert_all(
                [{"label": label, "seen": count} for label, count in seen.items()], replace=True)

    def _query(self, sql: str, params: Optional[Sequence[Any]] = None) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.db.query(sql, params or []))

    def iter_query(self, sql: str, params: Optional[list[Any]] = None) -> Iterator[dict[str, Any]]:
        """Run a read-only query (for reports that need their own SQL)."""
        return iter(self._query(sql, params))
