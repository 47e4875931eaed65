"""The samples table and the quarantine's: ``SampleRows``, mixed into ``Store``.

A sample is one image file, content-addressed by its sha256 (``odtd.home.ingest`` writes its
files). A labelled one has a status in ``LABELLED_STATUSES``: ``pending`` (a session trains on
it next), ``trained``, ``holdout`` (the device's own evaluation set). An unlabelled one (status
``unlabelled``, a NULL ``label``: migration 8) is validated and stored alike, but no reader of
labelled samples sees it: a session's pending samples, the held-out set and the replay buffer
each ask for a labelled status, and ``sample_counts`` counts it apart.
``unlabelled_samples`` is its one reader (for a session that estimates the device's class mix
from the newest ``UNLABELLED_READ``; older ones are what pruning may take of them);
``label_sample`` makes it a labelled sample when the same image comes again with a label.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Optional

from odtd.errors import StoreError
from odtd.store.liveness import utc_now
from odtd.store.schema import LABELLED_STATUSES, UNLABELLED

# The most of the device's samples a session's train file carries besides its own (the newest
# it trained on before: BatchNorm adaptation, distillation, the class priors, pseudo-labels);
# pruning (``storage.prune: [samples]``) never takes these.
DEVICE_READ = 512
# The most unlabelled samples it carries (the newest: the class priors' EM, pseudo-labels);
# older ones no session reads again, and pruning (``storage.prune: [unlabelled]``) may take them.
UNLABELLED_READ = 2048


@dataclass(frozen=True)
class UnlabelledSample:
    """One unlabelled sample's row.

    Attributes:
        sha256: the content hash of its original file: the sample's id.
        day: YYYY-MM-DD it belongs to (``odtctl ingest --day``, else the day it came in).
        ingested_at: when it was stored (UTC, ISO 8601).
        original_path: where the file came from.
        stored_path: the original bytes, relative to the home.
        array_path: the decoded pixels (``.npy``, uint8 height x width x channels), relative to
            the home.
    """

    sha256: str
    day: str
    ingested_at: str
    original_path: str
    stored_path: str
    array_path: str


class SampleRows:
    """``Store``'s sample and quarantine methods (the host provides what is declared here)."""

    db: Any
    _lock: Any  # the host's threading.RLock
    transaction: Callable[[], ContextManager[None]]
    _query: Callable[..., list]
    _rows: Callable[..., list]
    pruned_totals: Callable[[], dict]

    def has_sample(self, sha256: str, labelled: bool = False) -> bool:
        """Whether a sample with this content hash is already stored (or was, and was pruned).

        An image pruned without a label is known to another copy without one; ``labelled`` (the
        copy at hand has a label) makes it a new sample: its label is what was missing.
        """
        return bool(self._query(
            "SELECT EXISTS (SELECT 1 FROM samples WHERE sha256 = ?) OR EXISTS (SELECT 1 FROM "
            "pruned_samples WHERE sha256 = ? AND (label IS NOT NULL OR NOT ?)) AS known",
            [sha256, sha256, labelled])[0]["known"])

    def add_sample(self, row: dict[str, Any]) -> bool:
        """Insert a sample row; return False when its sha256 is already there (a duplicate)."""
        with self.transaction():  # BEGIN IMMEDIATE: no other writer between the check and the insert
            if self.has_sample(row["sha256"], labelled=row["label"] is not None):
                return False
            self.db["samples"].insert(row)
        return True

    def add_quarantine(self, original_path: str, stored_path: Optional[str], reason: str) -> None:
        """Record a rejected input."""
        with self.transaction():
            self.db["quarantine"].insert(
                {"at": utc_now(), "original_path": original_path, "stored_path": stored_path,
                 "reason": reason})

    # Within a day, samples go by hash, not by the second each was stored: what a session is
    # given (which of a day's images, in what order) is then a function of the days' images,
    # not of how long their ingest took (a day's 576 images span 1 to 15 seconds).
    def samples(self, status: str, limit: Optional[int] = None) -> list[dict[str, Any]]:
        """Return labelled samples in a status (``LABELLED_STATUSES``), oldest day first.

        Raises:
            StoreError: another status (unlabelled samples: ``unlabelled_samples``).
        """
        if status not in LABELLED_STATUSES:
            raise StoreError(f"samples({status!r}): a labelled sample's status is one of "
                             f"{', '.join(LABELLED_STATUSES)}; unlabelled ones: unlabelled_samples()")
        return self._rows("samples", "status = ?", [status],
                          order_by="day, sha256", limit=limit)

    def samples_by_sha(self, shas: Iterable[str]) -> list[dict[str, Any]]:
        """Return the labelled sample rows for these hashes (unknown ones are skipped)."""
        # One JSON array parameter, not one ``?`` per hash: SQLite caps bound parameters.
        return self._rows("samples", "status != ? AND sha256 IN (SELECT value FROM json_each(?))",
                          [UNLABELLED, json.dumps(list(shas))])

    def device_samples(self, limit: int) -> list[dict[str, Any]]:
        """Return labelled samples sessions trained on (not the replay seed's), the newest first."""
        return self._rows("samples", "status = 'trained' AND session_id > 0", [],
                          order_by="day DESC, sha256", limit=limit)

    def mark_trained(self, shas: Iterable[str], session_id: int) -> None:
        """Mark pending (labelled) samples as trained by a session."""
        with self.transaction():
            self.db.execute(
                "UPDATE samples SET status = 'trained', session_id = ? WHERE status = 'pending'"
                " AND sha256 IN (SELECT value FROM json_each(?))",
                [session_id, json.dumps(list(shas))],
            )

    def sample_counts(self) -> dict[str, int]:
        """Return counts: total, pending, trained, holdout, unlabelled, quarantined, pruned.

        ``total`` is the labelled samples' (pending, trained and held out); ``unlabelled`` apart.
        """
        counts = {"total": 0, **dict.fromkeys(LABELLED_STATUSES, 0), UNLABELLED: 0}
        for row in self._query("SELECT status, count(*) AS n FROM samples GROUP BY status"):
            counts[row["status"]] = row["n"]
            if row["status"] in LABELLED_STATUSES:
                counts["total"] += row["n"]
        with self._lock:
            counts["quarantined"] = self.db["quarantine"].count
        counts["pruned"] = self.pruned_totals()["samples"]
        return counts

    def unlabelled_samples(self, limit: int) -> list[UnlabelledSample]:
        """The ``limit`` newest unlabelled samples (by day, then hash), the newest day first.

        Raises:
            StoreError: ``limit`` is not a positive number.
        """
        if limit < 1:
            raise StoreError(f"unlabelled_samples: limit {limit}: give a positive number")
        rows = self._query(
            "SELECT sha256, day, ingested_at, original_path, stored_path, array_path FROM samples "
            "WHERE status = ? ORDER BY day DESC, sha256 LIMIT ?",
            [UNLABELLED, limit])
        return [UnlabelledSample(**row) for row in rows]

    def label_sample(self, sha256: str, label: str, status: str) -> bool:
        """Give a stored unlabelled sample ``label`` and ``status`` (pending or holdout).

        Its day, files and time stored stay. Returns False when no unlabelled sample has this
        hash (none is stored, or it is labelled already: a label once given stays).

        Raises:
            StoreError: ``status`` is neither pending nor holdout.
        """
        if status not in ("pending", "holdout"):
            raise StoreError(f"label_sample: status {status!r}: a newly labelled sample is "
                             "pending or holdout")
        with self.transaction():
            cursor = self.db.execute("UPDATE samples SET label = ?, status = ? "
                                     "WHERE sha256 = ? AND status = ?",
                                     [label, status, sha256, UNLABELLED])
        return cursor.rowcount == 1
