"""Model versions on disk, and what a person does with them: list, roll back, export, prune.

Each version is ``models/<name>/vN/{weights.npz,manifest.json}``; ``current`` names the promoted one.

This module never imports TensorFlow: weights are opaque ``.npz`` files written by the trainer
worker. ``current`` is a one-line file naming the promoted version, switched atomically
(write a temporary file, fsync, rename, fsync the directory), so a power cut leaves either the
old or the new version current, never a torn one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from odtd import atomic
from odtd.errors import ModelError
from odtd.home.paths import Home
from odtd.store.database import Store
from odtd.trainer.protocol.digest import file_sha256

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "weights.npz"
MANIFEST_NAME = "manifest.json"


def check_weights_file(path: Path) -> list[str]:
    """Open an ``.npz`` without pickle and return its array keys; raise ModelError if unusable."""
    try:
        with np.load(path, allow_pickle=False) as data:
            keys = sorted(data.files)
            for key in keys:
                data[key]  # noqa: B018 - reading each array proves the file is whole
    except FileNotFoundError:
        raise ModelError(f"{path}: no such weights file") from None
    except (OSError, ValueError, EOFError) as exc:
        raise ModelError(f"{path}: not a readable .npz weights file ({exc})") from None
    if not keys:
        raise ModelError(f"{path}: the .npz holds no arrays")
    return keys


def offset_job_keys(manifest: dict[str, Any]) -> dict[str, Any]:
    """A version's logit offset and what it was estimated with, as a worker job's keys.

    ``logit_offset`` (None without one); ``logit_offset_priors`` and ``logit_offset_temperature``
    from its ``logit_offset_basis`` (None for a version without one, an older one say: the
    worker then has no offset to carry, ``learning.priors.carried_offset``).
    """
    basis = manifest.get("logit_offset_basis") or {}
    return {"logit_offset": manifest.get("logit_offset"),
            "logit_offset_priors": basis.get("priors"),
            "logit_offset_temperature": basis.get("temperature")}


class ModelRepo:
    """The versions of one model under ``HOME/models/<name>/``.

    Args:
        root: ``HOME/models``.
        name: registry name of the model (``densenet40``, ``tinycnn``).
    """

    def __init__(self, root: Path, name: str) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ModelError(f"model name {name!r} cannot be a directory under models/")
        self.name = name
        self.dir = Path(root) / name

    def version_dir(self, version: int) -> Path:
        """Return the directory of version ``version``."""
        return self.dir / f"v{version}"

    def weights_path(self, version: int) -> Path:
        """Return the weights file of a version."""
        return self.version_dir(version) / WEIGHTS_NAME

    @property
    def resume_path(self) -> Path:
        """The last refused candidate that the next session trains on (``training.resume_within``)."""
        return self.dir / "resume.npz"

    @property
    def eval_cache_path(self) -> Path:
        """The served model's per-sample validation results (worker job key ``eval_cache``)."""
        return self.dir / "eval-cache.npz"

    @property
    def origin_eval_cache_path(self) -> Path:
        """The first model's (version 0's) per-sample results (worker job key ``origin_eval_cache``)."""
        return self.dir / "origin-eval-cache.npz"

    def keep_origin_eval_cache(self) -> None:
        """Keep the eval cache as the first model's results, once, while version 0 is served.

        The guard's check against the first model on the reference set then allows the paired
        standard error (``session.acceptance.reference_refusal``), as its check against the
        served model does. A copy: the eval cache itself is replaced on the next promotion.
        """
        if self.origin_eval_cache_path.exists() or not self.eval_cache_path.exists() or \
                not self.weights_path(0).exists():
            return
        try:
            with np.load(self.eval_cache_path, allow_pickle=False) as cache:
                scored = str(cache["weights_sha256"])
        except (OSError, ValueError, KeyError):
            return  # unreadable: it is scored again, and kept then
        try:
            if scored == file_sha256(self.weights_path(0)):
                atomic.copy(self.eval_cache_path, self.origin_eval_cache_path)
        except OSError as error:  # a full disk: the next session that serves version 0 tries again
            logger.warning("the first model's results were not kept: %s", error)

    def adopt_eval_cache(self, candidate_results: Optional[Path]) -> None:
        """Make a promoted candidate's validation results the eval cache (if the worker wrote them).

        None drops the cache (a new version of the served weights with another logit offset:
        ``training.prior_correction``'s refresh; the cached results are the old offset's).
        """
        if candidate_results is None:
            self.eval_cache_path.unlink(missing_ok=True)
        elif candidate_results.exists():
            atomic.move(candidate_results, self.eval_cache_path)

    def keep_for_resume(self, candidate: Path) -> None:
        """Keep a refused candidate as the next session's starting point (replacing any earlier)."""
        atomic.move(candidate, self.resume_path)

    def clear_resume(self) -> None:
        """Forget the resumable candidate: the next session starts from the current version."""
        self.resume_path.unlink(missing_ok=True)

    def versions(self) -> list[int]:
        """Return the versions present on disk, ascending."""
        if not self.dir.is_dir():
            return []
        found = []
        for entry in self.dir.iterdir():
            if entry.is_dir() and entry.name.startswith("v") and entry.name[1:].isdigit():
                if (entry / MANIFEST_NAME).exists():
                    found.append(int(entry.name[1:]))
        return sorted(found)

    def current(self) -> int:
        """Return the promoted version number.

        Raises:
            ModelError: when no version was ever promoted (run ``odtctl init``).
        """
        pointer = self.dir / "current"
        try:
            text = pointer.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise ModelError(f"{pointer}: no served model; run `odtctl init`") from None
        if not (text.startswith("v") and text[1:].isdigit()):
            raise ModelError(f"{pointer}: damaged pointer {text!r}; use `odtctl models rollback`")
        return int(text[1:])

    def set_current(self, version: int) -> None:
        """Atomically make ``version`` the served model."""
        if not self.weights_path(version).exists():
            raise ModelError(f"{self.name} v{version}: no such version (see `odtctl models versions`)")
        atomic.write_text(self.dir / "current", f"v{version}\n")

    def manifest(self, version: int) -> dict[str, Any]:
        """Return a version's manifest."""
        path = self.version_dir(version) / MANIFEST_NAME
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelError(
                f"{self.name} v{version}: no such version (see `odtctl models versions`)"
            ) from None
        except ValueError as exc:
            raise ModelError(f"{path}: damaged manifest ({exc})") from None

    def verify(self, version: int) -> None:
        """Check a version's weights against the sha256 in its manifest."""
        manifest = self.manifest(version)
        actual = file_sha256(self.weights_path(version))
        if actual != manifest["sha256"]:
            raise ModelError(
                f"{self.weights_path(version)}: sha256 {actual[:12]} does not match the manifest's "
                f"{manifest['sha256'][:12]}; the file was modified or damaged"
            )

    def add_version(
        self,
        weights: Path,
        *,
        classes: list[str],
        input_shape: list[int],
        param_count: Optional[int],
        parent: Optional[int],
        session_id: Optional[int] = None,
        metrics: Optional[dict[str, Any]] = None,
        weight_names: Optional[list[str]] = None,
        logit_offset: Optional[list[float]] = None,
        move: bool = False,
        logit_offset_basis: Optional[dict[str, Any]] = None,
    ) -> tuple[int, dict[str, Any]]:
        """Store ``weights`` as the next version (not yet current) and return (version, manifest).

        The version directory is assembled under a temporary name and renamed into place, so a
        half-written version is never visible. ``logit_offset``: the device's class priors as
        an offset on the model's logits (``training.prior_correction``), kept in the manifest,
        with ``logit_offset_basis``: the priors and temperature it was estimated with (the
        next session's ``logit_offset_priors`` and ``logit_offset_temperature``).
        """
        check_weights_file(weights)
        existing = self.versions()
        version = existing[-1] + 1 if existing else 0
        self.dir.mkdir(parents=True, exist_ok=True)
        with atomic.staged_directory(self.version_dir(version)) as directory:
            staging = Path(directory)
            target = staging / WEIGHTS_NAME
            if move:
                atomic.move(weights, target, durable=False)  # flushed with the directory
            else:
                shutil.copyfile(weights, target)
            manifest = {
                "model": self.name,
                "version": version,
                "classes": list(classes),
                "input_shape": list(input_shape),
                "param_count": param_count,
                "sha256": file_sha256(target),
                "parent": parent,
                "session_id": session_id,
                "metrics": metrics or {},
                "weight_names": weight_names or [],
            }
            if logit_offset is not None:
                manifest["logit_offset"] = list(logit_offset)
                if logit_offset_basis is not None:
                    manifest["logit_offset_basis"] = dict(logit_offset_basis)
            (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True),
                                                 encoding="utf-8")
        logger.info("stored %s v%d (parent %s)", self.name, version, parent)
        return version, manifest

    def remove_version(self, version: int) -> None:
        """Delete a version's files (never the served one or its parent)."""
        current = self.current()
        protected = {current, self.manifest(current).get("parent")}
        if version in protected:
            raise ModelError(f"{self.name} v{version} is current or its parent; it cannot be removed")
        # Renamed away first: a version is whole or gone, never half-deleted by a crash.
        doomed = self.dir / f".v{version}.removing"
        os.replace(self.version_dir(version), doomed)
        shutil.rmtree(doomed)


