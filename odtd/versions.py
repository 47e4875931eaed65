"""Model versions as a person manages them: list, roll back, export, prune."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from odtd.errors import ModelError
from odtd.home import Home
from odtd.models import ModelRepo, file_sha256
from odtd.store import Store

logger = logging.getLogger(__name__)


def list_versions(home: Home, store: Store) -> list[dict[str, Any]]:
    """Return the recorded versions of the home's model, newest first, marking the current one."""
    model = store.meta("model")
    current = ModelRepo(home.models, model).current()
    rows = store.model_versions(model)
    for row in rows:
        row["current"] = row["version"] == current
    return rows


def rollback(home: Home, store: Store, version: int) -> dict[str, Any]:
    """Make an earlier (or any kept) version current, atomically, and record it.

    Raises:
        ModelError: the version does not exist or its weights fail their sha256 check.
    """
    model = store.meta("model")
    repo = ModelRepo(home.models, model)
    previous = repo.current()
    repo.verify(version)
    with store.transaction():
        store.log_event("rollback", f"{model} v{previous} -> v{version}",
                        previous=previous, version=version)
        repo.set_current(version)
    # A candidate kept for resuming descends from the version left behind.
    repo.clear_resume()
    return {"model": model, "version": version, "previous": previous}


def export(home: Home, store: Store, version: int, out: Path) -> dict[str, Any]:
    """Copy a version's weights to ``out`` (verified by sha256) and record the export."""
    model = store.meta("model")
    repo = ModelRepo(home.models, model)
    repo.verify(version)
    if out.suffix != ".npz":
        raise ModelError(f"--out {out}: the export is an .npz file; name it e.g. {out.with_suffix('.npz')}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.copyfile(repo.weights_path(version), tmp)
    os.replace(tmp, out)
    sha = file_sha256(out)
    store.log_event("export", f"{model} v{version} exported to {out}", version=version, out=str(out))
    return {"model": model, "version": version, "out": str(out), "sha256": sha}


def prune(home: Home, store: Store, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` versions, never the current one or its parent."""
    model = store.meta("model")
    repo = ModelRepo(home.models, model)
    current = repo.current()
    protected = {current, repo.manifest(current).get("parent")}
    on_disk = repo.versions()
    removable = [v for v in on_disk[: max(0, len(on_disk) - keep)] if v not in protected]
    for version in removable:
        repo.remove_version(version)
        store.set_model_version_state(model, version, "pruned")
        logger.info("pruned %s v%d", model, version)
    return removable
