"""The fleet server's record: each round in its own SQLite file (``odtctl fleet status``).

A round's rows are written in one transaction when it is aggregated, so a server that stops
(or is killed) loses no round it recorded. Standard library only: ``odtctl fleet status`` reads
it on any Python odtd runs on.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional

from odtd.errors import StoreError

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, started_at TEXT, finished_at TEXT, settings TEXT);
CREATE TABLE IF NOT EXISTS rounds (
    run_id TEXT, round INTEGER, started_at TEXT, seconds REAL, asked INTEGER, trained INTEGER,
    declined INTEGER, no_reply INTEGER, joules REAL, session_s_max REAL, outside_share REAL,
    metrics TEXT, PRIMARY KEY (run_id, round));
CREATE TABLE IF NOT EXISTS evaluations (
    run_id TEXT, round INTEGER, metrics TEXT, devices TEXT, PRIMARY KEY (run_id, round));
CREATE TABLE IF NOT EXISTS devices (
    run_id TEXT, round INTEGER, node_id TEXT, outcome TEXT, reason TEXT, metrics TEXT,
    PRIMARY KEY (run_id, round, node_id));
"""
OUTCOMES = ("trained", "declined", "no reply")


def utc_now() -> str:
    """The time now, ISO 8601 in UTC to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class DeviceReply:
    """One device's part of a round.

    Its ``outcome``: ``trained`` (with its metrics), ``declined`` (``reason``: the device's words)
    or ``no reply`` (within the round's timeout).
    """

    node_id: str
    outcome: str
    reason: Optional[str] = None
    metrics: Dict[str, float] = field(default_factory=dict)


@dataclass
class RoundRecord:
    """One aggregated round.

    Attributes:
        seconds: From sending the round's messages to the end of aggregation.
        joules: The devices' sessions' energy, summed (None where no device measured any).
        session_s_max: The longest device session: the round cannot be shorter.
        outside_share: The share of the round spent outside the longest session (Flower's
            messaging, the devices' session set-up, aggregation).
        flower_share: The share outside the longest device's whole part (``device-seconds``):
            Flower's alone (``outside_share`` less the devices' own set-up).
        metrics: The strategy's aggregate of the trained devices' metrics (weighted by examples).
        evaluation: The round's evaluate round, where the server asked for one: ``metrics``
            (the round's global model on the devices' own sets, weighted by their held-out
            samples) and ``devices`` (each one's reply, or why it declined).
    """

    run_id: str
    round: int
    started_at: str
    seconds: float
    devices: List[DeviceReply]
    metrics: Dict[str, float] = field(default_factory=dict)
    evaluation: Optional[Dict[str, Any]] = None

    def count(self, outcome: str) -> int:
        """How many devices ended the round so."""
        return sum(1 for device in self.devices if device.outcome == outcome)

    @property
    def joules(self) -> Optional[float]:
        """The trained devices' session energy, summed."""
        values = [d.metrics.get("joules") for d in self.devices if d.outcome == "trained"]
        values = [v for v in values if v is not None and v == v]  # NaN: not measured
        return round(sum(values), 3) if values else None

    @property
    def session_s_max(self) -> Optional[float]:
        """The longest trained device's session."""
        values = [d.metrics.get("seconds") for d in self.devices if d.outcome == "trained"]
        values = [v for v in values if v is not None and v == v]
        return max(values) if values else None

    @property
    def device_s_max(self) -> Optional[float]:
        """The longest trained device's part of the round (``device-seconds``), if reported."""
        values = [d.metrics.get("device-seconds") for d in self.devices if d.outcome == "trained"]
        values = [v for v in values if v is not None and v == v]
        return max(values) if values else None

    @property
    def flower_share(self) -> Optional[float]:
        """The round's share outside the longest device's part: Flower's alone.

        Its messaging (polling, the ClientApp's process, the weights' transfer) and aggregation.
        """
        longest = self.device_s_max
        if longest is None or self.seconds <= 0:
            return None
        return round(max(0.0, 1.0 - longest / self.seconds), 4)

    @property
    def outside_share(self) -> Optional[float]:
        """The round's share outside the longest session."""
        longest = self.session_s_max
        if longest is None or self.seconds <= 0:
            return None
        return round(max(0.0, 1.0 - longest / self.seconds), 4)

    def to_dict(self) -> Dict[str, Any]:
        """The round as ``odtctl fleet status --json`` prints it."""
        data = asdict(self)
        data.update(asked=len(self.devices), trained=self.count("trained"),
                    declined=self.count("declined"), no_reply=self.count("no reply"),
                    joules=self.joules, session_s_max=self.session_s_max,
                    outside_share=self.outside_share, device_s_max=self.device_s_max,
                    flower_share=self.flower_share)
        return data


class RoundLog:
    """The record file: runs, their rounds and each device's part.

    Args:
        path: The SQLite file (created with its directory).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.path), timeout=30)
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"{self.path}: cannot open the fleet's record ({exc})") from None

    @classmethod
    def open_existing(cls, path: Path) -> RoundLog:
        """Open a record that must exist (``odtctl fleet status``)."""
        if not Path(path).is_file():
            raise StoreError(f"{path}: no fleet record here; give the server's record file "
                             "(its YAML's `record`)")
        return cls(path)

    def close(self) -> None:
        """Close the file."""
        self.db.close()

    def start_run(self, run_id: str, settings: Dict[str, Any]) -> None:
        """Record a run's start and its settings."""
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?, NULL, ?)",
                            (run_id, utc_now(), json.dumps(settings, default=str, sort_keys=True)))

    def finish_run(self, run_id: str) -> None:
        """Record a run's end."""
        with self.db:
            self.db.execute("UPDATE runs SET finished_at = ? WHERE run_id = ?", (utc_now(), run_id))

    def add_round(self, record: RoundRecord) -> None:
        """Write one round and its devices' rows in one transaction."""
        with self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (record.run_id, record.round, record.started_at, round(record.seconds, 3),
                 len(record.devices), record.count("trained"), record.count("declined"),
                 record.count("no reply"), record.joules, record.session_s_max,
                 record.outside_share, json.dumps(record.metrics, sort_keys=True)))
            self.db.executemany("INSERT OR REPLACE INTO devices VALUES (?, ?, ?, ?, ?, ?)", [
                (record.run_id, record.round, d.node_id, d.outcome, d.reason,
                 json.dumps(d.metrics, sort_keys=True)) for d in record.devices])

    def add_evaluation(self, run_id: str, server_round: int, metrics: Dict[str, float],
                       devices: List[DeviceReply]) -> None:
        """Record a round's evaluate round (after its training round), in one transaction."""
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO evaluations VALUES (?, ?, ?, ?)", (
                run_id, server_round, json.dumps(metrics, sort_keys=True),
                json.dumps([asdict(d) for d in devices], sort_keys=True)))

    def runs(self) -> List[Dict[str, Any]]:
        """Every run, the latest first."""
        rows = self.db.execute("SELECT run_id, started_at, finished_at, settings FROM runs "
                               "ORDER BY started_at DESC, rowid DESC").fetchall()
        return [{"run_id": r[0], "started_at": r[1], "finished_at": r[2],
                 "settings": json.loads(r[3] or "{}")} for r in rows]

    def every_round(self) -> List[Dict[str, Any]]:
        """Every run's rounds (``to_dict``), the oldest run first, numbered on.

        ``round`` counts across the record; ``run_round`` is the round within its run
        (``run_id``): ``fleet simulate`` starts one run of one round a day, so its days are the
        runs (``odtctl fleet status --all``).
        """
        out: List[Dict[str, Any]] = []
        for run in reversed(self.runs()):
            for record in self.rounds(run["run_id"]):
                out.append(dict(record.to_dict(), run_round=record.round, round=len(out) + 1))
        return out

    def rounds(self, run_id: str) -> List[RoundRecord]:
        """A run's rounds in order, each with its devices."""
        out = []
        for row in self.db.execute("SELECT round, started_at, seconds, metrics FROM rounds "
                                   "WHERE run_id = ? ORDER BY round", (run_id,)).fetchall():
            devices = [DeviceReply(node_id=d[0], outcome=d[1], reason=d[2], metrics=json.loads(d[3]))
                       for d in self.db.execute(
                           "SELECT node_id, outcome, reason, metrics FROM devices WHERE run_id = ? "
                           "AND round = ? ORDER BY node_id", (run_id, row[0])).fetchall()]
            evaluated = self.db.execute("SELECT metrics, devices FROM evaluations WHERE run_id = ? "
                                        "AND round = ?", (run_id, row[0])).fetchone()
            out.append(RoundRecord(run_id=run_id, round=row[0], started_at=row[1], seconds=row[2],
                                   devices=devices, metrics=json.loads(row[3] or "{}"),
                                   evaluation=None if evaluated is None else {
                                       "metrics": json.loads(evaluated[0]),
                                       "devices": json.loads(evaluated[1])}))
        return out
