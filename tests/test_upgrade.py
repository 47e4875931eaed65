"""A home made by the last release opens after the upgrade with nothing lost.

``tests/fixtures/home-0.1.0`` was made by odtd 0.1.0 itself (commit 4e592a8) with
``tests/fixtures/make_home_0_1_0.sh``: two sessions (one rolled back, one promoted), pending
and held-out samples, a quarantined file, a profile, the daemon's liveness row. Beside it,
``home-0.1.0.expected.json`` holds what that release's ``odtctl`` printed for it.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from odtd.store.schema import MIGRATIONS

FIXTURES = Path(__file__).parent / "fixtures"


def odtctl(home: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "odtd.cli", "--home", str(home), *args, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def release_home(tmp_path: Path) -> tuple[Path, dict]:
    home = tmp_path / "home"
    shutil.copytree(FIXTURES / "home-0.1.0", home)
    expected = json.loads((FIXTURES / "home-0.1.0.expected.json").read_text())
    for name in expected["empty_directories"]:  # git keeps no empty directory
        (home / name).mkdir(exist_ok=True)
    return home, expected


def without_clock(status: dict) -> dict:
    """The status object less what changes with the wall clock and the home's path, and what
    later releases add: the disk (``storage``), the counts of pruned and unlabelled samples, a
    daemon alive but silent."""
    status = json.loads(json.dumps(status))
    status["daemon"].pop("heartbeat_age_s")
    status["daemon"].pop("silent_pid", None)
    status.pop("home")
    status.pop("storage", None)
    status["samples"].pop("pruned", None)
    status["samples"].pop("unlabelled", None)
    return status


def as_released(sessions: list) -> list:
    """Session objects less ``cumulative``, which later releases add (joules per point)."""
    for session in sessions:
        assert set(session["cumulative"]) == {"energy_j", "gain_points", "j_per_point"}
    return [{k: v for k, v in session.items() if k != "cumulative"} for session in sessions]


def test_a_release_home_reads_the_same_after_the_upgrade(tmp_path):
    home, expected = release_home(tmp_path)
    assert expected["schema_version"] <= len(MIGRATIONS)

    assert as_released(odtctl(home, "history")) == expected["history"]
    # Later releases give version 0 the accuracy the latest judged session measured of it.
    v0_measured = next(s["accuracy_before"] for s in expected["history"]  # newest first
                       if s["outcome"] in ("promoted", "rolled_back")
                       and s["model_version_before"] == 0)
    released = [dict(v, accuracy=v0_measured) if v["version"] == 0 else v
                for v in expected["versions"]]
    assert odtctl(home, "models", "versions") == released
    status = odtctl(home, "status")
    status["sessions"] = as_released(status["sessions"])
    # Later releases add the learning rate sessions start at: the policy's, nothing remembered.
    assert status["model"].pop("learning_rate") == {"rate": 0.01, "policy_rate": 0.01,
                                                    "found_by": None}
    assert without_clock(status) == without_clock(expected["status"])

    conn = sqlite3.connect(home / "odtd.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    for table, count in expected["row_counts"].items():
        assert conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0] == count, table
    conn.close()


def test_the_upgraded_home_takes_new_samples_beside_the_old_ones(tmp_path):
    home, expected = release_home(tmp_path)
    before = expected["status"]["samples"]
    folder = tmp_path / "new" / "cat"
    folder.mkdir(parents=True)
    for i in range(3):
        pixels = np.random.default_rng(100 + i).integers(0, 256, (40, 30, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.jpg")

    report = odtctl(home, "ingest", str(tmp_path / "new"), "--day", "2026-11-23")

    assert report["accepted"] == 3
    samples = odtctl(home, "status")["samples"]
    assert samples["total"] == before["total"] + 3
    assert samples["pending"] + samples["holdout"] == before["pending"] + before["holdout"] + 3
    assert samples["trained"] == before["trained"]
    assert as_released(odtctl(home, "history")) == expected["history"]
