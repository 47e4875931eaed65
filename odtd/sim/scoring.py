"""Scoring the reproduction's arms on the same test images, image by image, and comparing them.

`ScoringSets` scores a model's weights on the test images (shifted and clean when a camera shift
is set; a fixed daily subset or all of them) and, if asked, on the device's validation set, in
one worker run. The worker reports accuracy per group of a validation file; each test image is
its own group, so its answer is every image's correctness, which a paired comparison needs. A
model is scored once per set (by the hash of its weights): a day that keeps its model costs
nothing.

`paired_difference` compares two arms on the same images; `RunLog` collects one run's days and
turns them into its report (accuracy per day and arm, the differences of odtd from its controls,
joules per point gained on validation); `combine_runs` pools the last day of several seeds.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from odtd.home.versions import MANIFEST_NAME
from odtd.report.efficiency import joules_per_point
from odtd.sim.arms import Trial

VALIDATION_GROUP = -1  # the validation images' group in a scoring file; test images are 0..n-1


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Scores:
    """One model's results: per test image correctness by domain, and its validation accuracy.

    Attributes:
        correct: domain (``shifted``, ``clean``) -> bool per test image of the set scored.
        full: the set is all the test images (else the daily subset).
        validation: accuracy on the validation set, or None if not scored.
    """

    correct: dict[str, np.ndarray]
    full: bool
    validation: Optional[float] = None

    def accuracy(self) -> dict[str, float]:
        """Accuracy per domain."""
        return {domain: float(np.mean(hits)) for domain, hits in self.correct.items()}


class ScoringSets:
    """The test images every arm is scored on, and the validation set.

    Args:
        trial: the shared settings (the worker runs the scoring).
        images: domain -> uint8 test images (``clean``, and ``shifted`` first when a shift is
            set), the same images and labels in each; or, under a scenario (``sim.scenario``),
            ``device`` (its class mix and camera) and ``clean`` (evenly mixed: the reference),
            as many images in each.
        y: their labels; or domain -> labels where the domains' images differ.
        daily: indices of the subset scored every day.
        validation: the device's validation set (x, y).
        batch_size: the evaluation batch.
        name: the scoring files' stem in ``trial.work`` (sets that share a trial need their own).
        offset_domains: the domains a version's logit offset (its class priors) applies to:
            those of the device's mix, ``validation`` among them (None: all of them and the
            validation set; under a scenario not ``clean``).
    """

    def __init__(self, trial: Trial, images: dict[str, np.ndarray], y: Any,
                 daily: np.ndarray, validation: tuple[np.ndarray, np.ndarray],
                 batch_size: int = 250, name: str = "score",
                 offset_domains: Optional[tuple[str, ...]] = None) -> None:
        self.labels = y if isinstance(y, dict) else {domain: y for domain in images}
        if len({len(labels) for labels in self.labels.values()}) != 1:
            raise ValueError("ScoringSets: every domain needs as many test images")
        self.trial, self.images, self.daily = trial, images, np.asarray(daily)
        # The validation set is the device's, as its test images are (a session scores it so).
        self.offset_domains = (*images, "validation") if offset_domains is None else offset_domains
        self.count = len(next(iter(self.labels.values())))  # test images in each domain
        self.validation, self.batch_size, self.name = validation, batch_size, name
        self.domains = list(images)
        self._cache: dict[tuple[str, bool], Scores] = {}
        self._files: dict[tuple[bool, bool], Path] = {}

    def _file(self, full: bool, validation: bool) -> Path:
        """The scoring file: the set in every domain, each image its own group; then validation."""
        key = (full, validation)
        if key not in self._files:
            chosen = slice(None) if full else self.daily
            x = [self.images[domain][chosen] for domain in self.domains]
            y = [self.labels[domain][chosen] for domain in self.domains]
            if validation:
                x.append(self.validation[0])
                y.append(self.validation[1])
            count = sum(len(part) for part in y)
            tests = count - (len(self.validation[1]) if validation else 0)
            group = np.full(count, VALIDATION_GROUP, np.int64)
            group[:tests] = np.arange(tests)
            stem = f"{self.name}-{'all' if full else 'daily'}{'-val' if validation else ''}"
            path = self.trial.work / f"{stem}.npz"
            # A version's logit offset (its class priors) applies to the images of the device's
            # mix, named here: each image is its own group, so the worker's default (all but
            # group "2") would not do.
            offset = np.concatenate([np.full(len(part), domain in self.offset_domains)
                                     for part, domain in zip(y, self.domains + ["validation"])])
            np.savez(path, x=np.concatenate(x), y=np.concatenate(y), group=group, offset=offset)
            self._files[key] = path
        return self._files[key]

    def score(self, weights: Path, full: bool = False, validation: bool = False) -> Scores:
        """Score ``weights`` on all test images (``full``) or the daily subset; cached by content.

        A version's logit offset (``version_logit_offset``) is applied, and is part of the key.
        """
        offset = version_logit_offset(weights)
        sha = file_sha256(weights) + ("" if offset is None else json.dumps(offset))
        cached = self._cache.get((sha, full)) or (None if full else self._cache.get((sha, True)))
        if cached is not None and (cached.validation is not None or not validation):
            if cached.full and not full:
                return Scores({d: hits[self.daily] for d, hits in cached.correct.items()}, False,
                              cached.validation)
            return cached
        path = self._file(full, validation)
        size = self.count if full else len(self.daily)
        self.trial.log(f"  scoring {weights.name} on {size * len(self.domains):,} test images"
                       + (f" and {len(self.validation[1]):,} validation images" if validation else ""))
        result, _ = self.trial.run(self.trial.job(
            "evaluate", weights_in=str(weights), validation_data=str(path), batch_size=self.batch_size,
            eval_batch_size=self.batch_size, logit_offset=offset))
        by_group = result["by_group_after"]
        hits = np.array([by_group[str(g)] > 0.5 for g in range(size * len(self.domains))])
        scores = Scores({domain: hits[n * size:(n + 1) * size] for n, domain in enumerate(self.domains)},
                        full, by_group.get(str(VALIDATION_GROUP)))
        self._cache[(sha, full)] = scores
        return scores


def version_logit_offset(weights: Path) -> Optional[list[float]]:
    """The logit offset a model version keeps beside its weights (``training.prior_correction``).

    Read from the ``manifest.json`` next to ``weights`` where there is one: a version scored
    is scored as it serves.
    """
    manifest = weights.with_name(MANIFEST_NAME)
    if not manifest.is_file():
        return None
    return json.loads(manifest.read_text(encoding="utf-8")).get("logit_offset")


def paired_difference(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Arm a's accuracy less arm b's, on the same images, in points, with standard errors.

    Args:
        a: bool correctness per image, (images,) or (seeds, images): one row per run.
        b: the same for the other arm.

    Returns:
        ``points`` (the mean difference), ``se`` (its standard error over the test images: the
        per-image differences, averaged over the runs, as a sample of images), ``seeds``; with
        two or more runs also ``se_seeds`` (the standard error of the runs' differences).
    """
    a, b = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
    per_image = (a - b).mean(axis=0)
    images = per_image.size
    out = {"points": round(100 * float(per_image.mean()), 3),
           "se": round(100 * float(per_image.std() / np.sqrt(images)), 3), "seeds": len(a)}
    if len(a) > 1:
        per_run = (a - b).mean(axis=1)
        out["se_seeds"] = round(100 * float(per_run.std(ddof=1) / np.sqrt(len(a))), 3)
    return out


