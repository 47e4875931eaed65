"""scripts/reproduce_tx2_daily.py end to end on a sliver of the real CIFAR-10 archive (tinycnn: the
same path as densenet40, in a tenth of the time)."""

import json
import sqlite3
import subprocess
import sys

import pytest
from conftest import CIFAR, REPO

from odtd.policy import load_policy
from odtd.session.acceptance import refusal_reason


@pytest.mark.trains
@pytest.mark.skipif(not CIFAR.exists(), reason=f"CIFAR-10 archive not at {CIFAR} (set ODTD_CIFAR10)")
def test_two_days_through_the_real_session_path(tmp_path):
    work, plot = tmp_path / "work", tmp_path / "plot.png"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "reproduce_tx2_daily.py"), "--cifar", str(CIFAR),
         "--model", "tinycnn", "--days", "2", "--per-day", "10", "--pretrain-images", "60",
         "--pretrain-max-epochs", "1",
         "--target", "0", "--validation-images", "50", "--test-images", "100",
         "--daily-test-images", "50", "--work", str(work), "--plot", str(plot), "--json"],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["test_images"] == {"day0_and_final": 100, "daily": 50}
    rows = summary["rows"]
    assert [r["day"] for r in rows] == [0, 1, 2]
    # Both runs start from the same pre-trained weights, scored once.
    assert rows[0]["odtd_daily_subset"] == rows[0]["plain_test_accuracy"]
    assert summary["odtd"]["day0"] == summary["plain"]["day0"] == summary["pretrain"]["test_accuracy"]
    # odtd's every day is its served model on all test images; a version is scored once.
    assert rows[0]["odtd_test_accuracy"] == summary["odtd"]["day0"]
    assert rows[-1]["odtd_test_accuracy"] == summary["odtd"]["final"]
    by_version = {0: (rows[0]["odtd_test_accuracy"], rows[0]["odtd_daily_subset"])}
    for row in rows[1:]:
        scores = (row["odtd_test_accuracy"], row["odtd_daily_subset"])
        assert by_version.setdefault(row["model_version"], scores) == scores
    for name in ("odtd", "plain"):
        gain = 100 * (summary[name]["final"] - summary[name]["day0"])
        assert summary[name]["gain_points"] == pytest.approx(gain)
    outcomes = summary["odtd"]["outcomes"]
    assert outcomes["promoted"] + outcomes["rolled_back"] == 2 and outcomes["failed"] == 0
    acceptance = summary["acceptance"]
    shipped = load_policy(REPO / "policies" / "densenet40.yaml").acceptance  # the default --policy
    assert acceptance == shipped.model_dump()
    for row in rows[1:]:
        assert row["outcome"] in ("promoted", "rolled_back")
        assert row["energy_j"] > 0 and row["peak_memory_mb"] > 100
    # A rolled-back day keeps the model; a promoted one makes the next version.
    for before, row in zip([0, rows[1]["model_version"]], rows[1:]):
        assert row["model_version"] == before + (row["outcome"] == "promoted")
    # The sessions went through a real odtd home: SQLite rows, ingested samples, versions.
    db = sqlite3.connect(work / "odtd-home" / "odtd.db")
    assert db.execute("SELECT count(*) FROM sessions").fetchone()[0] == 2
    # The policy's guard (tolerance, standard errors of the paired difference) decided
    # each day; the second session went on from the first's candidate unless it was promoted.
    sessions = db.execute("SELECT outcome, accuracy_before, accuracy_after, details FROM sessions "
                          "ORDER BY id").fetchall()
    for outcome, before, after, details in sessions:
        refusal = refusal_reason(before, after, acceptance["tolerance"] / 100,
                                 acceptance["confidence_z"], json.loads(details)["paired"])
        assert (outcome == "promoted") == (refusal is None)
    first = json.loads(sessions[0][3])
    assert json.loads(sessions[1][3])["resumed"] == bool(first.get("kept_for_resume"))
    # 20 device samples beside the replay seed: the 60 pre-training images, trained by session 0.
    assert summary["replay_seed"] == 60
    assert db.execute("SELECT count(*) FROM samples WHERE session_id = 0").fetchone()[0] == 60
    assert db.execute("SELECT count(*) FROM samples").fetchone()[0] == 80
    assert db.execute("SELECT sum(samples_replay) FROM sessions").fetchone()[0] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "day 2 odtd" in subprocess.run(
        [sys.executable, "-c", "import json, sys; sys.path.insert(0, 'scripts');"
         "import reproduce_tx2_daily as r; print(r.table(json.load(sys.stdin)))"],
        input=proc.stdout, capture_output=True, text=True, cwd=REPO, check=True).stdout


def test_missing_archive_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "reproduce_tx2_daily.py"),
                           "--cifar", str(tmp_path / "nope.tar.gz")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: --cifar") and proc.stderr.count("\n") == 1
