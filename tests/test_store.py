import sqlite3
import threading

import pytest

from odtd.errors import StoreError
from odtd.store.database import SESSION_KEYS, Store
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


def test_session_object_has_every_contract_key(tmp_path):
    store = Store(tmp_path / "odtd.db")
    sid = store.start_session("2026-11-22", "cli", model_version_before=0)
    store.finish_session(sid, outcome="skipped", reason="no pending samples",
                         energy_by_rail_j={"VDD_IN": 1.5})
    session = store.session(sid)
    assert set(SESSION_KEYS) <= set(session)
    assert session["energy_by_rail_j"] == {"VDD_IN": 1.5}
    with pytest.raises(StoreError, match="outcome"):
        store.finish_session(sid, outcome="great")


def test_last_kept_for_resume_is_the_latest_finished_one(tmp_path):
    store = Store(tmp_path / "odtd.db")
    assert store.last_kept_for_resume() is None
    kept = []
    for details in ({"kept_for_resume": True}, {"kept_for_resume": True}, {"resumed": True}, {}):
        sid = store.start_session("2026-11-22", "cli", model_version_before=0)
        store.finish_session(sid, outcome="rolled_back", details=details)
        kept += [sid] if details.get("kept_for_resume") else []
    running = store.start_session("2026-11-23", "cli", model_version_before=0)
    store.update_session(running, details={"kept_for_resume": True})
    assert store.last_kept_for_resume()["id"] == kept[-1] == 2


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
