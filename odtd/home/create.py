"""``odtctl init``: a new ODTD_HOME: config, policy, database, model v0, validation set, replay seed."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from odtd import atomic
from odtd.config import Config, default_config_text
from odtd.errors import ConfigError, IngestError, ModelError, TrainerFailed
from odtd.home.image_sets import decode_labelled, load_validation_dir
from odtd.home.ingest import Ingestor, discover
from odtd.home.paths import REFERENCE_EVERY, UNLABELLED_FOLDER, Home
from odtd.home.replay_buffer import update_buffer
from odtd.home.spec import (
    ARCHITECTURE_NAME,
    BUILTIN,
    IMPORTED,
    ORIGINAL_STEM,
    ModelSpec,
    builtin_input_shape,
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


@dataclass(frozen=True)
class InitRequest:
    """What a new home is made of: ``odtctl init``'s options, one field each.

    Attributes:
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
        input_size: a built-in network's (height, width) in pixels, at least its
            ``min_input_size``; None = the catalogue's default. Samples are fitted to it. With
            ``model_file``: the size of a model whose input has no height and width (refused
            for one that has them, unless the same).
        policy: a policy file to install (validated first); None = the recipe for the model
            (``policy.recipe_for``), unless the home already has a policy file.
    """

    model: Optional[str]
    classes: list[str]
    weights: Optional[Path] = None
    validation: Optional[Path] = None
    force: bool = False
    seed: int = 0
    validation_arrays: Optional[tuple[np.ndarray, np.ndarray]] = None
    replay: Optional[Path] = None
    reference_every: int = REFERENCE_EVERY
    model_file: Optional[Path] = None
    name: Optional[str] = None
    input_scale: Optional[str] = None
    output: Optional[str] = None
    input_size: Optional[tuple[int, int]] = None
    policy: Optional[Path] = None

    @property
    def source(self) -> str:
        """Where version 0 comes from, as the ``init`` event and the summary say it."""
        return str(self.model_file or self.weights or "fresh")


@dataclass(frozen=True)
class ReplayFiles:
    """``--replay``'s images, split: those that seed the buffer, those held out as reference."""

    seed: Optional[list[tuple[Path, Optional[str]]]]  # None: no --replay
    reference: list[tuple[Path, Optional[str]]]


