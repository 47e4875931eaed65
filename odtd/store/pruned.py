"""Samples pruned to keep the disk above its floor: the ``pruned_samples`` table.

``PrunedRows`` is mixed into ``Store`` (``odtd.store.database``). A pruned sample's files are
deleted by ``odtd.home.disk``; its row moves from ``samples`` to ``pruned_samples`` in one
transaction first, so a crash in between leaves files without a row (found and removed by the
next clean-up), never a row without its files. The hash stays known: the same image again is
a duplicate, not a new sample.
"""

from __future__ import annotations

import json
from typing import Any, Callable, ContextManager

from odtd.store.liveness import utc_now


class PrunedRows:
    """``Store``'s pruning methods (the host provides what is declared here)."""

    db: Any
    transaction: Callable[[], ContextManager[None]]
    _query: Callable[..., list]

    def prunable_samples(self, keep_device: int, limit: int) -> list[dict[str, Any]]:
        """Trained samples no one reads any more, the oldest first.

        Not in the replay buffer, and not among the ``keep_device`` newest samples sessions
        trained on (a session's BatchNorm adaptation and distillation read those). Pending and
        held-out samples are never prunable; unlabelled ones are ``prunable_unlabelled``'s.
        """
        return self._query(
            "SELECT sha256, label, day, session_id, stored_path, array_path FROM samples "
            "WHERE status = 'trained' AND sha256 NOT IN (SELECT sha256 FROM replay_buffer) "
            "AND sha256 NOT IN (SELECT sha256 FROM samples WHERE status = 'trained' AND "
            "session_id > 0 ORDER BY day DESC, ingested_at DESC, sha256 LIMIT ?) "
            "ORDER BY day, ingested_at, sha256 LIMIT ?", [keep_device, limit])

    def prunable_unlabelled(self, keep: int, limit: int) -> list[dict[str, Any]]:
        """Unlabelled samples older than the ``keep`` newest, the oldest first.

        ``keep`` is what a session reads of them (``store.samples.UNLABELLED_READ``).
        """
        return self._query(
            "SELECT sha256, label, day, session_id, stored_path, array_path FROM samples "
            "WHERE status = 'unlabelled' AND sha256 NOT IN (SELECT sha256 FROM samples WHERE "
            "status = 'unlabelled' ORDER BY day DESC, ingested_at DESC, sha256 LIMIT ?) "
            "ORDER BY day, ingested_at, sha256 LIMIT ?", [keep, limit])

    def move_to_pruned(self, rows: list[dict[str, Any]], sizes: dict[str, int]) -> None:
        """Move these sample rows to ``pruned_samples`` (one transaction), with their files' sizes."""
        shas = json.dumps([row["sha256"] for row in rows])
        with self.transaction():
            self.db["pruned_samples"].insert_all(
                [{"sha256": row["sha256"], "label": row["label"], "day": row["day"],
                  "session_id": row["session_id"], "size_bytes": sizes.get(row["sha256"], 0),
                  "pruned_at": utc_now()} for row in rows], replace=True)
            self.db.execute("DELETE FROM samples WHERE status IN ('trained', 'unlabelled') AND sha256 IN "
                            "(SELECT value FROM json_each(?))", [shas])

    def pruned_totals(self) -> dict[str, int]:
        """How many samples were pruned, and their bytes."""
        row = self._query("SELECT count(*) AS n, COALESCE(SUM(size_bytes), 0) AS bytes "
                          "FROM pruned_samples")[0]
        return {"samples": row["n"], "bytes": row["bytes"]}