@dataclass
class RunLog:
    """One run (one seed) of every arm: the days, then its report.

    Attributes:
        seed: the run's seed.
        arms: the arms, in order.
        base: the base model's scores (all test images and validation).
        daily: indices of the daily subset in the test images.
        rows: one per day, the day-0 row first (see `day`): accuracy on the daily subset.
        final: arm -> its scores on all test images after the last day.
    """

    seed: int
    arms: list[str]
    base: Scores
    daily: np.ndarray
    rows: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Scores] = field(default_factory=dict)
    _daily: list[dict[str, Scores]] = field(default_factory=list)
    _energy: dict[str, Optional[float]] = field(default_factory=dict)
    _validation: dict[str, Optional[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._energy = {arm: 0.0 for arm in self.arms}
        self._validation = {arm: self.base.validation for arm in self.arms}
        base = self._subset(self.base)
        self.rows.append({"day": 0, "arms": {
            arm: {**base.accuracy(), "validation": self.base.validation, "energy_j_total": 0.0}
            for arm in self.arms}})

    def _subset(self, scores: Scores) -> Scores:
        """Scores on the daily subset (from scores on all test images if need be)."""
        if not scores.full:
            return scores
        return Scores({d: c[self.daily] for d, c in scores.correct.items()}, False, scores.validation)

    def day(self, number: int, records: dict[str, dict[str, Any]], scores: dict[str, Scores]
            ) -> dict[str, Any]:
        """Add a day: each arm's record (``SessionArm.day`` and friends) and its scores.

        Scores on all test images (the last day) are kept as `final` and reported on the subset.
        """
        if all(s.full for s in scores.values()):
            self.final = dict(scores)
        subset = {arm: self._subset(s) for arm, s in scores.items()}
        self._daily.append(subset)
        row: dict[str, Any] = {"day": number, "arms": {}}
        for arm in self.arms:
            record = {k: v for k, v in records[arm].items() if k != "weights"}
            energy = record.get("energy_j")
            total = self._energy[arm]
            self._energy[arm] = None if total is None or energy is None else total + energy
            # A day without a figure (a skipped session, validation not scored) keeps the last.
            validation = next((v for v in (record.get("validation"), subset[arm].validation,
                                           self._validation[arm]) if v is not None), None)
            self._validation[arm] = validation
            gain = None if validation is None else validation - self.base.validation
            row["arms"][arm] = {**subset[arm].accuracy(), **record, "validation": validation,
                                "energy_j_total": _round(self._energy[arm]),
                                "joules_per_point": per_validation_point(self._energy[arm], gain)}
        row["differences"] = self._differences(subset)
        self.rows.append(row)
        return row

    def _differences(self, scores: dict[str, Scores]) -> dict[str, dict[str, Any]]:
        """(a) less each other arm, per domain, on the images both were scored on."""
        if "odtd" not in scores:
            return {}
        mine = scores["odtd"].correct
        return {f"odtd-{arm}": {d: paired_difference(mine[d], s.correct[d]) for d in mine}
                for arm, s in scores.items() if arm != "odtd"}

    def report(self) -> dict[str, Any]:
        """The run's report: rows, and each arm's last day on all test images."""
        base = self.base.accuracy()
        final = {arm: {"accuracy": s.accuracy(),
                       "gain_points": {d: _points(a - base[d]) for d, a in s.accuracy().items()}}
                 for arm, s in self.final.items()}
        return {"seed": self.seed, "rows": self.rows, "final": final,
                "final_differences": self._differences(self.final)}


def combine_runs(runs: list[RunLog]) -> dict[str, Any]:
    """The last day over every run: each arm's mean accuracy, and (a)'s paired differences."""
    arms = runs[0].arms
    base = runs[0].base.accuracy()
    out: dict[str, Any] = {"seeds": [run.seed for run in runs], "arms": {}, "differences": {}}
    for arm in arms:
        accuracy = {d: float(np.mean([run.final[arm].accuracy()[d] for run in runs])) for d in base}
        out["arms"][arm] = {"accuracy": accuracy,
                            "gain_points": {d: _points(a - base[d]) for d, a in accuracy.items()}}
    if "odtd" in arms:
        for arm in arms:
            if arm != "odtd":
                out["differences"][f"odtd-{arm}"] = {d: paired_difference(
                    np.stack([run.final["odtd"].correct[d] for run in runs]),
                    np.stack([run.final[arm].correct[d] for run in runs])) for d in base}
    return out


def _points(fraction: float) -> float:
    # + 0.0: a mean of equal accuracies can differ from them by a rounding error, never -0.0.
    return round(100 * fraction, 3) + 0.0


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 1)


def per_validation_point(energy_j: Optional[float], gain: Optional[float]) -> Optional[float]:
    """Joules per point of validation accuracy gained (``gain`` 0..1); None without energy or gain."""
    if energy_j is None or gain is None:
        return None
    per_point = joules_per_point(energy_j, 100 * gain)
    return None if per_point is None else round(per_point, 1)
