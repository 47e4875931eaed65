import os
import sqlite3
import threading

import pytest

from odtd.errors import StoreError
from odtd.store.database import Store
from odtd.store.liveness import Liveness
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


@pytest.mark.skipif(not os.environ.get("ODTD_TEST_SQLITE_VERSION"),
                    reason="make test-tx2 sets it: the SQLite a TX2's Ubuntu ships (scripts/build_sqlite.sh)")
def test_the_daemons_tests_run_on_the_sqlite_they_were_given():
    # make test-tx2 builds Ubuntu 18.04's SQLite and puts it on LD_LIBRARY_PATH; this says it took.
    assert sqlite3.sqlite_version == os.environ["ODTD_TEST_SQLITE_VERSION"]


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


def test_reference_origin_is_version_0s_first_measure(tmp_path):
    # The first finished session that served version 0 and scored the reference: not a
    # later version's measure, not a session without a reference, not one still running.
    store = Store(tmp_path / "odtd.db")
    assert store.reference_origin() is None
    for version, reference, finished in ((0, None, True), (0, 0.45, False), (1, 0.40, True),
                                         (0, 0.52, True), (0, 0.60, True)):
        record = SessionRecord(day="2026-11-22", trigger="cli", model_version_before=version,
                               outcome="rolled_back")
        record.details.reference_accuracy_before = reference
        store.start_session(record)
        if finished:
            store.finish_session(record)
    assert store.reference_origin() == 0.52


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


def test_last_judged_session_passes_over_skipped_failed_and_running_ones(tmp_path):
    store = Store(tmp_path / "odtd.db")
    assert store.last_judged_session() is None
    for outcome in ("promoted", "rolled_back", "skipped", "failed", "interrupted", None):
        record = SessionRecord(day="2026-11-26", trigger="schedule", outcome=outcome)
        store.start_session(record)
        if outcome is not None:  # the last one stays running
            store.finish_session(record)
    judged = store.last_judged_session()
    assert (judged.id, judged.outcome) == (2, "rolled_back")


def test_a_version_never_promoted_has_the_latest_judged_sessions_measure_of_it(tmp_path):
    store = Store(tmp_path / "odtd.db")
    assert store.measured_accuracy(0) is None
    for outcome, version, before in (("promoted", 0, 0.41), ("rolled_back", 0, 0.43),
                                     ("failed", 0, 0.99), ("promoted", 1, 0.52)):
        record = SessionRecord(day="2026-11-26", trigger="schedule", outcome=outcome,
                               model_version_before=version, accuracy_before=before)
        store.start_session(record)
        store.finish_session(record)
    assert (store.measured_accuracy(0), store.measured_accuracy(1)) == (0.43, 0.52)
    assert store.measured_accuracy(2) is None


def snapshot(path):
    """Every row of every table, read through a connection of its own (what another process sees)."""
    conn = sqlite3.connect(path)
    tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    rows = {table: sorted(map(repr, conn.execute(f'SELECT * FROM "{table}"'))) for table in tables}
    conn.close()
    return rows


def sample_row(sha: str, status: str = "pending", label: str = "cat") -> dict:
    return {"sha256": sha, "label": label, "day": "2026-11-22", "status": status,
            "original_path": f"/in/{sha}.png", "stored_path": f"samples/{sha}.png",
            "array_path": f"samples/{sha}.npy", "width": 32, "height": 32, "ingested_at": "t"}


def populate(store):
    """Committed rows for every table, so a later transaction can update and delete them."""
    store.set_meta(model="tinycnn")
    for sha in ("a1", "b2"):
        store.add_sample(sample_row(sha))
    store.add_model_version({"model": "tinycnn", "version": 0, "sha256": "f" * 64})
    record = SessionRecord(day="2026-11-22", trigger="cli")
    store.start_session(record)
    store.update_replay([{"sha256": "a1", "label": "cat", "size_bytes": 10, "added_session": 1}],
                        [], {"cat": 1})
    liveness = Liveness(store.path)
    liveness.write_daemon(pid=41, heartbeat_at="t0")
    liveness.close()
    return record


def test_failed_transaction_rolls_back_everything(tmp_path):
    # Every write path the session's promotion and ingest use, in one transaction that fails:
    # sqlite-utils 3.x commits in its writes unless the store keeps them inside BEGIN IMMEDIATE.
    path = tmp_path / "odtd.db"
    store = Store(path)
    record = populate(store)
    before = snapshot(path)
    with pytest.raises(RuntimeError, match="boom"):
        with store.transaction():
            store.log_event("a", "first")
            store.set_meta(model="densenet40", classes=["cat"])
            store.add_sample(sample_row("c3"))
            store.add_quarantine("/in/x.png", None, "not an image")
            store.mark_trained(["a1", "b2"], record.id)
            record.steps, record.outcome = 4, "promoted"
            store.save_session(record)
            store.add_steps(record.id, [{"index": 0, "batch_size": 8, "start": 1.0, "end": 2.0}])
            store.finish_session(record)
            store.start_session(SessionRecord(day="2026-11-23", trigger="cli"))
            store.add_model_version({"model": "tinycnn", "version": 1, "sha256": "e" * 64})
            store.set_model_version_state("tinycnn", 0, "pruned")
            store.update_replay([{"sha256": "b2", "label": "cat", "size_bytes": 10}], ["a1"],
                                {"cat": 2})
            store.add_profile_rows("tinycnn", "estimate", "x86_64", 3,
                                   [{"batch_size": 4, "precision": "fp32", "status": "ok"}])
            assert snapshot(path) == before  # nothing committed early, for other connections
            raise RuntimeError("boom")
    assert snapshot(path) == before
    assert store.meta("model") == "tinycnn" and store.events() == []
    assert store.session(record.id).state == "running"
    store.log_event("after", "the store writes again")  # the connection is not stuck in a transaction
    assert [e["kind"] for e in Store(path).events()] == ["after"]


