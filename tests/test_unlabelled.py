"""Unlabelled images as samples (issue 55): ingested, checked and counted apart, never a labelled
sample: not drawn for replay, held out, evaluated on or counted among the new samples a session
waits for (`training.prior_correction` reads them: test_priors.py; `pseudo_labels`: test_worker.py).

Every test here runs on a copy of ``tests/fixtures/home-0.1.0`` (a home made by odtd 0.1.0:
schema version 3, 10 pending, 28 trained, 12 held-out samples, a 28-entry replay buffer, a
profile), so each also runs the upgrade to the unlabelled samples' schema, and none starts a
TensorFlow worker: the sessions they run stop before one (a wait for samples, the disk's floor).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, odtctl, odtctl_json, wait_for, write_images
from mounts import free_bytes, tmpfs
from prometheus_client.parser import text_string_to_metric_families

from odtd.config import StorageConfig
from odtd.errors import StoreError
from odtd.home.disk import make_room, session_need
from odtd.home.ingest import Ingestor, discover_unlabelled
from odtd.home.paths import UNLABELLED_FOLDER, Home
from odtd.home.replay_buffer import choose_replay, update_buffer
from odtd.policy import load_policy
from odtd.session.evalset import write_evaluation_set
from odtd.session.result import GROUP_HOLDOUT
from odtd.store.database import Store
from odtd.store.samples import UNLABELLED_READ
from odtd.store.schema import MIGRATIONS

FIXTURES = Path(__file__).parent / "fixtures"
# What home-0.1.0 holds (home-0.1.0.expected.json's status). Its images are write_images's of
# seeds 1 to 3 (make_home_0_1_0.sh): the tests' own take other seeds.
RELEASED = {"total": 50, "pending": 10, "trained": 28, "holdout": 12, "quarantined": 1}


@pytest.fixture
def release_home(tmp_path) -> Path:
    """A copy of the home odtd 0.1.0 made (schema version 3), not yet opened by this odtd."""
    home = tmp_path / "home"
    shutil.copytree(FIXTURES / "home-0.1.0", home)
    expected = json.loads((FIXTURES / "home-0.1.0.expected.json").read_text())
    for name in expected["empty_directories"]:  # git keeps no empty directory
        (home / name).mkdir(exist_ok=True)
    return home


def unlabelled_images(root: Path, count: int = 24, seed: int = 55) -> list[Path]:
    """``count`` distinct images under nested folders of ``root`` (no label in their path)."""
    return write_images(root, per_class=count // 2, classes=["cam0", "cam1/dusk"], seed=seed)


def rows(home: Path, where: str = "1") -> list[tuple]:
    conn = sqlite3.connect(home / "odtd.db")
    try:
        return conn.execute(f"SELECT sha256, label, status FROM samples WHERE {where}").fetchall()
    finally:
        conn.close()


def test_a_release_home_upgrades_in_place_and_keeps_its_samples(release_home):
    conn = sqlite3.connect(release_home / "odtd.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    before = conn.execute("SELECT * FROM samples ORDER BY sha256").fetchall()
    conn.close()

    store = Store(release_home / "odtd.db")
    try:
        assert store.schema_version == len(MIGRATIONS)
        assert store.db.execute("PRAGMA foreign_keys").fetchone()[0] == 1  # on again
        assert store.db.execute("PRAGMA foreign_key_check").fetchall() == []
        assert store.integrity_check() == "ok"
        assert list(store.db.execute("SELECT * FROM samples ORDER BY sha256")) == before
        counts = store.sample_counts()
        assert {key: counts[key] for key in RELEASED} == RELEASED and counts["unlabelled"] == 0
        # The replay buffer's entries still name their samples (the table was rebuilt under them).
        buffered = {entry["sha256"] for entry in store.replay_buffer()}
        assert len(buffered) == 28 and buffered <= {row["sha256"] for row in store.samples("trained")}
        # The rebuilt table holds its rule: a sample is unlabelled exactly when it has no label.
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            store.db.execute("UPDATE samples SET label = NULL WHERE status = 'pending'")
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            store.db.execute("UPDATE samples SET status = 'unlabelled' WHERE status = 'pending'")
    finally:
        store.close()


def test_ingest_unlabelled_stores_them_apart_and_status_counts_them(release_home, tmp_path):
    images = unlabelled_images(tmp_path / "drop")
    labelled = write_images(tmp_path / "day", per_class=2, classes=["cat", "dog"], seed=13)
    beside = unlabelled_images(tmp_path / "day" / UNLABELLED_FOLDER, count=4, seed=9)

    report = odtctl_json("ingest", "--unlabelled", str(tmp_path / "drop"), home=release_home)
    # A <label>/ directory's _unlabelled/ folder: its images are unlabelled, not a class.
    mixed = odtctl_json("ingest", str(tmp_path / "day"), home=release_home)

    assert (report["accepted"], report["unlabelled"], report["holdout"], report["rejected"]) == \
        (len(images), len(images), 0, 0)
    assert (mixed["accepted"], mixed["unlabelled"], mixed["rejected"]) == \
        (len(labelled) + len(beside), len(beside), 0)
    stored = rows(release_home, "status = 'unlabelled'")
    assert len(stored) == len(images) + len(beside) and {row[1] for row in stored} == {None}
    assert rows(release_home, f"label = '{UNLABELLED_FOLDER}'") == []
    samples = odtctl_json("status", home=release_home)["samples"]
    new_labelled = len(labelled) - mixed["holdout"]
    assert samples == {"total": 50 + len(labelled), "pending": 10 + new_labelled, "trained": 28,
                       "holdout": 12 + mixed["holdout"], "unlabelled": len(images) + len(beside),
                       "quarantined": 1, "pruned": 0}
    text = odtctl("status", home=release_home).stdout
    assert f"labelled {50 + len(labelled)} (pending {10 + new_labelled}  trained 28" in text
    assert f"unlabelled {len(images) + len(beside)}  quarantined 1" in text
    gauges = {sample.name: sample.value for family in text_string_to_metric_families(
        odtctl("metrics", home=release_home).stdout) for sample in family.samples}
    assert (gauges["odtd_samples_unlabelled"], gauges["odtd_samples_stored"]) == \
        (len(images) + len(beside), 50 + len(labelled))
    again = odtctl("ingest", "--unlabelled", str(images[0]), home=release_home).stdout
    assert again.strip() == "accepted 0 (0 unlabelled), duplicates 1, rejected 0"


def test_a_corrupt_unlabelled_image_is_quarantined_with_its_reason(release_home, tmp_path):
    images = unlabelled_images(tmp_path / "drop", count=4)
    cut = tmp_path / "drop" / "cam1" / "cut.png"
    cut.write_bytes(images[0].read_bytes()[:200])
    (tmp_path / "drop" / "notes.jpg").write_text("this is not an image")

    report = odtctl_json("ingest", "--unlabelled", str(tmp_path / "drop"), home=release_home)

    reasons = {Path(item["path"]).name: item["reason"] for item in report["rejected_files"]}
    assert report["accepted"] == report["unlabelled"] == len(images) and report["rejected"] == 2
    assert reasons["cut.png"].startswith("corrupt or truncated")
    assert reasons["notes.jpg"] == "not an image Pillow can read"
    written = {path.name: path.read_text().strip()  # <stamp>-<n>-<name>.reason.txt
               for path in (release_home / "quarantine").glob("*.reason.txt")}
    for name, reason in reasons.items():
        assert [text for file, text in written.items() if file.endswith(f"-{name}.reason.txt")] == \
            [reason]
    assert cut.exists()  # a CLI ingest leaves its sources alone
    samples = odtctl_json("status", home=release_home)["samples"]
    assert (samples["unlabelled"], samples["quarantined"], samples["total"]) == (len(images), 3, 50)


def test_bad_unlabelled_requests_are_refused_in_one_line(release_home, tmp_path):
    write_images(tmp_path / "drop", per_class=1, classes=["cam0"])
    both = odtctl("ingest", "--unlabelled", "--label", "cat", str(tmp_path / "drop"),
                  home=release_home, check=False)
    assert both.returncode != 0 and "give one of them" in both.stderr.strip().splitlines()[-1]
    (tmp_path / "m.csv").write_text("path,label\ndrop/cam0/0.png,cat\n")
    manifest = odtctl("ingest", "--unlabelled", str(tmp_path / "m.csv"), home=release_home,
                      check=False)
    assert manifest.returncode != 0 and "a CSV manifest gives labels" in manifest.stderr
    assert rows(release_home, "status = 'unlabelled'") == []
    reserved = odtctl("init", "--model", "tinycnn", "--classes", f"cat,{UNLABELLED_FOLDER}",
                      home=tmp_path / "new", check=False)
    assert reserved.returncode != 0 and f"{UNLABELLED_FOLDER!r} is reserved" in reserved.stderr


def test_a_label_given_later_makes_a_labelled_sample_and_one_given_stays(release_home, tmp_path):
    unlabelled_images(tmp_path / "first", count=4, seed=21)
    write_images(tmp_path / "labelled", per_class=2, classes=["cat"], seed=22)
    odtctl_json("ingest", "--unlabelled", str(tmp_path / "first"), home=release_home)
    odtctl_json("ingest", str(tmp_path / "labelled"), home=release_home)
    # The first two images again, now labelled; the labelled ones again, now unlabelled.
    shutil.copytree(tmp_path / "first" / "cam0", tmp_path / "now" / "dog")
    shutil.copytree(tmp_path / "labelled" / "cat", tmp_path / "now" / UNLABELLED_FOLDER)

    report = odtctl_json("ingest", str(tmp_path / "now"), home=release_home)

    assert (report["accepted"], report["labelled_later"], report["duplicates"]) == (2, 2, 2)
    assert sorted(row[1] for row in rows(release_home, "original_path LIKE '%/first/cam0/%'")) == \
        ["dog", "dog"]
    assert {row[1] for row in rows(release_home, "original_path LIKE '%/labelled/cat/%'")} == {"cat"}
    samples = odtctl_json("status", home=release_home)["samples"]
    assert (samples["unlabelled"], samples["total"]) == (2, 50 + 4)


def test_no_session_trains_rehearses_holds_out_or_prunes_an_unlabelled_sample(release_home, tmp_path):
    home = Home(release_home)
    store = home.open_store()
    try:
        images = unlabelled_images(tmp_path / "drop", count=40)
        report = Ingestor.for_home(home, store).ingest(discover_unlabelled(tmp_path / "drop"))
        assert report.unlabelled == len(images)
        unlabelled = {sample.sha256 for sample in store.unlabelled_samples(limit=1000)}
        assert len(unlabelled) == len(images)
        # Some of them would be held out, and so evaluated on, if the hash alone decided.
        assert any(int(sha[:8], 16) % 8 == 0 for sha in unlabelled)

        every_labelled = [row["sha256"] for status in ("pending", "trained", "holdout")
                          for row in store.samples(status)]
        assert len(every_labelled) == 50 and not unlabelled & set(every_labelled)
        assert store.samples_by_sha(unlabelled) == []  # what the replay draw reads rows through
        with pytest.raises(StoreError, match="unlabelled_samples"):
            store.samples("unlabelled")
        policy = load_policy(release_home / "policy.yaml")
        drawn = choose_replay(store, policy.replay, new_count=10_000, seed=1)
        assert len(drawn) == 28 and not unlabelled & {r["sha256"] for r in drawn}  # the whole buffer
        # The held-out group of the evaluation set (acceptance's, without a validation set).
        judged_on, path = write_evaluation_set(home, store, store.meta("classes"), tmp_path)
        with np.load(path) as data:
            assert judged_on == "holdout" and int((data["group"] == GROUP_HOLDOUT).sum()) == 12
        # What a promotion does with a session's samples: unlabelled ones stay as they are.
        pending = store.samples("pending")
        update_buffer(store, policy.replay, pending, session_id=3, root=home.root)
        store.mark_trained([row["sha256"] for row in pending] + sorted(unlabelled), session_id=3)
        assert {sample.sha256 for sample in store.unlabelled_samples(limit=1000)} == unlabelled
        assert not unlabelled & {entry["sha256"] for entry in store.replay_buffer()}
        assert not unlabelled & {row["sha256"] for row in store.prunable_samples(0, 1000)}
        assert store.prunable_unlabelled(UNLABELLED_READ, 1000) == []  # a session reads all 24
        assert not unlabelled & {row["sha256"] for row in store.device_samples(1000)}
    finally:
        store.close()


def test_a_session_counts_and_trains_on_labelled_samples_only(release_home, tmp_path):
    unlabelled_images(tmp_path / "drop", count=30)
    odtctl_json("ingest", "--unlabelled", str(tmp_path / "drop"), home=release_home)
    policy = release_home / "policy.yaml"
    policy.write_text(policy.read_text() + "schedule:\n  min_new_samples: 11\n")

    waiting = odtctl_json("train-now", "--foreground", home=release_home)

    # 10 labelled samples pending, 30 unlabelled: the session waits for the 11th labelled one.
    assert waiting["outcome"] == "skipped"
    assert waiting["reason"] == "waiting for 11 new samples, 10 pending"
    # Past the wait, the disk's floor stops it before a worker starts, its draw recorded.
    policy.write_text(policy.read_text().replace("min_new_samples: 11", "min_new_samples: 10"))
    config = release_home / "odtd.yaml"
    config.write_text(config.read_text() + "storage:\n  min_free_mb: 100000000\n  prune: []\n")

    drawn = odtctl_json("train-now", "--foreground", home=release_home)

    assert drawn["outcome"] == "skipped" and drawn["reason"].startswith("not enough disk space")
    assert (drawn["samples_new"], drawn["samples_replay"]) == (10, 10)  # replay.ratio 1.0
    assert len(rows(release_home, "status = 'unlabelled' AND session_id IS NULL")) == 30


DAEMON_CONFIG = """\
schedule:
  cron: "0 2 * * *"
  misfire_grace_s: 1
