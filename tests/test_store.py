import sqlite3
import threading

import pytest

from odtd.errors import StoreError
from odtd.store.database import Store
from odtd.store.records import SESSION_KEYS, SessionRecord
from odtd.store.schema import MIGRATIONS


def test_new_database_is_wal_and_migrated(tmp_path):
    store = Store(tmp_path / "odtd.db")
    assert store.schema_version == len(MIGRATIONS)
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert {"samples", "sessions", "steps", "model_versions", "events"} <= set(store.db.table_names())
    store.close()
    # Reopening applies nothing twice.
    assert Store(tmp_path / "odtd.db").schema_version == len(MIGRATIONS)


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "odtd.db"
    Store(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this odtd knows"):
        Store(path)


def test_session_record_round_trips_as_the_contract_object(tmp_path):
    store = Store(tmp_path / "odtd.db")
    record = SessionRecord(day="2026-11-22", trigger="cli", model_version_before=0)
    sid = store.start_session(record)
    record.outcome, record.reason = "skipped", "no pending samples"
    record.energy_by_rail_j = {"VDD_IN": 1.5}
    record.details.paired = {"gained": 3, "lost": 1, "samples": 50}
    store.finish_session(record)
    stored = store.session(sid)
    assert stored == record and stored.state == "done" and stored.finished_at
    session = stored.to_dict()
    assert list(session)[:len(SESSION_KEYS)] == list(SESSION_KEYS)
    assert session["energy_by_rail_j"] == {"VDD_IN": 1.5}
    assert session["details"]["paired"] == {"gained": 3, "lost": 1, "samples": 50}
    record.outcome = "great"
    with pytest.raises(StoreError, match="outcome"):
        store.finish_session(record)


def test_details_written_by_an_older_release_read_back(tmp_path):
    store = Store(tmp_path / "odtd.db")
    record = SessionRecord(day="2026-11-22", trigger="cli")
    store.start_session(record)
    store.db.execute("UPDATE sessions SET details = ? WHERE id = ?",
                     ['{"forced": true, "paired": null, "retired_key": 7}', record.id])
    details = store.session(record.id).details
    assert details.forced is True and details.kept_for_resume is False
    assert details.to_dict()["retired_key"] == 7


def test_last_kept_for_resume_is_the_latest_finished_one(tmp_path):
    store = Store(tmp_path / "odtd.db")
    assert store.last_kept_for_resume() is None
    kept = []
    for keep in (True, True, False, False):
        record = SessionRecord(day="2026-11-22", trigger="cli", outcome="rolled_back")
        record.details.kept_for_resume = keep
        store.start_session(record)
        store.finish_session(record)
        kept += [record.id] if keep else []
    running = SessionRecord(day="2026-11-23", trigger="cli")
    running.details.kept_for_resume = True
    store.start_session(running)
    store.save_session(running)
    assert store.last_kept_for_resume().id == kept[-1] == 2


def test_failed_transaction_rolls_back_everything(tmp_path):
    store = Store(tmp_path / "odtd.db")
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.log_event("a", "first")
            store.set_meta(model="tinycnn")
            raise RuntimeError("boom")
    assert store.events() == []
    assert store.meta("model") is None


def test_reader_works_while_a_writer_holds_a_transaction(tmp_path):
    writer = Store(tmp_path / "odtd.db")
    writer.log_event("seen", "committed before")
    reader = Store(tmp_path / "odtd.db")
    entered, release = threading.Event(), threading.Event()

    def write():
        with writer.transaction():
            writer.log_event("unseen", "not yet committed")
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=write)
    thread.start()
    entered.wait(5)
    kinds = [e["kind"] for e in reader.events()]  # does not block on the writer
    release.set()
    thread.join()
    assert kinds == ["seen"]
    assert [e["kind"] for e in reader.events()] == ["unseen", "seen"]


def test_duplicate_sample_is_not_added_twice(tmp_path):
    store = Store(tmp_path / "odtd.db")
    row = {"sha256": "ab" * 32, "label": "cat", "day": "2026-11-22", "status": "pending",
           "original_path": "/x.png", "stored_path": "samples/ab/x.png",
           "array_path": "samples/ab/x.npy", "width": 32, "height": 32, "ingested_at": "t"}
    assert store.add_sample(row) is True
    assert store.add_sample(row) is False
    assert store.sample_counts()["pending"] == 1
