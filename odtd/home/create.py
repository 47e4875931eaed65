"""``odtctl init``: a new ODTD_HOME: config, policy, database, model v0, validation set, replay seed."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from odtd import atomic
from odtd.config import Config, default_config_text
from odtd.errors import ConfigError, IngestError, ModelError, TrainerFailed
from odtd.home.images import BadImage, decode_image
from odtd.home.ingest import Ingestor, discover
from odtd.home.paths import REFERENCE_EVERY, Home
from odtd.home.replay_buffer import update_buffer
from odtd.home.spec import (
    ARCHITECTURE_NAME,
    BUILTIN,
    IMPORTED,
    ORIGINAL_STEM,
    ModelSpec,
    check_conventions,
    check_model_name,
    imported_name,
)
from odtd.home.versions import ModelRepo, check_weights_file
from odtd.policy import Recipe, load_policy, recipe_for
from odtd.store.database import Store, utc_now
from odtd.trainer.protocol import catalog
from odtd.trainer.protocol.job import make_job
from odtd.trainer.protocol.launch import run_job

logger = logging.getLogger(__name__)


def parse_classes(text: Optional[str]) -> list[str]:
    """Parse ``--classes a,b,c`` (default: the ten CIFAR-10 classes)."""
    if not text:
        return list(catalog.DEFAULT_CLASSES)
    classes = [name.strip() for name in text.split(",") if name.strip()]
    if len(classes) < 2 or len(set(classes)) != len(classes):
        raise ConfigError(f"--classes {text!r}: give at least two distinct names, comma-separated")
    return classes


def parse_input_size(text: Optional[str]) -> Optional[tuple[int, int]]:
    """Parse ``--input-size HxW`` (height by width) or ``--input-size N`` (N by N), in pixels."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", text)
    if not match or int(match[1]) < 1 or int(match[2] or 1) < 1:
        raise ConfigError(f"--input-size {text!r}: give HEIGHTxWIDTH or one size N for NxN, in "
                          "pixels, e.g. 64x48 or 64")
    return int(match[1]), int(match[2] or match[1])


def builtin_input_shape(model: str, input_size: Optional[tuple[int, int]]) -> list[int]:
    """A built-in network's input shape: its default, or ``input_size`` (height, width).

    Raises:
        ConfigError: the size is below the network's minimum (``catalog.sized_input_shape``).
    """
    if input_size is None:
        return list(catalog.get(model).input_shape)
    try:
        return list(catalog.sized_input_shape(model, *input_size))
    except ValueError as exc:
        least = catalog.get(model).min_input_size
        raise ConfigError(f"--input-size: {exc}; give at least {least}x{least}, or leave "
                          "--input-size out for the default") from None