def test_failed_write_inside_a_transaction_undoes_only_itself(tmp_path):
    # A caller that catches a failed write goes on in the same transaction: the write is a
    # savepoint, not the end of the transaction.
    store = Store(tmp_path / "odtd.db")
    with store.transaction():
        store.log_event("kept", "before the failed write")
        with pytest.raises(sqlite3.IntegrityError):
            store.add_sample(sample_row("a1", status="lost"))
        store.log_event("kept", "after the failed write")
    assert [e["message"] for e in Store(tmp_path / "odtd.db").events()] == [
        "after the failed write", "before the failed write"]
    assert store.sample_counts()["total"] == 0


def test_later_writes_replace_or_keep_fields_as_each_table_needs(tmp_path):
    store = Store(tmp_path / "odtd.db")
    store.set_meta(model="tinycnn", classes=["a", "b"])
    store.set_meta(model="densenet40")
    assert (store.meta("model"), store.meta("classes")) == ("densenet40", ["a", "b"])
    # The daemon's liveness row is upserted: a heartbeat keeps the pid the start wrote.
    assert store.daemon_row() is None
    liveness = Liveness(store.path)
    liveness.write_daemon(pid=41, started_at="t0", heartbeat_at="t0")
    liveness.write_daemon(heartbeat_at="t1")
    liveness.close()
    row = store.daemon_row()
    assert (row["pid"], row["started_at"], row["heartbeat_at"], row["paused"]) == (41, "t0", "t1", 0)
    store.update_replay([], [], {"cat": 1})
    store.update_replay([], [], {"cat": 3, "dog": 1})
    assert store.replay_seen() == {"cat": 3, "dog": 1}


def test_updating_a_row_that_is_not_there_names_it(tmp_path):
    store = Store(tmp_path / "odtd.db")
    with pytest.raises(StoreError, match=r"no model_versions row with key \('tinycnn', 7\)"):
        store.set_model_version_state("tinycnn", 7, "pruned")
    with pytest.raises(StoreError, match="no sessions row with key 9 to update"):
        store.save_session(SessionRecord(day="2026-11-22", trigger="cli", id=9))


def test_samples_by_sha_and_mark_trained_take_more_hashes_than_sqlite_binds(tmp_path):
    # SQLite binds at most 999 parameters in older builds; hashes travel as one JSON array.
    store = Store(tmp_path / "odtd.db")
    store.add_sample(sample_row("a1"))
    store.add_sample(sample_row("b2", status="holdout"))
    unknown = [f"{i:064x}" for i in range(1500)]
    assert {r["sha256"] for r in store.samples_by_sha(unknown + ["a1", "b2"])} == {"a1", "b2"}
    store.mark_trained(unknown + ["a1", "b2"], session_id=3)
    assert [(r["sha256"], r["session_id"]) for r in store.samples("trained")] == [("a1", 3)]
    assert [r["sha256"] for r in store.samples("holdout")] == ["b2"]  # only pending ones train


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


def test_a_thread_sharing_the_store_reads_after_the_writers_transaction(tmp_path):
    # One Store shared by threads (the daemon's): a read waits for the open transaction instead
    # of opening sqlite-utils' read savepoint inside it.
    store = Store(tmp_path / "odtd.db")
    entered, release = threading.Event(), threading.Event()
    seen = []

    def write():
        with store.transaction():
            store.log_event("committed", "by the writer")
            entered.set()
            release.wait(5)

    writer = threading.Thread(target=write)
    writer.start()
    entered.wait(5)
    reader = threading.Thread(target=lambda: seen.extend(e["kind"] for e in store.events()))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive(), "the read did not wait for the writer's transaction"
    release.set()
    writer.join()
    reader.join(5)
    assert seen == ["committed"]


def test_duplicate_sample_is_not_added_twice(tmp_path):
    store = Store(tmp_path / "odtd.db")
    row = {"sha256": "ab" * 32, "label": "cat", "day": "2026-11-22", "status": "pending",
           "original_path": "/x.png", "stored_path": "samples/ab/x.png",
           "array_path": "samples/ab/x.npy", "width": 32, "height": 32, "ingested_at": "t"}
    assert store.add_sample(row) is True
    assert store.add_sample(row) is False
    assert store.sample_counts()["pending"] == 1
