"""``odtctl init``: a new ODTD_HOME: config, policy, database, model v0, validation set, replay seed."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from odtd.config import Config, default_config_text
from odtd.errors import ConfigError, IngestError
from odtd.home.ingest import BadImage, Ingestor, decode_image, discover
from odtd.home.paths import Home
from odtd.home.versions import ModelRepo, check_model_name, check_weights_file
from odtd.policy import default_policy_text, load_policy
from odtd.session.replay_buffer import update_buffer
from odtd.store.database import Store, utc_now
from odtd.trainer import catalog
from odtd.trainer.job import make_job
from odtd.trainer.launch import run_job

logger = logging.getLogger(__name__)


def parse_classes(text: Optional[str]) -> list[str]:
    """Parse ``--classes a,b,c`` (default: the ten CIFAR-10 classes)."""
    if not text:
        return list(catalog.DEFAULT_CLASSES)
    classes = [name.strip() for name in text.split(",") if name.strip()]
    if len(classes) < 2 or len(set(classes)) != len(classes):
        raise ConfigError(f"--classes {text!r}: give at least two distinct names, comma-separated")
    return classes


def init_home(
    home: Home,
    model: str,
    classes: list[str],
    weights: Optional[Path] = None,
    validation: Optional[Path] = None,
    force: bool = False,
    seed: int = 0,
    validation_arrays: Optional[tuple[np.ndarray, np.ndarray]] = None,
    replay: Optional[Path] = None,
) -> dict[str, Any]:
    """Create an ODTD_HOME and return a summary.

    Args:
        home: the state directory.
        model: registry name.
        classes: class names, in the order of the model's outputs.
        weights: starting weights (``.npz``); None = a fresh, seeded initialisation.
        validation: a ``<label>/<file>`` directory of images, the fixed validation set.
        force: replace an existing home (its samples, sessions and models are deleted).
        seed: seed of a fresh initialisation.
        validation_arrays: (x uint8 NHWC, y) instead of a ``validation`` directory.
        replay: a ``<label>/<file>`` directory of the base model's own training images: they
            seed the replay buffer (see `seed_replay`).

    Raises:
        ConfigError: the home exists and ``force`` is not set, or an argument is invalid.
    """
    check_model_name(model)
    if weights is not None:
        check_weights_file(weights)
    if home.is_initialised() and not force:
        raise ConfigError(
            f"{home.root} is already an odtd home; pass --force to replace it "
            "(its samples, sessions and models are deleted)"
        )
    # Read the validation images before touching the home, so a bad path loses nothing.
    val = validation_arrays
    if validation is not None:
        val = load_validation_dir(validation, classes, catalog.MODELS[model].input_shape)
    replay_files = None
    if replay is not None:
        if not replay.is_dir():
            raise IngestError(f"--replay {replay}: not a directory of <label>/<image> files")
        replay_files = list(discover(replay, None))
    if force:
        wipe_home(home)
    for directory in home.directories():
        directory.mkdir(parents=True, exist_ok=True)
    if not home.config_path.exists():
        home.config_path.write_text(default_config_text(), encoding="utf-8")
    config = home.load_config()
    policy_path = home.policy_path(config)
    if not policy_path.exists():
        policy_path.write_text(default_policy_text(model), encoding="utf-8")
    input_shape = list(catalog.MODELS[model].input_shape)
    if val is not None:
        np.savez(home.validation_file(), x=val[0], y=val[1])
    store = Store(home.db_path)
    try:
        store.set_meta(model=model, classes=classes, input_shape=input_shape, created_at=utc_now())
        version, manifest = create_base_version(home, config, model, classes, input_shape,
                                                weights, seed)
        store.add_model_version({
            "model": model, "version": version, "parent": None, "session_id": None,
            "sha256": manifest["sha256"], "param_count": manifest["param_count"], "accuracy": None,
        })
        store.log_event("init", f"initialised with {model} v{version}",
                        weights=str(weights) if weights else "fresh")
        seeded = {"size": 0}
        if replay_files is not None:
            seeded = seed_replay(home, store, replay_files, classes, input_shape,
                                 load_policy(policy_path))
    finally:
        store.close()
    return {
        "home": str(home.root), "model": model, "version": version, "classes": classes,
        "param_count": manifest["param_count"], "weights": str(weights) if weights else "fresh",
        "validation_samples": int(len(val[1])) if val is not None else 0,
        "replay_samples": seeded["size"],
    }


def seed_replay(home: Home, store: Store, files: list[tuple[Path, Optional[str]]],
                classes: list[str], input_shape: list[int], policy: Any) -> dict[str, Any]:
    """Put the base model's own training images into the replay buffer of a new home.

    The buffer rehearses "everything trained so far", and before the first session that is the
    base model's training data: without it, the first sessions rehearse nothing but a few days
    of device samples, and fine-tuning on them forgets what the server taught. The images are
    stored like ingested samples (content-addressed, never modified), marked trained (by no
    session: the server trained them) and offered to the class-balanced reservoir, which later
    trades them for device samples as the pool fills.

    Args:
        home: a home with no samples yet.
        store: its open database.
        files: (path, label) pairs from ``discover``.
        classes: the model's classes; other labels are quarantined, as by ingest.
        input_shape: the model's (height, width, channels).
        policy: the home's policy (replay capacity).

    Returns:
        The ingest counts and ``size``, the buffer's size afterwards.

    Raises:
        IngestError: no image could be stored.
    """
    ingestor = Ingestor(home, store, classes, (input_shape[1], input_shape[0]), holdout_every=0)
    report = ingestor.ingest(files)
    rows = store.samples("pending")
    if not rows:
        raise IngestError(f"replay seed: none of {len(files)} files could be stored "
                          f"({report.rejected} rejected); see {home.quarantine}")
    store.mark_trained([row["sha256"] for row in rows], session_id=0)
    result = update_buffer(store, policy.replay, rows, session_id=0, root=home.root)
    store.log_event("replay_seed", f"replay buffer seeded with {result['size']} of {len(rows)} "
                    "base training images", rejected=report.rejected)
    return {**report.as_dict(), "size": result["size"]}


def wipe_home(home: Home) -> None:
    """Delete what ``init`` creates (config and policy files stay: a person may have edited them)."""
    for directory in home.directories()[1:]:
        if directory.exists():
            shutil.rmtree(directory)
    for name in ("odtd.db", "odtd.db-wal", "odtd.db-shm"):
        (home.root / name).unlink(missing_ok=True)


def create_base_version(
    home: Home,
    config: Config,
    model: str,
    classes: list[str],
    input_shape: list[int],
    weights: Optional[Path],
    seed: int = 0,
    on_message: Optional[Callable[[dict[str, Any]], None]] = None,
) -> tuple[int, dict[str, Any]]:
    """Make model version 0 (or the next version) current, from weights or a fresh init.

    Given weights are loaded into the model by the worker (which proves they fit it) and
    written back; a fresh init is built by the worker with ``seed``.
    """
    repo = ModelRepo(home.models, model)
    with tempfile.TemporaryDirectory(dir=home.runs) as tmp:
        out = Path(tmp) / "weights.npz"
        job = make_job("init", model, classes, input_shape, seed=seed, weights_out=str(out),
                       weights_in=str(weights) if weights else None)
        result, _, _ = run_job(config.trainer.command(), job, Path(tmp), on_message=on_message)
        existing = repo.versions()
        version, manifest = repo.add_version(
            out, classes=classes, input_shape=input_shape, param_count=result.get("param_count"),
            parent=existing[-1] if existing else None, weight_names=result.get("weight_names"),
            move=True,
        )
    repo.set_current(version)
    return version, manifest


def load_validation_dir(
    path: Path, classes: list[str], input_shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Decode a ``<label>/<file>`` directory into the fixed validation arrays.

    Raises:
        IngestError: the path is unusable, holds a label outside ``classes``, or no images.
    """
    if not path.is_dir():
        raise IngestError(f"--validation {path}: not a directory of <label>/<image> files")
    index = {name: i for i, name in enumerate(classes)}
    xs, ys, skipped = [], [], 0
    for file, label in discover(path, None):
        if label not in index:
            raise IngestError(f"--validation {file}: label {label!r} is not one of the classes {classes}")
        try:
            xs.append(decode_image(file.read_bytes(), (input_shape[1], input_shape[0])))
        except (BadImage, OSError) as exc:
            skipped += 1
            logger.warning("validation image %s skipped: %s", file, exc)
            continue
        ys.append(index[label])
    if not xs:
        raise IngestError(f"--validation {path}: no readable images under <label>/ folders")
    return np.stack(xs), np.array(ys, dtype=np.int64)