@dataclass(frozen=True)
class HomeImages:
    """The fixed image sets a home keeps beside its samples, each (x uint8 NHWC, y) or None."""

    validation: Optional[tuple[np.ndarray, np.ndarray]]
    reference: Optional[tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Version0:
    """What version 0 was stored as, with its worker's result."""

    spec: ModelSpec
    version: int
    manifest: dict[str, Any]
    result: dict[str, Any]


def init_home(home: Home, request: InitRequest,
              progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Create an ODTD_HOME and return a summary.

    Version 0 is made first, by a worker, in a hidden staging directory of the home (on its
    filesystem, wherever that is mounted): a refused model file, unreadable weights, a bad
    validation directory or a full disk leave no half-made home.

    Args:
        home: the state directory.
        request: what to make it of (``odtctl init``'s options).
        progress: called with one-line progress messages.

    Raises:
        ConfigError: the home exists and ``force`` is not set, or an argument is invalid.
        ModelError: an unknown network, a missing or refused model file, unusable weights.
    """
    say = progress or (lambda message: None)
    # A failure removes whatever init created in the home: no half-made home stays. What was
    # there before stays (a config or policy a person wrote); --force had asked for the rest.
    with atomic.undone_on_failure(home.root):
        name, input_shape = check_request(home, request)
        replay = split_replay(request)
        recipe = _recipe(request)
        config = home.load_config()
        # Staged in the home itself: the files rename into place on the same filesystem.
        with atomic.staging_dir(home.root, "init-") as staging:
            stage = Path(staging)
            spec, result = stage_version0(config, stage, name, request, say, input_shape)
            if request.policy is None and request.model_file is not None:
                recipe = recipe_for(imported=True, batchnorm=result.get("batchnorm_layers") != 0)
            # Read the images before touching the home, so a bad path loses nothing.
            images = read_images(request, replay, spec, config, say)
            policy_path, recipe = lay_out(home, request, config, recipe, images)
            version0 = install_version0(home, stage, spec, result)
        ModelRepo(home.models, spec.name).set_current(version0.version)
        replay_size = record(home, request, version0, replay, policy_path, config)
        return _summary(home, request, version0, images, replay_size, policy_path, recipe)


def check_request(home: Home, request: InitRequest) -> tuple[str, Optional[list[int]]]:
    """Refuse a bad request before anything is made.

    Returns:
        The model's name in the home, and a built-in network's input shape (None for a model
        file: its own is read from it).
    """
    check_conventions(request.input_scale, request.output)
    if UNLABELLED_FOLDER in request.classes:
        raise ConfigError(f"--classes: {UNLABELLED_FOLDER!r} is reserved for images without a "
                          f"label (inbox/{UNLABELLED_FOLDER}/); name that class otherwise")
    shape = None
    if request.model_file is not None:
        if not request.model_file.is_file():
            raise ModelError(f"--model-file {request.model_file}: no such file")
        name = imported_name(request.name, request.model_file.stem)
    else:
        check_model_name(request.model)
        if request.input_scale is not None or request.output is not None:
            raise ConfigError("--input-scale and --output describe a model given with "
                              "--model-file; a built-in network has its own")
        name = request.model
        shape = builtin_input_shape(request.model, request.input_size)
    if request.weights is not None:
        check_weights_file(request.weights)
    if home.is_initialised() and not request.force:
        raise ConfigError(
            f"{home.root} is already an odtd home; pass --force to replace it "
            "(its samples, sessions and models are deleted)"
        )
    if request.reference_every < 0:
        raise ConfigError(f"--reference-every {request.reference_every}: give 0 (no reference "
                          "set) or a positive N")
    return name, shape


def split_replay(request: InitRequest) -> ReplayFiles:
    """``--replay``'s files: every ``reference_every``-th held out as the reference set."""
    if request.replay is None:
        return ReplayFiles(None, [])
    if not request.replay.is_dir():
        raise IngestError(f"--replay {request.replay}: not a directory of <label>/<image> files")
    files = list(discover(request.replay, None))
    every = request.reference_every
    if not every:
        return ReplayFiles(files, [])
    return ReplayFiles([f for i, f in enumerate(files) if (i + 1) % every],
                       files[every - 1::every])


def _recipe(request: InitRequest) -> Recipe:
    if request.policy is None:
        return recipe_for(request.model, imported=request.model_file is not None)
    load_policy(request.policy, missing_ok=False)  # a bad file is refused before anything is made
    return Recipe(str(request.policy), request.policy.read_text(encoding="utf-8"),
                  "given with --policy")


def read_images(request: InitRequest, replay: ReplayFiles, spec: ModelSpec, config: Config,
                say: Callable[[str], None]) -> HomeImages:
    """Decode the validation set and the reference set at the model's input shape.

    An unreadable reference set is said and left out (the buffer's seed is read later, with
    rejected images quarantined); a bad validation directory is an error.
    """
    resize, antialias = config.images.resize, config.images.antialias
    validation = request.validation_arrays
    if request.validation is not None:
        validation = load_validation_dir(request.validation, request.classes, spec.input_shape,
                                         resize=resize, antialias=antialias)
    reference = None
    # Labels outside the classes are quarantined by the replay seed; here they are left out.
    files = [(f, label) for f, label in replay.reference if label in request.classes]
    if files:
        try:
            reference = decode_labelled(files, request.classes, spec.input_shape,
                                        f"--replay {request.replay}", resize, antialias)
        except IngestError as exc:
            say(f"no reference set: {exc}")
    return HomeImages(validation, reference)


def lay_out(home: Home, request: InitRequest, config: Config, recipe: Recipe,
            images: HomeImages) -> tuple[Path, Recipe]:
    """Make the home's directories and files (wiping an old home with ``force``).

    Returns the policy file and the recipe it holds (the home's own file, kept, when one was
    there and no ``--policy`` was given).
    """
    if request.force:
        wipe_home(home)
    for directory in home.directories():
        directory.mkdir(parents=True, exist_ok=True)
    # Written in place, not staged: a failed init removes what it made by inode
    # (`atomic.undone_on_failure`), and a file a person wrote keeps its inode this way.
    if not home.config_path.exists():
        home.config_path.write_text(default_config_text(), encoding="utf-8")
    policy_path = home.policy_path(config)
    if request.policy is not None or not policy_path.exists():
        policy_path.write_text(recipe.text, encoding="utf-8")
    else:
        recipe = Recipe(str(policy_path), "", "the home's policy file, kept")
    if images.validation is not None:
        np.savez(home.validation_file(), x=images.validation[0], y=images.validation[1])
    if images.reference is not None:
        np.savez(home.reference_file(), x=images.reference[0], y=images.reference[1])
    return policy_path, recipe


def install_version0(home: Home, stage: Path, spec: ModelSpec, result: dict[str, Any]) -> Version0:
    """Move what the worker staged into the model's directory as version 0 (not yet current)."""
    repo = ModelRepo(home.models, spec.name)
    repo.dir.mkdir(parents=True, exist_ok=True)
    for staged in stage.glob(ORIGINAL_STEM + ".*"):
        atomic.move(staged, repo.dir / staged.name)
    if (stage / ARCHITECTURE_NAME).exists():
        atomic.move(stage / ARCHITECTURE_NAME, repo.dir / ARCHITECTURE_NAME)
    version, manifest = repo.add_version(
        stage / "weights.npz", classes=spec.classes, input_shape=spec.input_shape,
        param_count=result.get("param_count"), parent=None,
        weight_names=result.get("weight_names"), move=False)
    return Version0(spec, version, manifest, result)


def record(home: Home, request: InitRequest, version0: Version0, replay: ReplayFiles,
           policy_path: Path, config: Config) -> int:
    """Write the new home's database: the model, version 0, the ``init`` event, the replay seed.

    Returns the replay buffer's size (0 without ``--replay``).
    """
    spec, manifest = version0.spec, version0.manifest
    store = Store(home.db_path)
    try:
        spec.save(store)
        store.set_meta(created_at=utc_now())
        store.add_model_version({
            "model": spec.name, "version": version0.version, "parent": None, "session_id": None,
            "sha256": manifest["sha256"], "param_count": manifest["param_count"], "accuracy": None,
        })
        store.log_event("init", f"initialised with {spec.name} v{version0.version}",
                        weights=request.source)
        if replay.seed is None:
            return 0
        return seed_replay(home, store, replay.seed, spec.classes, spec.input_shape,
                           load_policy(policy_path), resize=config.images.resize,
                           antialias=config.images.antialias)["size"]
    finally:
        store.close()


def _summary(home: Home, request: InitRequest, version0: Version0, images: HomeImages,
             replay_size: int, policy_path: Path, recipe: Recipe) -> dict[str, Any]:
    spec, manifest = version0.spec, version0.manifest
    return {
        "home": str(home.root), "model": spec.name, "source": spec.source,
        "version": version0.version, "classes": spec.classes, "input_shape": spec.input_shape,
        "input_scale": spec.input_scale, "output": spec.output,
        "param_count": manifest["param_count"], "weights": request.source,
        "validation_samples": 0 if images.validation is None else int(len(images.validation[1])),
        "replay_samples": replay_size,
        "reference_samples": 0 if images.reference is None else int(len(images.reference[1])),
        "policy": {"file": str(policy_path), "recipe": recipe.name, "why": recipe.why},
        "notes": import_notes(spec, request.input_scale, version0.result),
    }


def import_notes(spec: ModelSpec, input_scale: Optional[str], result: dict[str, Any]) -> list[str]:
    """What a person should know about how an imported model was read (none for a built-in)."""
    notes = []
    if spec.imported and input_scale is None and not result.get("rescales_input"):
        notes.append(
            "the model does not start with a Rescaling or Normalization layer; it is fed pixels "
            "in 0..255: if it was trained on 0..1 or -1..1 pixels, init again with --input-scale")
    if result.get("arithmetic_layers"):
        notes.append(
            f"{result['arithmetic_layers']} tensor operations of the model (such as x + 3.0 or "
            f"x * y) are built as the Keras layers that compute the same (Rescaling, Add, "
            f"Subtract, Multiply); an export holds those layers")
    if spec.imported and input_scale not in (None, "0-255") and result.get("rescales_input"):
        notes.append(
            f"the model starts with a Rescaling or Normalization layer of its own and "
            f"--input-scale {input_scale} scales the pixels before it as well: unless it was "
            f"trained on pixels scaled twice, init again without --input-scale")
    return notes


def stage_version0(config: Config, stage: Path, name: str, request: InitRequest,
                   say: Callable[[str], None], input_shape: Optional[list[int]] = None,
                   ) -> tuple[ModelSpec, dict[str, Any]]:
    """Have a worker write version 0 into ``stage``; return the model's spec and the result.

    ``weights.npz`` always; an imported model adds ``architecture.json`` and its original file.

    A built-in network is built at ``input_shape`` (default: the catalogue's) and initialised
    from ``request.seed`` or loaded with ``request.weights`` (which proves they fit it). A model
    file is screened, built from its configuration and given its own weights; its input shape
    and output are read from it (``request.input_size`` fixes the height and width of one that
    has none).

    Raises:
        ModelError: the worker refused the file or the weights (the worker's one-line reason).
    """
    model_file, weights, classes = request.model_file, request.weights, request.classes
    if model_file is not None:
        suffix = ".h5" if model_file.suffix.lower() == ".h5" else ".keras"
        size = request.input_size
        job = make_job("import", name, classes, None, model_file=str(model_file.resolve()),
                       weights_out=str(stage / "weights.npz"),
                       architecture_out=str(stage / ARCHITECTURE_NAME),
                       original_out=str(stage / (ORIGINAL_STEM + suffix)),
                       input_size=None if size is None else list(size))
        say(f"reading {model_file} (screened: no code in it is run) ...")
    else:
        shape = input_shape or list(catalog.get(name).input_shape)
        job = make_job("init", name, classes, shape, seed=request.seed,
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
    if request.output is not None and request.output != detected:
        say(f"output: the last layer gives {detected}; treated as {request.output} (--output)")
    return ModelSpec(name, IMPORTED, classes, result["input_shape"],
                     request.input_scale or "0-255", request.output or detected), result


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