def _leaves_nothing_on_failure(init: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Remove, when ``init`` fails, whatever it created in the home: no half-made home stays.

    What was there before (the same file, by inode) stays: a config or policy a person wrote,
    the home's directory itself if it existed. ``--force`` had asked for the rest to go.
    """

    @functools.wraps(init)
    def wrapper(home: Home, *args: Any, **kwargs: Any) -> dict[str, Any]:
        existed = home.root.exists()
        before = _inodes(home.root)
        try:
            return init(home, *args, **kwargs)
        except BaseException:
            for name, inode in _inodes(home.root).items():
                if before.get(name) != inode:
                    atomic.remove_quietly(home.root / name)
            if not existed:
                with contextlib.suppress(OSError):
                    home.root.rmdir()
            raise

    return wrapper


def _inodes(directory: Path) -> dict[str, int]:
    try:
        return {entry.name: entry.inode() for entry in os.scandir(directory)}
    except OSError:  # missing, or unreadable: nothing of it is init's to remove
        return {}


@_leaves_nothing_on_failure
def init_home(
    home: Home,
    model: Optional[str],
    classes: list[str],
    weights: Optional[Path] = None,
    validation: Optional[Path] = None,
    force: bool = False,
    seed: int = 0,
    validation_arrays: Optional[tuple[np.ndarray, np.ndarray]] = None,
    replay: Optional[Path] = None,
    reference_every: int = REFERENCE_EVERY,
    model_file: Optional[Path] = None,
    name: Optional[str] = None,
    input_scale: Optional[str] = None,
    output: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
    input_size: Optional[tuple[int, int]] = None,
    policy: Optional[Path] = None,
) -> dict[str, Any]:
    """Create an ODTD_HOME and return a summary.

    Version 0 is made first, by a worker, in a hidden staging directory of the home (on its
    filesystem, wherever that is mounted): a refused model file, unreadable weights, a bad
    validation directory or a full disk leave no half-made home.

    Args:
        home: the state directory.
        model: a built-in network's name (None with ``model_file``).
        classes: class names, in the order of the model's outputs.
        weights: starting weights of a built-in network (``.npz``); None = a fresh, seeded
            initialisation.
        validation: a ``<label>/<file>`` directory of images, the fixed validation set.
        force: replace an existing home (its samples, sessions and models are deleted).
        seed: seed of a fresh initialisation.
        validation_arrays: (x uint8 NHWC, y) instead of a ``validation`` directory.
        replay: a ``<label>/<file>`` directory of the base model's own training images: they
            seed the replay buffer (see `seed_replay`).
        reference_every: every Nth ``replay`` image is held out as the reference set (the
            original domain, which acceptance checks a candidate has not forgotten) instead of
            seeding the buffer; 0 = no reference set.
        model_file: the user's Keras model (``.keras`` or ``.h5``), screened and imported.
        name: the imported model's name in the home (default: the file's stem).
        input_scale: the pixels an imported model takes (default ``0-255``).
        output: ``logits`` or ``softmax``, overriding what is read from the model's last layer.
        progress: called with one-line progress messages.
        input_size: a built-in network's (height, width) in pixels, at least its
            ``min_input_size``; None = the catalogue's default. Samples are fitted to it. With
            ``model_file``: the size of a model whose input has no height and width (refused
            for one that has them, unless the same).
        policy: a policy file to install (validated first); None = the recipe for the model
            (``policy.recipe_for``), unless the home already has a policy file.

    Raises:
        ConfigError: the home exists and ``force`` is not set, or an argument is invalid.
        ModelError: an unknown network, a missing or refused model file, unusable weights.
    """
    say = progress or (lambda message: None)
    check_conventions(input_scale, output)
    shape = None
    if model_file is not None:
        if not model_file.is_file():
            raise ModelError(f"--model-file {model_file}: no such file")
        name = imported_name(name, model_file.stem)
    else:
        check_model_name(model)
        if input_scale is not None or output is not None:
            raise ConfigError("--input-scale and --output describe a model given with "
                              "--model-file; a built-in network has its own")
        name = model
        shape = builtin_input_shape(model, input_size)
    if weights is not None:
        check_weights_file(weights)
    if home.is_initialised() and not force:
        raise ConfigError(
            f"{home.root} is already an odtd home; pass --force to replace it "
            "(its samples, sessions and models are deleted)"
        )
    if reference_every < 0:
        raise ConfigError(f"--reference-every {reference_every}: give 0 (no reference set) or "
                          "a positive N")
    replay_files, reference_files = None, []
    if replay is not None:
        if not replay.is_dir():
            raise IngestError(f"--replay {replay}: not a directory of <label>/<image> files")
        replay_files = list(discover(replay, None))
        if reference_every:
            reference_files = replay_files[reference_every - 1::reference_every]
            replay_files = [f for i, f in enumerate(replay_files) if (i + 1) % reference_every]
    if policy is not None:
        load_policy(policy, missing_ok=False)  # a bad file is refused before anything is made
        recipe = Recipe(str(policy), policy.read_text(encoding="utf-8"), "given with --policy")
    else:
        recipe = recipe_for(model, imported=model_file is not None)
    config = home.load_config()
    # Staged in the home itself: the files rename into place on the same filesystem.
    with atomic.staging_dir(home.root, "init-") as staging:
        stage = Path(staging)
        spec, result = stage_version0(config, stage, name, classes, model_file, weights, seed,
                                      input_scale, output, say, input_shape=shape,
                                      input_size=input_size if model_file is not None else None)
        # Read the validation images before touching the home, so a bad path loses nothing.
        val = validation_arrays
        if validation is not None:
            val = load_validation_dir(validation, classes, spec.input_shape,
                                      resize=config.images.resize,
                                      antialias=config.images.antialias)
        reference = None
        # Labels outside the classes are quarantined by the replay seed; here they are left out.
        reference_files = [(f, label) for f, label in reference_files if label in classes]
        if reference_files:
            try:
                reference = decode_labelled(reference_files, classes, spec.input_shape,
                                            f"--replay {replay}", config.images.resize,
                                            config.images.antialias)
            except IngestError as exc:
                say(f"no reference set: {exc}")
        if force:
            wipe_home(home)
        for directory in home.directories():
            directory.mkdir(parents=True, exist_ok=True)
        if not home.config_path.exists():
            home.config_path.write_text(default_config_text(), encoding="utf-8")
        policy_path = home.policy_path(config)
        if policy is not None or not policy_path.exists():
            policy_path.write_text(recipe.text, encoding="utf-8")
        else:
            recipe = Recipe(str(policy_path), "", "the home's policy file, kept")
        if val is not None:
            np.savez(home.validation_file(), x=val[0], y=val[1])
        if reference is not None:
            np.savez(home.reference_file(), x=reference[0], y=reference[1])
        repo = ModelRepo(home.models, name)
        repo.dir.mkdir(parents=True, exist_ok=True)
        for staged in stage.glob(ORIGINAL_STEM + ".*"):
            atomic.move(staged, repo.dir / staged.name)
        if (stage / ARCHITECTURE_NAME).exists():
            atomic.move(stage / ARCHITECTURE_NAME, repo.dir / ARCHITECTURE_NAME)
        version, manifest = repo.add_version(
            stage / "weights.npz", classes=classes, input_shape=spec.input_shape,
            param_count=result.get("param_count"), parent=None,
            weight_names=result.get("weight_names"), move=False)
    repo.set_current(version)
    store = Store(home.db_path)
    try:
        spec.save(store)
        store.set_meta(created_at=utc_now())
        store.add_model_version({
            "model": name, "version": version, "parent": None, "session_id": None,
            "sha256": manifest["sha256"], "param_count": manifest["param_count"], "accuracy": None,
        })
        source = str(model_file) if model_file else (str(weights) if weights else "fresh")
        store.log_event("init", f"initialised with {name} v{version}", weights=source)
        seeded = {"size": 0}
        if replay_files is not None:
            seeded = seed_replay(home, store, replay_files, classes, spec.input_shape,
                                 load_policy(policy_path), resize=config.images.resize,
                                 antialias=config.images.antialias)
    finally:
        store.close()
    summary = {
        "home": str(home.root), "model": name, "source": spec.source, "version": version,
        "classes": classes, "input_shape": spec.input_shape, "input_scale": spec.input_scale,
        "output": spec.output, "param_count": manifest["param_count"], "weights": source,
        "validation_samples": int(len(val[1])) if val is not None else 0,
        "replay_samples": seeded["size"],
        "reference_samples": int(len(reference[1])) if reference is not None else 0,
        "policy": {"file": str(policy_path), "recipe": recipe.name, "why": recipe.why},
        "notes": [],
    }
    if spec.imported and input_scale is None and not result.get("rescales_input"):
        summary["notes"].append(
            "the model does not start with a Rescaling or Normalization layer; it is fed pixels "
            "in 0..255: if it was trained on 0..1 or -1..1 pixels, init again with --input-scale")
    if result.get("arithmetic_layers"):
        summary["notes"].append(
            f"{result['arithmetic_layers']} tensor operations of the model (such as x + 3.0 or "
            f"x * y) are built as the Keras layers that compute the same (Rescaling, Add, "
            f"Subtract, Multiply); an export holds those layers")
    if spec.imported and input_scale not in (None, "0-255") and result.get("rescales_input"):
        summary["notes"].append(
            f"the model starts with a Rescaling or Normalization layer of its own and "
            f"--input-scale {input_scale} scales the pixels before it as well: unless it was "
            f"trained on pixels scaled twice, init again without --input-scale")
    return summary


def stage_version0(config: Config, stage: Path, name: str, classes: list[str],
                   model_file: Optional[Path], weights: Optional[Path], seed: int,
                   input_scale: Optional[str], output: Optional[str],
                   say: Callable[[str], None], input_shape: Optional[list[int]] = None,
                   input_size: Optional[tuple[int, int]] = None,
                   ) -> tuple[ModelSpec, dict[str, Any]]:
    """Have a worker write version 0 into ``stage``; return the model's spec and the result.

    ``weights.npz`` always; an imported model adds ``architecture.json`` and its original file.

    A built-in network is built at ``input_shape`` (default: the catalogue's) and initialised
    from ``seed`` or loaded with ``weights`` (which proves they fit it). A model file is
    screened, built from its configuration and given its own weights; its input shape and
    output are read from it (``input_size`` fixes the height and width of one that has none).

    Raises:
        ModelError: the worker refused the file or the weights (the worker's one-line reason).
    """
    if model_file is not None:
        suffix = ".h5" if model_file.suffix.lower() == ".h5" else ".keras"
        job = make_job("import", name, classes, None, model_file=str(model_file.resolve()),
                       weights_out=str(stage / "weights.npz"),
                       architecture_out=str(stage / ARCHITECTURE_NAME),
                       original_out=str(stage / (ORIGINAL_STEM + suffix)),
                       input_size=None if input_size is None else list(input_size))
        say(f"reading {model_file} (screened: no code in it is run) ...")
    else:
        shape = input_shape or list(catalog.get(name).input_shape)
        job = make_job("init", name, classes, shape, seed=seed,
                       weights_out=str(stage / "weights.npz"),
                       weights_in=str(weights.resolve()) if weights else None)
    try:
        result, _, _ = run_job(config.trainer.command(), job, stage / "job")
    except TrainerFailed as exc:
        message = str(exc)
        for prefix in ("worker error (bad_model): ", "worker error (bad_job): "):
            message = message.replace(prefix, "")
        raise ModelError(message) from None
    if model_file is None:
        return ModelSpec(name, BUILTIN, classes, shape), result
    detected = result["output"]
    if output is not None and output != detected:
        say(f"output: the last layer gives {detected}; treated as {output} (--output)")
    return ModelSpec(name, IMPORTED, classes, result["input_shape"], input_scale or "0-255",
                     output or detected), result


def seed_replay(home: Home, store: Store, files: list[tuple[Path, Optional[str]]],
                classes: list[str], input_shape: list[int], policy: Any, *,
                resize: str = "stretch", antialias: bool = False) -> dict[str, Any]:
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
        input_shape: the model's (height, width, channels): the images' size and channels.
        policy: the home's policy (replay capacity).
        resize: ``odtd.yaml``'s ``images.resize``.
        antialias: ``odtd.yaml``'s ``images.antialias``.

    Returns:
        The ingest counts and ``size``, the buffer's size afterwards.

    Raises:
        IngestError: no image could be stored.
    """
    ingestor = Ingestor(home, store, classes, (input_shape[1], input_shape[0]), holdout_every=0,
                        channels=input_shape[2], resize=resize, antialias=antialias)
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


def load_validation_dir(
    path: Path, classes: list[str], input_shape: tuple[int, ...], resize: str = "stretch",
    antialias: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode a ``<label>/<file>`` directory into the fixed validation arrays.

    Images are prepared as ingest prepares samples (``odtd.home.images``); one that cannot be
    decoded is skipped with a warning.

    Args:
        path: the directory.
        classes: the model's classes, in output order.
        input_shape: the model's (height, width, channels).
        resize: ``odtd.yaml``'s ``images.resize``.
        antialias: ``odtd.yaml``'s ``images.antialias``.

    Returns:
        x uint8 (n, height, width, channels) and y int64 class indices.

    Raises:
        IngestError: the path is unusable, holds a label outside ``classes``, or no images.
    """
    if not path.is_dir():
        raise IngestError(f"--validation {path}: not a directory of <label>/<image> files")
    return decode_labelled(list(discover(path, None)), classes, input_shape,
                           f"--validation {path}", resize, antialias)


def decode_labelled(files: list[tuple[Path, Optional[str]]], classes: list[str],
                    input_shape: tuple[int, ...], what: str, resize: str = "stretch",
                    antialias: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Decode labelled image files (from ``discover``) into x uint8 NHWC and y class indices.

    An image that cannot be decoded is skipped with a warning; a label outside ``classes`` or
    no readable image at all is an error naming ``what`` (the option and its directory).
    """
    option = what.split()[0]
    index = {name: i for i, name in enumerate(classes)}
    xs, ys = [], []
    for file, label in files:
        if label not in index:
            raise IngestError(f"{option} {file}: label {label!r} is not one of the classes {classes}")
        try:
            xs.append(decode_image(file.read_bytes(), input_shape, resize, antialias))
        except (BadImage, OSError) as exc:
            logger.warning("%s image %s skipped: %s", option.lstrip("-"), file, exc)
            continue
        ys.append(index[label])
    if not xs:
        raise IngestError(f"{what}: no readable images under <label>/ folders")
    return np.stack(xs), np.array(ys, dtype=np.int64)