inbox:
  scan_interval_s: 0.5
heartbeat_interval_s: 0.5
"""


def _daemon_running(home: Path) -> bool:
    try:
        return odtctl_json("status", home=home)["daemon"]["running"]
    except (AssertionError, ValueError):
        return False


def test_the_daemon_ingests_inbox_unlabelled_as_unlabelled(release_home, tmp_path):
    (release_home / "odtd.yaml").write_text(DAEMON_CONFIG)  # misfire_grace_s: no catch-up session
    images = unlabelled_images(tmp_path / "drop" / "cam", count=6)
    (tmp_path / "drop" / "cam" / "cut.jpg").write_bytes(images[0].read_bytes()[:200])
    labelled = write_images(tmp_path / "drop-cat", per_class=3, classes=["cat"], seed=15)
    proc = subprocess.Popen([sys.executable, "-m", "odtd.daemon.service", "run"],
                            env=dict(os.environ, ODTD_HOME=str(release_home)), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: _daemon_running(release_home) or proc.poll() is not None, 30)
        assert proc.poll() is None, proc.stderr.read()
        inbox = Home(release_home).unlabelled_inbox
        inbox.mkdir(parents=True)
        shutil.move(str(tmp_path / "drop" / "cam"), str(inbox / "cam"))  # inbox/_unlabelled/cam/...
        shutil.move(str(tmp_path / "drop-cat" / "cat"), str(release_home / "inbox" / "cat"))
        assert wait_for(lambda: not any(p.is_file() for p in (release_home / "inbox").rglob("*")), 20)
        samples = odtctl_json("status", home=release_home)["samples"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        proc.stderr.close()
    assert (samples["unlabelled"], samples["quarantined"]) == (len(images), 2)
    assert samples["total"] == 50 + len(labelled)
    assert rows(release_home, f"label = '{UNLABELLED_FOLDER}'") == []
    conn = sqlite3.connect(release_home / "odtd.db")
    reasons = conn.execute("SELECT original_path, reason FROM quarantine ORDER BY id").fetchall()
    conn.close()
    assert reasons[-1][0].endswith(f"inbox/{UNLABELLED_FOLDER}/cam/cut.jpg")
    assert reasons[-1][1].startswith("corrupt or truncated")


def test_pruning_takes_the_oldest_unlabelled_samples_no_session_reads_and_a_label_brings_one_back(
        release_home, tmp_path, monkeypatch):
    """A camera keeps hundreds of unlabelled images a day and a session reads the newest
    ``UNLABELLED_READ`` (8 here): the disk's floor prunes the older ones first, the trained
    samples stay, and a pruned image sent again is a duplicate, or with a label a new sample."""
    monkeypatch.setattr("odtd.home.disk.UNLABELLED_READ", 8)
    old = unlabelled_images(tmp_path / "old", count=12, seed=31)
    unlabelled_images(tmp_path / "new", count=8, seed=32)
    with tmpfs(tmp_path / "disk", 24) as disk:
        shutil.copytree(release_home, disk / "home")
        with open(disk / "home" / "odtd.yaml", "a") as config:
            config.write("storage:\n  min_free_mb: 0\n  prune: [unlabelled]\n")
        home = Home(disk / "home")
        store = home.open_store()
        try:
            ingestor = Ingestor.for_home(home, store)
            ingestor.ingest(discover_unlabelled(tmp_path / "old"), day="2026-11-01")
            ingestor.ingest(discover_unlabelled(tmp_path / "new"), day="2026-11-02")
            newest = {sample.sha256 for sample in store.unlabelled_samples(8)}
            trained = store.sample_counts()["trained"]
            # More than the 12 older ones hold: they all go, and nothing else may (no samples).
            need = free_bytes(disk) + 20 * sum(p.stat().st_size for p in old)
            pruned = make_room(home, store, StorageConfig(min_free_mb=0, prune=["unlabelled"]),
                               need, keep_versions=None)
            assert (pruned.unlabelled, pruned.samples, pruned.runs) == (12, 0, 0)
            assert "12 unlabelled samples" in pruned.describe() and pruned.freed_bytes > 0
            assert {s.sha256 for s in store.unlabelled_samples(1000)} == newest
            counts = store.sample_counts()
            assert (counts["unlabelled"], counts["trained"], counts["pruned"]) == (8, trained, 12)
            assert json.loads(store.events(kind="pruned")[0]["data"])["unlabelled"] == 12
        finally:
            store.close()
        assert len(rows(home.root, "status = 'unlabelled'")) == 8
        on_disk = {p for p in (home.root / "samples").rglob("*") if p.is_file()}
        with sqlite3.connect(home.root / "odtd.db") as conn:
            named = {home.root / path for pair in conn.execute(
                "SELECT stored_path, array_path FROM samples") for path in pair}
        assert on_disk == named  # the pruned images' files went with their rows
        # Sent again: without a label, a duplicate; with one, a new labelled sample.
        shutil.copytree(tmp_path / "old" / "cam0", tmp_path / "again" / "dog")
        assert odtctl_json("ingest", "--unlabelled", str(tmp_path / "old" / "cam0"),
                           home=home.root)["duplicates"] == 6
        report = odtctl_json("ingest", str(tmp_path / "again"), home=home.root)
        assert (report["accepted"], report["duplicates"]) == (6, 0)
        assert odtctl_json("status", home=home.root)["samples"]["unlabelled"] == 8


def test_a_sessions_predicted_writes_count_the_unlabelled_images_it_reads_and_a_weights_copy(
        release_home, tmp_path, monkeypatch):
    """The train file carries the newest ``UNLABELLED_READ`` images without a label where the
    policy reads them (never more), and ``prior_correction`` may add a copy of the weights."""
    monkeypatch.setattr("odtd.home.disk.UNLABELLED_READ", 8)
    unlabelled_images(tmp_path / "seen", count=12, seed=33)
    home = Home(release_home)
    store = home.open_store()
    try:
        Ingestor.for_home(home, store).ingest(discover_unlabelled(tmp_path / "seen"),
                                              day="2026-11-03")
        weights = tmp_path / "weights.npz"
        weights.write_bytes(b"w" * 5000)
        pixels = int(np.prod(store.meta("input_shape")))
        plain = session_need(home, store, 10, weights)
        reads = session_need(home, store, 10, weights, unlabelled=True)
        copies = session_need(home, store, 10, weights, copies_weights=True)
    finally:
        store.close()
    assert reads.parts["job data"] - plain.parts["job data"] == 8 * pixels  # 8 of the 12
    assert copies.parts["version"] - plain.parts["version"] == 5000
    assert reads.parts["candidate"] == copies.parts["candidate"] == 5000


def test_migration_9_keeps_the_pruned_rows_and_takes_an_unlabelled_one(tmp_path):
    path = tmp_path / "odtd.db"
    conn = sqlite3.connect(path)
    for script in MIGRATIONS[:8]:
        conn.executescript(script)
    conn.execute("INSERT INTO pruned_samples VALUES ('a' , 'cat', '2026-11-01', 3, 4096, 'then')")
    conn.execute("PRAGMA user_version = 8")
    conn.commit()
    conn.close()
    store = Store(path)
    try:
        assert store.schema_version == len(MIGRATIONS) >= 9
        store.db["pruned_samples"].insert({"sha256": "b", "label": None, "day": "2026-11-02",
                                           "session_id": None, "size_bytes": 1, "pruned_at": "now"})
        assert store.has_sample("a", labelled=True) and store.has_sample("b")
        assert not store.has_sample("b", labelled=True)  # pruned without a label: a label is new
        assert store.pruned_totals() == {"samples": 2, "bytes": 4097}
    finally:
        store.close()
