"""The ``profiles`` table: one row per (profile run, precision, recompute share, batch size).

``ProfileRows`` is mixed into ``Store`` (``odtd.store.database``) and works through its
connection, transactions and locked reads. ``odtctl profile`` adds a run's rows; admission,
``policy explain`` and ``profile --write-policy`` read the latest of each size.
"""

from __future__ import annotations

import json
from typing import Any, Callable, ContextManager, Optional

from odtd.store.liveness import utc_now

# Every column a profile row carries; the run's own (id, time, model, board) are added.
COLUMNS = ("batch_size", "precision", "recompute", "precision_resolved", "status", "reason",
           "samples_per_s", "step_s", "energy_per_sample_j", "energy_per_sample_by_rail_j",
           "energy_source", "energy_coverage", "mean_power_w", "peak_memory_mb",
           "peak_memory_runs_mb")
# Columns stored as JSON text: the joules per rail (a dict) and each run's peak (a list).
JSON_COLUMNS = ("energy_per_sample_by_rail_j", "peak_memory_runs_mb")


class ProfileRows:
    """``Store``'s profile methods (the host provides what is declared here)."""

    db: Any
    transaction: Callable[[], ContextManager[None]]
    _query: Callable[..., list]
    _rows: Callable[..., list]

    def add_profile_rows(self, model: str, backend: Optional[str], board: Optional[str],
                         steps: int, rows: list[dict[str, Any]]) -> int:
        """Store one profile run (a row per precision, recompute and batch size); return its id."""
        with self.transaction():
            profile_id = self._query(
                "SELECT COALESCE(MAX(profile_id), 0) + 1 AS next FROM profiles")[0]["next"]
            created_at = utc_now()
            records = []
            for row in rows:
                record = {key: row.get(key) for key in COLUMNS}
                record["recompute"] = float(record["recompute"] or 0)
                for key in JSON_COLUMNS:
                    if record[key] is not None:
                        record[key] = json.dumps(record[key], sort_keys=True)
                record.update(profile_id=profile_id, created_at=created_at, model=model,
                              backend=backend, board=board, steps=steps)
                records.append(record)
            self.db["profiles"].insert_all(records)
        return profile_id

    def latest_profile(self, model: str) -> list[dict[str, Any]]:
        """Return the newest measurement of each (precision, recompute, batch size) of ``model``.

        Later runs add sizes to earlier ones (``odtctl profile --batch-sizes 32`` after 4,8,16
        extends that profile) and replace re-measured sizes. Only runs on the board of the newest
        run count. Rows keep their own ``profile_id``; ``[]`` when the model was never profiled.
        """
        newest = self._rows("profiles", "model = ?", [model], select="board",
                            order_by="profile_id DESC", limit=1)
        if not newest:
            return []
        rows = self._rows("profiles", "model = ? AND board IS ?", [model, newest[0]["board"]],
                          order_by="profile_id DESC")
        latest: dict[tuple[str, float, int], dict[str, Any]] = {}
        for row in rows:
            key = (row["precision"], row["recompute"], row["batch_size"])
            if key not in latest:
                row["recompute"] = float(row["recompute"])
                for column in JSON_COLUMNS:
                    row[column] = json.loads(row[column]) if row.get(column) else None
                latest[key] = row
        return [latest[key] for key in sorted(latest)]
