"""The reproduction's controls: the arms that run no session (``odtd.sim.arms`` has the rest).

Each starts from the base model and lives through the same days (``Day``) as odtd; its ``day``
returns ``{"weights": the model it serves, "energy_j": what the day's work cost, ...}``. Every
job runs in the trainer worker (``Trial.run``); no TensorFlow here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from odtd import atomic
from odtd.home.versions import MANIFEST_NAME
from odtd.sim.arms import Day, Trial


class PlainArm:
    """(d) plain fine-tuning: the day's images, all of them, as the published experiment."""

    def __init__(self, trial: Trial, base_weights: Path, weights: Path, seed: int) -> None:
        self.trial, self.weights, self.seed = trial, weights, seed
        shutil.copyfile(base_weights, weights)

    def day(self, day: Day) -> dict[str, Any]:
        """Fine-tune on the day's images; return the day's record."""
        with tempfile.TemporaryDirectory(dir=self.trial.work) as tmp:
            data, out = Path(tmp) / "day.npz", Path(tmp) / "plain.npz"
            np.savez(data, x=day.x, y=day.y)
            _, energy_j = self.trial.run(self.trial.job(
                "train", weights_in=str(self.weights), weights_out=str(out), train_data=str(data),
                batch_size=16, epochs=3, optimizer="sgd", learning_rate=0.005, momentum=0.9,
                augment=False, freeze_bn=False, seed=self.seed + day.number), metered=True)
            atomic.move(out, self.weights, durable=False)  # a trial's scratch: no power cut to outlive
        return {"weights": self.weights, "energy_j": energy_j}


class AdaBnArm:
    """(e) the base model with BatchNorm's statistics recomputed over the device's images so far.

    A worker ``train`` job of zero epochs with ``recalibrate_bn``: no step, no label used, one
    forward pass per batch (the trainer's recalibration: each layer's moving mean and variance
    become the average of its batch statistics).
    """

    def __init__(self, trial: Trial, base_weights: Path, weights: Path, batch_size: int) -> None:
        self.trial, self.base, self.weights, self.batch_size = trial, base_weights, weights, batch_size
        self.seen: list[tuple[np.ndarray, np.ndarray]] = []

    def day(self, day: Day) -> dict[str, Any]:
        """Re-estimate over every image seen so far (with a label or not); return the day's record."""
        self.seen.append((day.x, day.y))
        if day.unlabelled is not None:
            self.seen.append((day.unlabelled, np.zeros(len(day.unlabelled), np.int64)))
        with tempfile.TemporaryDirectory(dir=self.trial.work) as tmp:
            data = Path(tmp) / "seen.npz"
            np.savez(data, x=np.concatenate([x for x, _ in self.seen]),
                     y=np.concatenate([y for _, y in self.seen]))  # labels unused; the file needs them
            _, energy_j = self.trial.run(self.trial.job(
                "train", weights_in=str(self.base), weights_out=str(self.weights), train_data=str(data),
                batch_size=self.batch_size, epochs=0, optimizer="sgd", learning_rate=0.001,
                recalibrate_bn=True), metered=True)
        return {"weights": self.weights, "energy_j": energy_j}


