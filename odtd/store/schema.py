"""The state database's schema: ``MIGRATIONS``, applied in order by ``Store.migrate``.

Migration *n* (1-based) brings ``PRAGMA user_version`` from *n - 1* to *n*. Append, never edit:
a device upgraded in the field has run the earlier ones.
"""

from __future__ import annotations

LABELLED_STATUSES: tuple[str, ...] = ("pending", "trained", "holdout")
"""A labelled sample's statuses: waiting for a session, trained on, held out for evaluation."""
UNLABELLED = "unlabelled"
"""The status of a sample stored without a label (its ``label`` is NULL): never trained on,
drawn for replay, evaluated on or pruned (migration 8)."""

MIGRATIONS: list[str] = [
    # 1: the session path.
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE samples (
        sha256 TEXT PRIMARY KEY,
        label TEXT NOT NULL,
        day TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('pending', 'trained', 'holdout')),
        original_path TEXT NOT NULL,
        stored_path TEXT NOT NULL,
        array_path TEXT NOT NULL,
        width INTEGER NOT NULL,
        height INTEGER NOT NULL,
        ingested_at TEXT NOT NULL,
        session_id INTEGER
    );
    CREATE INDEX samples_status ON samples (status, day);
    CREATE TABLE quarantine (
        id INTEGER PRIMARY KEY,
        at TEXT NOT NULL,
        original_path TEXT NOT NULL,
        stored_path TEXT,
        reason TEXT NOT NULL
    );
    CREATE TABLE sessions (
        id INTEGER PRIMARY KEY,
        day TEXT NOT NULL,
        trigger TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('running', 'done')),
        started_at TEXT NOT NULL,
        finished_at TEXT,
        outcome TEXT,
        reason TEXT,
        model_version_before INTEGER,
        model_version_after INTEGER,
        batch_size INTEGER,
        epochs INTEGER,
        samples_new INTEGER,
        samples_replay INTEGER,
        steps INTEGER,
        duration_s REAL,
        throughput_sps REAL,
        accuracy_before REAL,
        accuracy_after REAL,
        energy_j REAL,
        energy_by_rail_j TEXT,
        energy_source TEXT,
        energy_coverage REAL,
        peak_memory_mb REAL,
        worker_pid INTEGER,
        details TEXT
    );
    CREATE TABLE steps (
        session_id INTEGER NOT NULL REFERENCES sessions (id),
        idx INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        batch_size INTEGER NOT NULL,
        loss REAL,
        start_mono REAL NOT NULL,
        end_mono REAL NOT NULL,
        energy_j REAL,
        PRIMARY KEY (session_id, idx)
    );
    CREATE TABLE model_versions (
        model TEXT NOT NULL,
        version INTEGER NOT NULL,
        parent INTEGER,
        session_id INTEGER,
        created_at TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        param_count INTEGER,
        accuracy REAL,
        state TEXT NOT NULL DEFAULT 'kept',
        PRIMARY KEY (model, version)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY,
        at TEXT NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL,
        data TEXT
    );
    CREATE TABLE daemon (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        pid INTEGER,
        started_at TEXT,
        heartbeat_at TEXT,
        next_session_at TEXT,
        paused INTEGER NOT NULL DEFAULT 0,
        state TEXT
    );
    """,
    # 2: profiles, one row per (profile run, precision, batch size); ``odtctl profile``.
    """
    CREATE TABLE profiles (
        profile_id INTEGER NOT NULL,
        created_at TEXT NOT NULL,
        model TEXT NOT NULL,
        backend TEXT,
        board TEXT,
        steps INTEGER NOT NULL,
        batch_size INTEGER NOT NULL,
        precision TEXT NOT NULL,
        precision_resolved TEXT,
        status TEXT NOT NULL CHECK (status IN ('ok', 'does_not_fit')),
        reason TEXT,
        samples_per_s REAL,
        step_s REAL,
        energy_per_sample_j REAL,
        energy_per_sample_by_rail_j TEXT,
        energy_source TEXT,
        energy_coverage REAL,
        mean_power_w REAL,
        peak_memory_mb REAL,
        PRIMARY KEY (profile_id, precision, batch_size)
    );
    CREATE INDEX profiles_model ON profiles (model, profile_id);
    """,
    # 3: the replay buffer: references to samples kept by class-balanced reservoir sampling.
    """
    CREATE TABLE replay_buffer (
        sha256 TEXT PRIMARY KEY REFERENCES samples (sha256),
        label TEXT NOT NULL,
        size_bytes INTEGER NOT NULL,
        added_session INTEGER
    );
    CREATE TABLE replay_seen (label TEXT PRIMARY KEY, seen INTEGER NOT NULL);
    """,
    # 4: profiles measure a plan: gradient checkpointing on or off beside precision and batch
    # size. SQLite cannot change a primary key in place: the table is rebuilt, its rows kept
    # (each measured without recomputation).
    """
    CREATE TABLE profiles_v4 (
        profile_id INTEGER NOT NULL,
        created_at TEXT NOT NULL,
        model TEXT NOT NULL,
        backend TEXT,
        board TEXT,
        steps INTEGER NOT NULL,
        batch_size INTEGER NOT NULL,
        precision TEXT NOT NULL,
        recompute INTEGER NOT NULL DEFAULT 0 CHECK (recompute IN (0, 1)),
        precision_resolved TEXT,
        status TEXT NOT NULL CHECK (status IN ('ok', 'does_not_fit')),
        reason TEXT,
        samples_per_s REAL,
        step_s REAL,
        energy_per_sample_j REAL,
        energy_per_sample_by_rail_j TEXT,
        energy_source TEXT,
        energy_coverage REAL,
        mean_power_w REAL,
        peak_memory_mb REAL,
        PRIMARY KEY (profile_id, precision, recompute, batch_size)
    );
    INSERT INTO profiles_v4 (profile_id, created_at, model, backend, board, steps, batch_size,
        precision, precision_resolved, status, reason, samples_per_s, step_s,
        energy_per_sample_j, energy_per_sample_by_rail_j, energy_source, energy_coverage,
        mean_power_w, peak_memory_mb)
    SELECT profile_id, created_at, model, backend, board, steps, batch_size, precision,
        precision_resolved, status, reason, samples_per_s, step_s, energy_per_sample_j,
        energy_per_sample_by_rail_j, energy_source, energy_coverage, mean_power_w,
        peak_memory_mb FROM profiles;
    DROP TABLE profiles;
    ALTER TABLE profiles_v4 RENAME TO profiles;
    CREATE INDEX profiles_model ON profiles (model, profile_id);
    """,
    # 5: a plan may recompute part of the network: ``recompute`` is the share recomputed
    # (0: off, 1: every segment but the last, 0.5: the first half), no longer 0 or 1. Rebuilt as
    # in 4 (a CHECK constraint cannot change in place); stored rows keep their values.
    """
    CREATE TABLE profiles_v5 (
        profile_id INTEGER NOT NULL,
        created_at TEXT NOT NULL,
        model TEXT NOT NULL,
        backend TEXT,
        board TEXT,
        steps INTEGER NOT NULL,
        batch_size INTEGER NOT NULL,
        precision TEXT NOT NULL,
        recompute REAL NOT NULL DEFAULT 0 CHECK (recompute >= 0 AND recompute <= 1),
        precision_resolved TEXT,
        status TEXT NOT NULL CHECK (status IN ('ok', 'does_not_fit')),
        reason TEXT,
        samples_per_s REAL,
        step_s REAL,
        energy_per_sample_j REAL,
        energy_per_sample_by_rail_j TEXT,
        energy_source TEXT,
        energy_coverage REAL,
        mean_power_w REAL,
        peak_memory_mb REAL,
        PRIMARY KEY (profile_id, precision, recompute, batch_size)
    );
    INSERT INTO profiles_v5 (profile_id, created_at, model, backend, board, steps,
        batch_size, precision, recompute, precision_resolved, status, reason, samples_per_s,
        step_s, energy_per_sample_j, energy_per_sample_by_rail_j, energy_source,
        energy_coverage, mean_power_w, peak_memory_mb)
    SELECT profile_id, created_at, model, backend, board, steps,
        batch_size, precision, recompute, precision_resolved, status, reason, samples_per_s,
        step_s, energy_per_sample_j, energy_per_sample_by_rail_j, energy_source,
        energy_coverage, mean_power_w, peak_memory_mb FROM profiles;
    DROP TABLE profiles;
    ALTER TABLE profiles_v5 RENAME TO profiles;
    CREATE INDEX profiles_model ON profiles (model, profile_id);
    """,
    # 6: a profiled size may run more than once (``odtctl profile --repeats``): each run's peak
    # memory, a JSON list, beside the largest in ``peak_memory_mb``.
    """
    ALTER TABLE profiles ADD COLUMN peak_memory_runs_mb TEXT;
    """,
    # 7: samples pruned to keep the disk above ``storage.min_free_mb`` (``odtd.home.disk``):
    # their files are gone, their row moves here, so the same image is still known (a
    # duplicate, not a new sample) and the counts add up.
    """
    CREATE TABLE pruned_samples (
        sha256 TEXT PRIMARY KEY,
        label TEXT NOT NULL,
        day TEXT NOT NULL,
        session_id INTEGER,
        size_bytes INTEGER NOT NULL,
        pruned_at TEXT NOT NULL
    );
    """,
    # 8: a sample may be unlabelled (``odtctl ingest --unlabelled``, ``inbox/_unlabelled/``):
    # status 'unlabelled' and a NULL label, the one implying the other. A status of its own,
    # not a flag beside 'pending': every reader of samples asks for a status (a session's
    # pending ones, the held-out set, the trained ones replay and pruning read), so none of
    # them sees an unlabelled sample, and a label column that is NULL cannot pass for a class.
    # SQLite changes neither a CHECK nor NOT NULL in place: the table is rebuilt, its rows kept
    # (replay_buffer's references to it stay valid: ``Store.migrate`` turns the foreign keys
    # off around a migration and checks them before it commits).
    """
    CREATE TABLE samples_v8 (
        sha256 TEXT PRIMARY KEY,
        label TEXT,
        day TEXT NOT NULL,
        status TEXT NOT NULL
            CHECK (status IN ('pending', 'trained', 'holdout', 'unlabelled')),
        original_path TEXT NOT NULL,
        stored_path TEXT NOT NULL,
        array_path TEXT NOT NULL,
        width INTEGER NOT NULL,
        height INTEGER NOT NULL,
        ingested_at TEXT NOT NULL,
        session_id INTEGER,
        CHECK ((label IS NULL) = (status = 'unlabelled'))
    );
    INSERT INTO samples_v8 (sha256, label, day, status, original_path, stored_path, array_path,
        width, height, ingested_at, session_id)
    SELECT sha256, label, day, status, original_path, stored_path, array_path, width, height,
        ingested_at, session_id FROM samples;
    DROP TABLE samples;
    ALTER TABLE samples_v8 RENAME TO samples;
    CREATE INDEX samples_status ON samples (status, day);
    """,
    # 9: pruning takes unlabelled samples too (those older than the newest a session reads,
    # ``samples.UNLABELLED_READ``): a pruned sample's label may be NULL. The table is rebuilt
    # (SQLite drops no NOT NULL in place), its rows kept.
    """
    CREATE TABLE pruned_samples_v9 (
        sha256 TEXT PRIMARY KEY,
        label TEXT,
        day TEXT NOT NULL,
        session_id INTEGER,
        size_bytes INTEGER NOT NULL,
        pruned_at TEXT NOT NULL
    );
    INSERT INTO pruned_samples_v9 SELECT sha256, label, day, session_id, size_bytes, pruned_at
        FROM pruned_samples;
    DROP TABLE pruned_samples;
    ALTER TABLE pruned_samples_v9 RENAME TO pruned_samples;
    """,
]
