"""After a crash: what a killed process or a power cut left half-done, made whole or removed.

Every write odtd makes is ordered so that a crash at any point leaves the home consistent for
a reader (``odtd.atomic``, the transactions of ``odtd.store``): a version directory appears
whole or not at all, ``current`` names a complete version, a sample row commits after its
files. What a crash can leave is litter and one mismatch, and `repair_home` clears both under
the session lock, before each session (``session.lock.recover_stale_sessions``):

- ``current`` naming a version the database never recorded: the power went between the
  pointer's rename and the promotion's commit. The commit is lost, so the samples are still
  pending: the pointer goes back to the version's parent (which the session started from)
  and the version is removed, or the next session would train the same samples again.
- version directories without a database row (a crash between the version's rename and the
  commit), half-removed ones (``.vN.removing``), staging ones (``.vN.PID.tmp``); rows of pruned
  versions whose state the crash did not record.
- a finished session's job data and candidate in ``runs/`` (killed before its clean-up).
- sample files without a row: an ingest killed between the files and the commit, or a pruning
  between the commit and the files' removal. Only while no ingest runs (``home.lock``).
- staged files (``odtd.atomic``) of processes that are gone.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from odtd import atomic
from odtd.errors import ModelError
from odtd.home.lock import ingest_lock
from odtd.home.paths import Home
from odtd.home.versions import MANIFEST_NAME, ModelRepo
from odtd.store.database import Store

logger = logging.getLogger(__name__)


def repair_home(home: Home, store: Store) -> dict[str, Any]:
    """Clear what crashed processes left (see the module's docstring); return what was done.

    Call it holding the session lock. Records a ``repaired`` event when anything was found.
    """
    done: dict[str, Any] = {}
    model = store.meta("model")
    if model:
        done.update(_repair_versions(ModelRepo(home.models, model), store))
    done["run_files"] = _clear_finished_runs(home, store)
    done["sample_files"] = remove_orphan_samples(home, store)
    found = {key: value for key, value in done.items() if value}
    if found:
        store.log_event("repaired", "cleared what an interrupted operation left: " +
                        ", ".join(f"{key} {value}" for key, value in found.items()), **found)
        logger.warning("repaired the home after an interrupted operation: %s", found)
    return found


def _repair_versions(repo: ModelRepo, store: Store) -> dict[str, Any]:
    done: dict[str, Any] = {}
    rows = {row["version"]: row for row in store.model_versions(repo.name)}
    try:
        current = repo.current()
    except ModelError:
        current = None
    if current is not None and current not in rows and current in repo.versions():
        parent = repo.manifest(current).get("parent")
        if parent is not None and parent in rows and (repo.version_dir(parent) / MANIFEST_NAME).exists():
            repo.set_current(parent)
            done["pointer_back"] = f"v{current} -> v{parent}"
            current = parent
    staged = [entry for entry in _entries(repo.dir)
              if entry.name.startswith(".v") and entry.name.endswith((".tmp", ".removing"))]
    staged += [entry for entry in _entries(repo.dir) if atomic.is_abandoned(entry.name)]
    for entry in staged:
        atomic.remove_quietly(entry)
    unrecorded = [v for v in repo.versions() if v not in rows and v != current]
    for version in unrecorded:
        shutil.rmtree(repo.version_dir(version))
    gone = [v for v, row in rows.items() if row["state"] == "kept" and v not in repo.versions()]
    for version in gone:
        store.set_model_version_state(repo.name, version, "pruned")
    if staged:
        done["staging_left"] = len(staged)
    if unrecorded:
        done["versions_unrecorded"] = unrecorded
    if gone:
        done["versions_marked_pruned"] = gone
    return done


def _clear_finished_runs(home: Home, store: Store) -> int:
    """Remove the data and weights (``.npz``) left in finished sessions' runs/ folders."""
    running = {f"session-{record.id}" for record in store.running_sessions()}
    removed = 0
    for folder in _entries(home.runs):
        if not folder.name.startswith("session-") or folder.name in running:
            continue
        for entry in _entries(folder):
            if entry.suffix == ".npz" or atomic.is_temporary(entry.name):
                atomic.remove_quietly(entry)
                removed += 1
    return removed


def remove_orphan_samples(home: Home, store: Store) -> int:
    """Remove files under ``samples/`` that no sample row names; 0 if an ingest is running."""
    with ingest_lock(home.ingest_lock, exclusive=True) as alone:
        if not alone:
            return 0
        known = set()
        # Every sample's files, labelled or not, pending or trained.
        for row in store.iter_query("SELECT stored_path, array_path FROM samples"):
            known.add(row["stored_path"])
            known.add(row["array_path"])
        removed = 0
        for folder in _entries(home.samples):
            for entry in _entries(folder):
                if str(entry.relative_to(home.root)) not in known:
                    atomic.remove_quietly(entry)
                    removed += 1
        return removed


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(directory.iterdir())
    except OSError:
        return []

