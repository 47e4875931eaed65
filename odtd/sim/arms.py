"""The arms of scripts/reproduce_tx2_daily.py: odtd and its controls, on the same days and images.

Every arm starts from the same pre-trained base model and lives through the same days; only what
it learns from differs, so the difference of two arms on the same test images says what that
difference is worth:

- ``odtd`` (a): odtd as configured, a session a day on the device's images (through its own
  home, ``Ingestor`` and ``SessionRunner``: replay, guard, promotion, energy).
- ``replay`` (b): the same sessions with nothing new: each day as many images as odtd trained
  on, taken from the base model's own training images (its replay seed, already rehearsed), so
  the recipe, the steps and the guard are odtd's and only the device's images are missing.
- ``clean`` (c): the same sessions on the very images odtd trained on, as the original domain
  saw them (unshifted); only with a camera shift.
- ``plain`` (d): plain fine-tuning as the published experiment: all the day's images, SGD 0.005,
  momentum 0.9, batch 16, 3 epochs, BatchNorm trained, no replay, no guard.
- ``adabn`` (e): BatchNorm statistics re-estimated on every image the device has seen so far,
  under the base model's weights (AdaBN); no labels, no training.
- ``none`` (f): no training: the base model.
- ``priors`` (g): the base model with the device's class priors (``training.prior_correction``'s
  EM over every image the device has seen, labelled or not), kept as its logit offset; no
  training. With ``--priors`` only.
- ``tent`` (h): TENT, BatchNorm's scale and offset trained online by the entropy of the
  predictions on the device's images, labelled or not (no label read).

The controls that run no session are in ``odtd.sim.controls``.

(b) and (c) ingest with no hold-out, so they train on exactly as many new images as (a) did.
Each arm's ``day`` returns ``{"weights": the model it serves, "energy_j": what the day's training
cost (None: not measured), "validation": its accuracy on the home's validation set when its
session measured it, ...}``. No TensorFlow here: the worker runs every job.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from odtd.config import Config
from odtd.errors import ConfigError
from odtd.home.ingest import DEFAULT_HOLDOUT_EVERY, Ingestor, discover
from odtd.home.paths import UNLABELLED_FOLDER, Home
from odtd.home.versions import ModelRepo
from odtd.policy import Policy, load_policy
from odtd.session.runner import SessionRunner
from odtd.sim import datasets
from odtd.trainer.protocol.job import make_job
from odtd.trainer.protocol.launch import WARMUP_STEPS, run_job

ARMS = {
    "odtd": "(a) odtd as configured, on the device's images",
    "replay": "(b) odtd's sessions with nothing new: as many of its replay images as (a) trained on",
    "clean": "(c) odtd's sessions on (a)'s images from the original domain (with a shift only)",
    "plain": "(d) plain fine-tuning on the day's images (SGD 0.005, batch 16, 3 epochs)",
    "adabn": "(e) BatchNorm statistics re-estimated on the device's images; no training",
    "none": "(f) no training: the base model",
    "priors": "(g) the base model with the device's class priors (EM over its images); no training",
    "tent": "(h) TENT: BatchNorm's scale and offset trained online by entropy; no labels",
    "labels": "(i) odtd with labels only: the policy's label-free options off, no images without "
              "labels",
}
SESSION_ARMS = ("odtd", "replay", "clean", "labels")
OWN_IMAGES = ("odtd", "labels")  # the session arms that ingest the device's images themselves
CONTROLS = ("replay", "clean")  # what (a) is compared with day by day


def parse_arms(text: Optional[str], shifted: bool, priors: bool = False, uneven: bool = False
               ) -> list[str]:
    """The arms ``--arms`` names, in ``ARMS`` order.

    Args:
        text: comma-separated names or letters (``odtd,replay`` or ``a,b``); None or ``all``:
            every arm that applies (``clean`` only with a shift, ``priors`` with uneven priors,
            ``tent`` and ``labels`` in any scenario but the even, shuffled, labelled stream).
        shifted: a camera shift is set.
        priors: the device's classes are uneven (``--priors``).
        uneven: any of ``--priors``, ``--stream``, ``--unlabelled`` is set.

    Raises:
        ConfigError: an unknown arm, ``clean`` without a shift, or a control of (a) without it.
    """
    if text is None or text == "all":
        return [name for name in ARMS if (shifted or name != "clean") and (priors or name != "priors")
                and (uneven or name not in ("tent", "labels"))]
    by_letter = {chr(ord("a") + index): name for index, name in enumerate(ARMS)}
    chosen = set()
    for word in filter(None, (part.strip() for part in text.split(","))):
        name = by_letter.get(word, word)
        if name not in ARMS:
            known = ", ".join(f"{known} ({letter})" for letter, known in by_letter.items())
            raise ConfigError(f"--arms: {word!r} is not an arm; use names or letters of {known}, or all")
        chosen.add(name)
    if not chosen:
        raise ConfigError("--arms: no arm named; use e.g. --arms odtd,replay or all")
    if "clean" in chosen and not shifted:
        raise ConfigError("--arms clean: the original domain is the device's without --shift; set "
                          "a --shift or leave clean out")
    if chosen & set(CONTROLS) and "odtd" not in chosen:
        raise ConfigError(f"--arms {text}: replay and clean repeat odtd's days with other images; "
                          "add odtd")
    return [name for name in ARMS if name in chosen]


def labels_only(policy: Policy) -> Policy:
    """``policy`` with the options that learn without labels off: the ``labels`` arm's recipe.

    ``prior_correction``, ``pseudo_labels`` and ``bn_class_balanced`` (what issue 55 added
    for a device's uneven, unlabelled world); everything else as configured.
    """
    training = policy.training.model_copy(update={
        "prior_correction": False, "pseudo_labels": None, "bn_class_balanced": False})
    return policy.model_copy(update={"training": training})


@dataclass
class Trial:
    """What every arm shares: the network, the machine's settings, where files go.

    Attributes:
        model: the network: built in, or the name of the model a home imported.
        classes: its class names.
        input_shape: (height, width, channels).
        precision: the worker's precision (``auto``, ``fp32``, ...).
        work: a directory for temporary files.
        meter: measures a worker run's energy (``SessionEnergyMeter``), or None.
        log: progress lines.
        model_keys: the job keys of an imported model (``ModelSpec.job_keys``: its
            architecture, input scale and output); empty for a built-in network.
    """

    model: str
    classes: list[str]
    input_shape: list[int]
    precision: str
    work: Path
    meter: Any = None
    log: Callable[[str], None] = lambda message: None
    model_keys: dict[str, Any] = field(default_factory=dict)

    def job(self, mode: str, **keys: Any) -> dict[str, Any]:
        """A worker job for this trial's network (``make_job``) at its precision.

        Every arm's precision ``auto`` is the same: the first job's measured verdict is kept in
        ``work`` (``odtd.trainer.plans.precision``).
        """
        return make_job(mode, self.model, self.classes, self.input_shape,
                        **{"precision": self.precision,
                           "precision_probe": str(self.work / "precision.json"),
                           **self.model_keys, **keys})

    def run(self, job: dict[str, Any], metered: bool = False,
            on_message: Optional[Callable[[dict[str, Any]], None]] = None
            ) -> tuple[dict[str, Any], Optional[float]]:
        """Run a worker job; return its result and, if ``metered``, its energy in joules.

        Raises:
            TrainerFailed: the worker failed.
        """
        token = self.meter.begin() if metered and self.meter is not None else None
        steps: list[dict[str, Any]] = []
        try:
            with tempfile.TemporaryDirectory(dir=self.work) as tmp:
                result, steps, _ = run_job(Config().trainer.command(), job, Path(tmp), on_message)
        finally:
            energy = self.meter.end(token, steps, WARMUP_STEPS) if token is not None else None
        return result, None if energy is None else energy["energy_j"]


@dataclass
class Day:
    """One day of the device's images, shared by every arm.

    Attributes:
        number: 1 for the first day.
        stamp: the YYYY-MM-DD its samples and sessions carry.
        names: the data set's names of the day's images (its train split).
        x: the images as the device's camera saw them (shifted when a shift is set), uint8.
        y: their labels.
        shifted: a shift is set (the files of ``x`` are written as PNG, not as the originals).
        trained: positions in ``names`` of the images (a) trained on (not held out); its arm
            sets them, (b) and (c) use them.
        unlabelled: the day's images without a label (``--unlabelled``), as the camera saw them.
    """

    number: int
    stamp: str
    names: list[str]
    x: np.ndarray
    y: np.ndarray
    shifted: bool
    trained: Optional[list[int]] = None
    unlabelled: Optional[np.ndarray] = None


class ReplayPool:
    """The base model's own training images, each lent once to the replay-only arm (b).

    Args:
        dataset: the data set.
        indices: its train images in the replay buffer (not the home's reference set: see
            `buffered_images`).
        seed: the order they are lent in.
    """

    def __init__(self, dataset: datasets.ImageDataset, indices: np.ndarray, seed: int) -> None:
        self.dataset = dataset
        self.order = np.random.default_rng(seed).permutation(np.asarray(indices))
        self.used = 0

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Decode the next ``count`` images (ConfigError: the pool is spent)."""
        if self.used + count > len(self.order):
            raise ConfigError(f"the replay-only arm has used {self.used} of the {len(self.order)} "
                              f"replay seed images and needs {count} more; raise --replay-seed")
        chosen = self.order[self.used:self.used + count]
        self.used += count
        return self.dataset.load_arrays("train", chosen)


def buffered_images(home: Home) -> set[str]:
    """The ``<class>/<file>`` names of a home's seeded images that are in its replay buffer.

    ``init --replay`` holds part of the seed out as the reference set; (b) must not train on it.
    """
    store = home.open_store()
    try:
        rows = store.samples_by_sha(entry["sha256"] for entry in store.replay_buffer())
    finally:
        store.close()
    return {"/".join(Path(row["original_path"]).parts[-2:]) for row in rows}


def link_home(template: Path, target: Path) -> Home:
    """Copy a home for one arm; samples (content-addressed, never modified) are hard links."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(template, target, symlinks=True, ignore=shutil.ignore_patterns("samples"))
    if (template / "samples").exists():
        shutil.copytree(template / "samples", target / "samples", copy_function=os.link)
    return Home(target)


class SessionArm:
    """(a), (b) or (c): a home of its own, a session a day through odtd's real path.

    Args:
        name: ``odtd``, ``replay``, ``clean`` or ``labels``.
        trial: the shared settings (its ``meter`` measures the sessions).
        home: this arm's home (see `link_home`), its policy in ``policy.yaml``.
        dataset: the data set the day's names come from.
        pool: the replay-only arm's images (``replay`` only).
    """

    def __init__(self, name: str, trial: Trial, home: Home, dataset: datasets.ImageDataset,
                 pool: Optional[ReplayPool] = None) -> None:
        self.name, self.trial, self.home, self.dataset, self.pool = name, trial, home, dataset, pool
        self.store = home.open_store()
        config = home.load_config()
        self.runner = SessionRunner(home, self.store, config, load_policy(home.root / "policy.yaml"),
                                    energy_meter=trial.meter)
        # (b) and (c) train on as many new images as (a): none of theirs is held out.
        self.ingestor = Ingestor.for_home(home, self.store, config,
                                          holdout_every=DEFAULT_HOLDOUT_EVERY if name in OWN_IMAGES else 0)
        self.repo = ModelRepo(home.models, trial.model)

    def day(self, day: Day) -> dict[str, Any]:
        """Ingest this arm's images of ``day`` and run its session; return the day's record."""
        with tempfile.TemporaryDirectory(dir=self.trial.work) as tmp:
            folder = Path(tmp) / "images"
            paths = self._write(day, folder)
            if self.name == "odtd" and day.unlabelled is not None and len(day.unlabelled):
                # As an inbox's _unlabelled/ folder: samples without a label.
                datasets.write_image_folder(day.unlabelled, np.zeros(len(day.unlabelled), np.int64),
                                            [UNLABELLED_FOLDER], folder, start_index=day.number * 100_000)
            report = self.ingestor.ingest(discover(folder, None), day=day.stamp)
            if self.name == "odtd":
                written = {str(path): position for position, path in enumerate(paths)}
                day.trained = sorted(written[row["original_path"]] for row in self.store.samples("pending")
                                     if row["day"] == day.stamp and row["original_path"] in written)
            record = self.runner.run(trigger="simulate", day=day.stamp)
        version = self.repo.current()
        return {"weights": self.repo.weights_path(version), "model_version": version,
                # A skipped session (waiting for samples, a gate) ran no worker: no joules.
                "energy_j": 0.0 if record.outcome == "skipped" else record.energy_j,
                "validation": record.kept_accuracy,
                "ingested": report.accepted, "outcome": record.outcome,
                "validation_before": record.accuracy_before, "validation_after": record.accuracy_after,
                "batch_size": record.batch_size, "samples_new": record.samples_new,
                "samples_replay": record.samples_replay, "peak_memory_mb": record.peak_memory_mb,
                "session_s": record.duration_s, "energy_source": record.energy_source,
                "reference_before": record.details.reference_accuracy_before,
                "reference_after": record.details.reference_accuracy_after,
                "bn_device_weight": record.details.bn_device_weight,
                "bn_weights_tried": record.details.bn_weights_tried,
                "trained_share": record.details.trained_share}

    def _write(self, day: Day, folder: Path) -> list[Path]:
        """Write this arm's files of the day; return their paths."""
        classes = self.trial.classes
        if self.name in OWN_IMAGES:
            if not day.shifted:  # the original files, as the camera wrote them
                return self.dataset.extract("train", day.names, folder)
            return datasets.write_image_folder(day.x, day.y, classes, folder)
        if day.trained is None:
            raise RuntimeError(f"arm {self.name} runs after odtd on each day")
        if self.name == "clean":
            return self.dataset.extract("train", [day.names[i] for i in day.trained], folder)
        x, y = self.pool.take(len(day.trained))
        # As PNG: the same pixels as the seeded originals, but new files, so not duplicates.
        return datasets.write_image_folder(x, y, classes, folder)

    def close(self) -> None:
        """Close the arm's database."""
        self.store.close()
