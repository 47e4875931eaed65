"""The state database, ``odtd.db``: SQLite in WAL mode through sqlite-utils.

One writer at a time (the daemon or a foreground ``odtctl`` session), any number of readers:
WAL lets ``odtctl status`` read while a session writes. The schema version lives in
``PRAGMA user_version`` and advances through the ordered ``MIGRATIONS`` (``odtd.store.schema``).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import sqlite_utils

from odtd.errors import StoreError
from odtd.store.liveness import utc_now
from odtd.store.records import OUTCOMES, SessionRecord
from odtd.store.schema import MIGRATIONS

logger = logging.getLogger(__name__)

class Store:
    """Typed access to ``odtd.db``; the only module that imports sqlite_utils.

    Args:
        path: the database file; created (with its schema) when missing.
        busy_timeout_s: how long a writer waits for another writer's lock.
    """

    def __init__(self, path: Path, busy_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        try:
            # isolation_level=None: no implicit transactions; ``transaction()`` opens them
            # explicitly, so a multi-statement write is all-or-nothing.
            conn = sqlite3.connect(
                str(self.path), timeout=busy_timeout_s, check_same_thread=False,
                isolation_level=None,
            )
            self._depth = 0
            self._lock = threading.RLock()
            self.db = sqlite_utils.Database(conn)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.migrate()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: cannot open the database ({exc})") from None

    # -- schema ---------------------------------------------------------------------------

    @property
    def schema_version(self) -> int:
        """The applied migration count (``PRAGMA user_version``)."""
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def migrate(self) -> None:
        """Apply the migrations this database has not seen, each in its own transaction."""
        current = self.schema_version
        if current > len(MIGRATIONS):
            raise StoreError(
                f"{self.path}: schema version {current} is newer than this odtd knows "
                f"({len(MIGRATIONS)}); upgrade odtd"
            )
        for number, script in enumerate(MIGRATIONS[current:], start=current + 1):
            logger.info("migrating %s to schema version %d", self.path, number)
            statements = [s.strip() for s in script.split(";") if s.strip()]
            with self.transaction():
                for statement in statements:
                    self.db.conn.execute(statement)
                self.db.conn.execute(f"PRAGMA user_version = {number}")

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
            self.db.conn.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield
            except BaseException:
                self._depth = 0
                self.db.conn.execute("ROLLBACK")
                raise
            self._depth = 0
            self.db.conn.execute("COMMIT")

    def _insert(self, table: str, row: dict[str, Any], replace: bool = False) -> int:
        columns = ", ".join(row)
        marks = ", ".join(f":{key}" for key in row)
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        with self.transaction():
            cursor = self.db.conn.execute(f"{verb} INTO {table} ({columns}) VALUES ({marks})", row)
        return cursor.lastrowid

    def _update(self, table: str, where: dict[str, Any], row: dict[str, Any]) -> None:
        sets = ", ".join(f"{key} = :set_{key}" for key in row)
        cond = " AND ".join(f"{key} = :where_{key}" for key in where)
        params = {f"set_{k}": v for k, v in row.items()}
        params.update({f"where_{k}": v for k, v in where.items()})
        with self.transaction():
            self.db.conn.execute(f"UPDATE {table} SET {sets} WHERE {cond}", params)

    def integrity_check(self) -> str:
        """Return SQLite's ``PRAGMA integrity_check`` verdict ('ok' when sound)."""
        return self.db.execute("PRAGMA integrity_check").fetchone()[0]

    # -- meta -----------------------------------------------------------------------------

    def set_meta(self, **values: Any) -> None:
        """Store JSON-encodable settings of this home (model name, classes, ...)."""
        with self.transaction():
            for key, value in values.items():
                self._insert("meta", {"key": key, "value": json.dumps(value)}, replace=True)

    def meta(self, key: str, default: Any = None) -> Any:
        """Return a stored setting, or ``default``."""
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
        return json.loads(row[0]) if row else default

    # -- samples --------------------------------------------------------------------------

    def has_sample(self, sha256: str) -> bool:
        """Whether a sample with this content hash is already stored."""
        return self.db.execute("SELECT 1 FROM samples WHERE sha256 = ?", [sha256]).fetchone() is not None

    def add_sample(self, row: dict[str, Any]) -> bool:
        """Insert a sample row; return False when its sha256 is already there (a duplicate)."""
        with self.transaction():
            cursor = self.db.conn.execute(
                "INSERT OR IGNORE INTO samples (sha256, label, day, status, original_path,"
                " stored_path, array_path, width, height, ingested_at)"
                " VALUES (:sha256, :label, :day, :status, :original_path, :stored_path,"
                " :array_path, :width, :height, :ingested_at)",
                row,
            )
        return cursor.rowcount == 1

    def add_quarantine(self, original_path: str, stored_path: Optional[str], reason: str) -> None:
        """Record a rejected input."""
        self._insert(
            "quarantine",
            {"at": utc_now(), "original_path": original_path, "stored_path": stored_path,
             "reason": reason},
        )

    def samples(self, status: str, limit: Optional[int] = None) -> list[dict[str, Any]]:
        """Return samples in a status, oldest day first."""
        sql = "SELECT * FROM samples WHERE status = ? ORDER BY day, ingested_at, sha256"
        params: list[Any] = [status]
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return list(self.db.query(sql, params))

    def samples_by_sha(self, shas: Iterable[str]) -> list[dict[str, Any]]:
        """Return the sample rows for these hashes (unknown hashes are skipped)."""
        shas = list(shas)
        rows: list[dict[str, Any]] = []
        for start in range(0, len(shas), 500):
            chunk = shas[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows.extend(self.db.query(f"SELECT * FROM samples WHERE sha256 IN ({marks})", chunk))
        return rows

    def mark_trained(self, shas: Iterable[str], session_id: int) -> None:
        """Mark pending samples as trained by a session."""
        with self.transaction():
            self.db.conn.executemany(
                "UPDATE samples SET status = 'trained', session_id = ? WHERE sha256 = ?"
                " AND status = 'pending'",
                [(session_id, sha) for sha in shas],
            )

    def sample_counts(self) -> dict[str, int]:
        """Return counts: total, pending, trained, holdout, quarantined."""
        counts = {"total": 0, "pending": 0, "trained": 0, "holdout": 0}
        for status, count in self.db.execute("SELECT status, count(*) FROM samples GROUP BY status"):
            counts[status] = count
            counts["total"] += count
        counts["quarantined"] = self.db.execute("SELECT count(*) FROM quarantine").fetchone()[0]
        return counts

    # -- sessions -------------------------------------------------------------------------

    def start_session(self, record: SessionRecord) -> int:
        """Insert ``record`` as a ``running`` session row; set and return its id."""
        record.state, record.started_at = "running", utc_now()
        record.id = self._insert("sessions", record.to_row())
        return record.id

    def save_session(self, record: SessionRecord) -> None:
        """Write a running session's fields (progress: steps, batch size, the worker's pid)."""
        self._update("sessions", {"id": record.id}, record.to_row())

    def finish_session(self, record: SessionRecord) -> None:
        """Mark a session done with its outcome and write all its fields (one transaction)."""
        if record.outcome not in OUTCOMES:
            raise StoreError(f"session {record.id}: outcome {record.outcome!r} not in {OUTCOMES}")
        record.finished_at = record.finished_at or utc_now()
        record.state = "done"
        self._update("sessions", {"id": record.id}, record.to_row())

    def add_steps(self, session_id: int, steps: list[dict[str, Any]]) -> None:
        """Store a session's step spans (monotonic seconds) in one transaction."""
        rows = [
            {"session_id": session_id, "idx": s["index"], "epoch": s.get("epoch", 0),
             "batch_size": s["batch_size"], "loss": s.get("loss"), "start_mono": s["start"],
             "end_mono": s["end"], "energy_j": s.get("energy_j")}
            for s in steps
        ]
        with self.transaction():
            for row in rows:
                self._insert("steps", row, replace=True)

    def steps(self, session_id: int) -> list[dict[str, Any]]:
        """Return a session's steps in order."""
        return list(self.db.query("SELECT * FROM steps WHERE session_id = ? ORDER BY idx", [session_id]))

    def session(self, session_id: int) -> Optional[SessionRecord]:
        """Return one session, or None."""
        rows = list(self.db.query("SELECT * FROM sessions WHERE id = ?", [session_id]))
        return SessionRecord.from_row(rows[0]) if rows else None

    def sessions(self, limit: Optional[int] = None, done_only: bool = False) -> list[SessionRecord]:
        """Return sessions, most recent first."""
        sql = "SELECT * FROM sessions"
        if done_only:
            sql += " WHERE state = 'done'"
        sql += " ORDER BY id DESC"
        params: list[Any] = []
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return [SessionRecord.from_row(row) for row in self.db.query(sql, params)]

    def last_kept_for_resume(self) -> Optional[SessionRecord]:
        """The latest finished session whose refused candidate was kept to resume from, or None."""
        rows = list(self.db.query(
            "SELECT * FROM sessions WHERE state = 'done' AND "
            "json_extract(details, '$.kept_for_resume') ORDER BY id DESC LIMIT 1"))
        return SessionRecord.from_row(rows[0]) if rows else None

    def running_sessions(self) -> list[SessionRecord]:
        """Return sessions still marked running (by a live or a crashed process)."""
        return [SessionRecord.from_row(row) for row in
                self.db.query("SELECT * FROM sessions WHERE state = 'running' ORDER BY id")]

    def outcome_counts(self) -> dict[str, int]:
        """Return the number of finished sessions per outcome."""
        counts = dict.fromkeys(OUTCOMES, 0)
        for outcome, count in self.db.execute(
            "SELECT outcome, count(*) FROM sessions WHERE state = 'done' GROUP BY outcome"
        ):
            counts[outcome] = count
        return counts

    # -- model versions -------------------------------------------------------------------

    def add_model_version(self, row: dict[str, Any]) -> None:
        """Record a model version (its files are written by ``odtd.home.versions``)."""
        row = dict(row)
        row.setdefault("created_at", utc_now())
        self._insert("model_versions", row, replace=True)

    def model_versions(self, model: str) -> list[dict[str, Any]]:
        """Return the versions of a model, newest first."""
        return list(
            self.db.query(
                "SELECT * FROM model_versions WHERE model = ? ORDER BY version DESC", [model]
            )
        )

    def set_model_version_state(self, model: str, version: int, state: str) -> None:
        """Mark a version kept, pruned, ..."""
        self._update("model_versions", {"model": model, "version": version}, {"state": state})

    # -- events and the daemon's heartbeat --------------------------------------------------

    def log_event(self, kind: str, message: str, **data: Any) -> None:
        """Append an event (promotions, rollbacks, reloads, recoveries)."""
        self._insert(
            "events",
            {"at": utc_now(), "kind": kind, "message": message,
             "data": json.dumps(data, sort_keys=True) if data else None},
        )

    def events(self, limit: int = 20, kind: Optional[str] = None) -> list[dict[str, Any]]:
        """Return recent events, newest first."""
        if kind:
            rows = self.db.query(
                "SELECT * FROM events WHERE kind = ? ORDER BY id DESC LIMIT ?", [kind, limit]
            )
        else:
            rows = self.db.query("SELECT * FROM events ORDER BY id DESC LIMIT ?", [limit])
        return list(rows)

    def write_daemon(self, **fields: Any) -> None:
        """Upsert the daemon's liveness row (pid, heartbeat_at, next_session_at, paused)."""
        with self.transaction():
            self.db.conn.execute("INSERT OR IGNORE INTO daemon (id) VALUES (1)")
            if fields:
                self._update("daemon", {"id": 1}, fields)

    def daemon_row(self) -> Optional[dict[str, Any]]:
        """Return the daemon's liveness row, or None if no daemon ever ran here."""
        rows = list(self.db.query("SELECT * FROM daemon WHERE id = 1"))
        return rows[0] if rows else None

    # -- replay buffer ----------------------------------------------------------------------

    def replay_buffer(self) -> list[dict[str, Any]]:
        """Return the buffer's entries (sha256, label, size_bytes, added_session)."""
        return list(self.db.query("SELECT * FROM replay_buffer ORDER BY sha256"))

    def replay_seen(self) -> dict[str, int]:
        """Return how many trained samples of each label the reservoir has been offered."""
        return {row["label"]: row["seen"] for row in self.db.query("SELECT * FROM replay_seen")}

    def update_replay(self, added: list[dict[str, Any]], removed: list[str],
                      seen: dict[str, int]) -> None:
        """Apply one reservoir update (entries in and out, offered counts) in one transaction."""
        with self.transaction():
            for sha in removed:
                self.db.conn.execute("DELETE FROM replay_buffer WHERE sha256 = ?", [sha])
            for row in added:
                self._insert("replay_buffer", row, replace=True)
            for label, count in seen.items():
                self._insert("replay_seen", {"label": label, "seen": count}, replace=True)

    # -- profiles -------------------------------------------------------------------------

    def add_profile_rows(self, model: str, backend: Optional[str], board: Optional[str],
                         steps: int, rows: list[dict[str, Any]]) -> int:
        """Store one profile run (a row per precision and batch size); return its profile id."""
        keys = ("batch_size", "precision", "precision_resolved", "status", "reason",
                "samples_per_s", "step_s", "energy_per_sample_j", "energy_per_sample_by_rail_j",
                "energy_source", "energy_coverage", "mean_power_w", "peak_memory_mb")
        with self.transaction():
            profile_id = self.db.execute(
                "SELECT COALESCE(MAX(profile_id), 0) + 1 FROM profiles").fetchone()[0]
            created_at = utc_now()
            for row in rows:
                record = {key: row.get(key) for key in keys}
                by_rail = record["energy_per_sample_by_rail_j"]
                record["energy_per_sample_by_rail_j"] = (
                    json.dumps(by_rail, sort_keys=True) if by_rail is not None else None)
                record.update(profile_id=profile_id, created_at=created_at, model=model,
                              backend=backend, board=board, steps=steps)
                self._insert("profiles", record)
        return profile_id

    def latest_profile(self, model: str) -> list[dict[str, Any]]:
        """Return the newest measurement of each (precision, batch size) profiled for ``model``.

        Later runs add sizes to earlier ones (``odtctl profile --batch-sizes 32`` after 4,8,16
        extends that profile) and replace re-measured sizes. Only runs on the board of the newest
        run count. Rows keep their own ``profile_id``; ``[]`` when the model was never profiled.
        """
        newest = self.db.execute(
            "SELECT board FROM profiles WHERE model = ? ORDER BY profile_id DESC LIMIT 1",
            [model]).fetchone()
        if newest is None:
            return []
        rows = self.db.query(
            "SELECT * FROM profiles WHERE model = ? AND board IS ? ORDER BY profile_id DESC",
            [model, newest[0]])
        latest: dict[tuple[str, int], dict[str, Any]] = {}
        for row in rows:
            key = (row["precision"], row["batch_size"])
            if key not in latest:
                by_rail = row["energy_per_sample_by_rail_j"]
                row["energy_per_sample_by_rail_j"] = json.loads(by_rail) if by_rail else None
                latest[key] = row
        return [latest[key] for key in sorted(latest)]

    def iter_query(self, sql: str, params: Optional[list[Any]] = None) -> Iterator[dict[str, Any]]:
        """Run a read-only query (for reports that need their own SQL)."""
        return self.db.query(sql, params or [])