class PriorArm:
    """(g) the base model with the device's class priors as its logit offset; no training.

    A worker ``train`` job of zero epochs with ``prior_correction``: every labelled image the
    device has seen counted by its label, every other one by the base model's posteriors,
    calibrated on ``calibration`` (images of the original domain), unless those disagree with
    the labels (``priors.disagreement``). The offset goes to a
    ``manifest.json`` beside the weights, which scoring reads as it reads a version's.
    """

    def __init__(self, trial: Trial, base_weights: Path, directory: Path,
                 calibration: tuple[np.ndarray, np.ndarray], validation: tuple[np.ndarray, np.ndarray],
                 batch_size: int) -> None:
        self.trial, self.base, self.batch_size = trial, base_weights, batch_size
        self.calibration, self.validation = calibration, validation
        directory.mkdir(parents=True, exist_ok=True)
        self.weights = directory / "weights.npz"
        shutil.copyfile(base_weights, self.weights)
        self.labelled: list[tuple[np.ndarray, np.ndarray]] = []
        self.unlabelled: list[np.ndarray] = []

    def day(self, day: Day) -> dict[str, Any]:
        """Estimate the priors over every image seen so far; return the day's record."""
        self.labelled.append((day.x, day.y))
        if day.unlabelled is not None:
            self.unlabelled.append(day.unlabelled)
        x = np.concatenate([x for x, _ in self.labelled] + [self.calibration[0]])
        y = np.concatenate([y for _, y in self.labelled] + [self.calibration[1]])
        seen = sum(len(labels) for _, labels in self.labelled)
        unlabelled = np.concatenate(self.unlabelled) if self.unlabelled else x[:0]
        with tempfile.TemporaryDirectory(dir=self.trial.work) as tmp:
            data, validation = Path(tmp) / "seen.npz", Path(tmp) / "validation.npz"
            np.savez(data, x=x, y=y, device=np.arange(len(y)) < seen, unlabelled_x=unlabelled)
            np.savez(validation, x=self.validation[0], y=self.validation[1])
            result, energy_j = self.trial.run(self.trial.job(
                "train", weights_in=str(self.base), weights_out=str(Path(tmp) / "out.npz"),
                train_data=str(data), validation_data=str(validation), batch_size=self.batch_size,
                epochs=0, optimizer="sgd", learning_rate=0.001, prior_correction=True), metered=True)
        atomic.write_text(self.weights.with_name(MANIFEST_NAME),
                          json.dumps({"logit_offset": result["logit_offset_after"]}), durable=False)
        return {"weights": self.weights, "energy_j": energy_j, "validation": result["accuracy_after"],
                "priors": result.get("priors")}


class TentArm:
    """(h) TENT: BatchNorm's scale and offset trained online by the entropy of the predictions.

    Each day one epoch over the day's images (with a label or not; none is read), in the
    camera's order, from yesterday's weights: a worker ``train`` job with ``trainable:
    batchnorm`` and ``objective: entropy`` (Wang et al., ICLR 2021), Adam at 0.001 as the
    paper's CIFAR runs. TENT normalises with each test batch's statistics; here the moving
    statistics are re-estimated on the day's images after the steps (``recalibrate_bn``), the
    nearest a served model with fixed statistics comes.
    """

    def __init__(self, trial: Trial, base_weights: Path, weights: Path, batch_size: int) -> None:
        self.trial, self.weights, self.batch_size = trial, weights, batch_size
        shutil.copyfile(base_weights, weights)

    def day(self, day: Day) -> dict[str, Any]:
        """Adapt on the day's images; return the day's record."""
        x = day.x if day.unlabelled is None else np.concatenate([day.x, day.unlabelled])
        with tempfile.TemporaryDirectory(dir=self.trial.work) as tmp:
            data, out = Path(tmp) / "day.npz", Path(tmp) / "tent.npz"
            np.savez(data, x=x, y=np.zeros(len(x), np.int64))  # labels unused; the file needs them
            _, energy_j = self.trial.run(self.trial.job(
                "train", weights_in=str(self.weights), weights_out=str(out), train_data=str(data),
                batch_size=self.batch_size, epochs=1, optimizer="adam", learning_rate=0.001,
                trainable="batchnorm", objective="entropy", recalibrate_bn=True, augment=False,
                seed=day.number), metered=True)
            atomic.move(out, self.weights, durable=False)  # a trial's scratch: no power cut to outlive
        return {"weights": self.weights, "energy_j": energy_j}


class BaseArm:
    """(f) no training: the base model, every day."""

    def __init__(self, base_weights: Path) -> None:
        self.weights = base_weights

    def day(self, day: Day) -> dict[str, Any]:
        """Nothing to do; return the day's record."""
        return {"weights": self.weights, "energy_j": 0.0}