def list_versions(home: Home, store: Store) -> list[dict[str, Any]]:
    """Return the recorded versions of the home's model, newest first, marking the served one."""
    model = store.meta("model")
    current = ModelRepo(home.models, model).current()
    rows = store.model_versions(model)
    for row in rows:
        row["current"] = row["version"] == current
        if row.get("accuracy") is None:  # version 0: as the latest session measured it
            row["accuracy"] = store.measured_accuracy(row["version"])
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


EXPORT_SUFFIXES = (".npz", ".keras", ".h5")


def remove_stale_temporaries(directory: Path, stem: str) -> list[Path]:
    """Remove the staged files (``odtd.atomic``) of ``stem`` that a killed export left in ``directory``.

    Only those of processes that are gone, and only those named after ``stem``: an export's
    directory is the user's.
    """
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if f".{stem}." in entry.name and atomic.is_abandoned(entry.name):
            atomic.remove_quietly(entry)
            removed.append(entry)
    return removed


def export(home: Home, store: Store, version: int, out: Path, as_given: bool = False,
           on_message: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Write a version (verified by sha256) to ``out`` and record the export.

    ``.npz``: the weights as odtd stores them. ``.keras`` or ``.h5``: a full Keras model that a
    plain ``keras.models.load_model`` opens without odtd, written by a worker in its Keras (see
    ``trainer.worker.export.export_model``: an imported model keeps the user's own input convention).
    ``as_given``: an imported model's weights written into a copy of the file the user gave,
    which the Keras that wrote that file opens (a server on Keras 3, a device on Keras 2).

    Raises:
        ModelError: an unknown version, damaged weights, or another suffix.
        TrainerFailed: the worker could not write the model.
    """
    from odtd.home.spec import ModelSpec, original_file
    from odtd.trainer.protocol.job import make_job
    from odtd.trainer.protocol.launch import run_job

    spec = ModelSpec.from_store(store)
    repo = ModelRepo(home.models, spec.name)
    repo.verify(version)
    if out.suffix not in EXPORT_SUFFIXES:
        raise ModelError(f"--out {out}: name the file .npz (odtd's weights), .keras or .h5 "
                         "(a full Keras model)")
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent, out.stem)
    result = {"export": "weights"}
    original = original_file(repo.dir) if as_given else None
    if as_given and (original is None or original.suffix != out.suffix):
        given = "a built-in network has none" if original is None else f"it was {original.suffix}"
        raise ModelError(f"--as-given writes into a copy of the model file given to init: "
                         f"name --out like it ({given})")
    # Staged beside --out (same filesystem, wherever it is), renamed over it when whole.
    with atomic.staged(out) as tmp:
        if out.suffix == ".npz":
            shutil.copyfile(repo.weights_path(version), tmp)
        else:
            with atomic.staging_dir(home.runs, "export-") as job_dir:
                job = make_job("export", spec.name, spec.classes, spec.input_shape,
                               weights_in=str(repo.weights_path(version)), export_to=tmp,
                               model_file=str(original) if original else None,
                               logit_offset=repo.manifest(version).get("logit_offset"),
                               **spec.job_keys(home))
                result, _, _ = run_job(home.load_config().trainer.command(), job, Path(job_dir),
                                       on_message=on_message)
    # Again once written: a killed export's worker outlives it by up to its parent poll (half a
    # second), and may have written its staged file after the clean-up above.
    remove_stale_temporaries(out.parent, out.stem)
    sha = file_sha256(out)
    store.log_event("export", f"{spec.name} v{version} exported to {out}", version=version,
                    out=str(out))
    offset = repo.manifest(version).get("logit_offset")
    return {"model": spec.name, "version": version, "out": str(out), "sha256": sha,
            "format": out.suffix.lstrip("."), "written_as": result.get("export"),
            # Where the version's class priors (training.prior_correction) went, if it has any.
            "logit_offset": None if offset is None else result.get("logit_offset", "not in the file")}


def prune(home: Home, store: Store, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` versions, never the served one or its parent."""
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
