"""The device's world as it is: an uneven class mix, runs of one class, more images than labels.

Every other draw in ``odtd.sim`` gives a device the classes evenly, shuffled, every image
labelled. A ``Scenario`` says how a camera's stream differs (issue 55; docs/scenarios.md):

- ``priors``: the device's class mix, a Dirichlet draw with concentration ``alpha`` (fixed per
  seed). Its images, its hold-out and its test images all follow that one mix.
- ``runs``: the images arrive in runs of one class of mean length ``runs`` (geometric lengths,
  each run's class drawn from the mix), in order and across day boundaries: one day may hold a
  few classes only.
- ``unlabelled``: that many more images a day from the same stream, without labels.

Standard library and numpy only: the draws are indices into a labelled data set's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from odtd.errors import ConfigError


@dataclass(frozen=True)
class Scenario:
    """How a device's stream differs from an even, shuffled, labelled one.

    Attributes:
        priors: The Dirichlet concentration of the device's class mix; None: every class alike.
        runs: The mean length of a run of one class; None: shuffled (no runs).
        unlabelled: Images a day without labels, beside the labelled ones.
    """

    priors: Optional[float] = None
    runs: Optional[float] = None
    unlabelled: int = 0

    @classmethod
    def parse(cls, priors: Optional[str] = None, stream: Optional[str] = None,
              unlabelled: int = 0) -> Scenario:
        """Read ``--priors dirichlet:ALPHA``, ``--stream runs:MEAN`` and ``--unlabelled K``.

        Raises:
            ConfigError: One line naming the option, the value and the form it takes.
        """
        return cls(_parsed("--priors", priors, "dirichlet", lambda v: v > 0, "above 0"),
                   _parsed("--stream", stream, "runs", lambda v: v >= 1, "at least 1"),
                   _count("--unlabelled", unlabelled))

    @property
    def even(self) -> bool:
        """True for the even, shuffled, labelled stream every other draw gives."""
        return self.priors is None and self.runs is None and not self.unlabelled

    def describe(self) -> str:
        """The scenario in the options' words (``even`` when nothing is set)."""
        parts = ([f"priors dirichlet:{self.priors:g}"] if self.priors is not None else []) + \
            ([f"stream runs:{self.runs:g}"] if self.runs is not None else []) + \
            ([f"{self.unlabelled} unlabelled a day"] if self.unlabelled else [])
        return ", ".join(parts) or "even"

    def mix(self, classes: int, seed: int) -> np.ndarray:
        """The device's class mix (probabilities summing to 1), fixed per seed."""
        if self.priors is None:
            return np.full(classes, 1.0 / classes)
        return class_mix(classes, self.priors, seed)


def _parsed(option: str, text: Optional[str], kind: str, valid, wanted: str) -> Optional[float]:
    if text is None:
        return None
    name, _, value = text.partition(":")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if name != kind or not valid(number):
        raise ConfigError(f"{option} {text!r}: give {kind}:NUMBER, the number {wanted} "
                          f"(e.g. {option} {kind}:{'0.3' if kind == 'dirichlet' else '16'})")
    return number


def _count(option: str, value: int) -> int:
    if int(value) < 0:
        raise ConfigError(f"{option} {value}: give a number of images, 0 or more")
    return int(value)


def class_mix(classes: int, alpha: float, seed: int) -> np.ndarray:
    """A class mix drawn from a symmetric Dirichlet(``alpha``): small, a few classes; large, even."""
    return np.random.default_rng([seed, 55]).dirichlet([alpha] * classes)


def class_stream(n: int, mix: np.ndarray, runs: Optional[float], rng: np.random.Generator) -> np.ndarray:
    """``n`` labels in camera order: drawn from ``mix``, in runs of mean length ``runs``."""
    if runs is None or runs <= 1:
        return rng.choice(len(mix), size=n, p=mix)
    labels: List[int] = []
    while len(labels) < n:
        # A run's length is geometric with mean ``runs``; its class comes from the mix.
        labels += [int(rng.choice(len(mix), p=mix))] * int(rng.geometric(1.0 / runs))
    return np.array(labels[:n], dtype=np.int64)


def stream_draws(y: Sequence, days: int, per_day: int, scenario: Scenario, seed: int,
                 exclude: Iterable[int] = (), mix_seed: Optional[int] = None
                 ) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Each day's ``(labelled, unlabelled)`` indices into ``y``, in the order the camera saw them.

    A day holds ``per_day + scenario.unlabelled`` images of one stream (``class_stream``, the
    classes of ``scenario.mix``); ``per_day`` of them, chosen at random, are the labelled ones.
    Images are drawn without replacement; a class that runs out gives its place in the stream
    to the next image of another class (the stream stays the mix's as far as the data allow).
    ``mix_seed``: the seed of the device's mix where it is not ``seed`` (runs of other draws of
    one device, whose test images follow the mix).

    Raises:
        ValueError: fewer images left than the days need.
    """
    labels = np.asarray(y)
    rng = np.random.default_rng([seed, 56])
    classes = int(labels.max()) + 1 if len(labels) else 0
    available = np.ones(len(labels), dtype=bool)
    available[np.asarray(list(exclude), np.int64)] = False
    pools = [list(rng.permutation(np.flatnonzero((labels == c) & available))) for c in range(classes)]
    per = per_day + scenario.unlabelled
    if sum(len(pool) for pool in pools) < days * per:
        raise ValueError(f"{days} days x {per} images need {days * per}, but only "
                         f"{sum(len(p) for p in pools)} are left; fewer days or images a day")
    mix = scenario.mix(classes, seed if mix_seed is None else mix_seed)
    order = class_stream(days * per, mix, scenario.runs, rng)
    picked = []
    for label in order:
        if not pools[label]:  # this class ran out: the next class that has images left
            label = next(c for c in np.argsort([-len(p) for p in pools], kind="stable") if pools[c])
        picked.append(pools[label].pop())
    out = []
    for day in range(days):
        today = np.array(picked[day * per:(day + 1) * per], dtype=np.int64)
        chosen = np.zeros(per, dtype=bool)
        chosen[rng.choice(per, size=per_day, replace=False)] = True
        out.append((today[chosen], today[~chosen]))
    return out


def mixed_sample(y: Sequence, n: int, mix: np.ndarray, seed: int,
                 exclude: Iterable[int] = ()) -> np.ndarray:
    """``n`` indices into ``y`` whose classes follow ``mix`` (test images, a hold-out).

    The count of each class is ``n * mix`` rounded (largest remainders), at most what is left.
    """
    labels = np.asarray(y)
    rng = np.random.default_rng([seed, 57])
    want = np.floor(n * np.asarray(mix)).astype(int)
    want[np.argsort(-(n * np.asarray(mix) - want), kind="stable")[:n - int(want.sum())]] += 1
    available = np.ones(len(labels), dtype=bool)
    available[np.asarray(list(exclude), np.int64)] = False
    parts = [rng.permutation(np.flatnonzero((labels == c) & available))[:count]
             for c, count in enumerate(want)]
    return rng.permutation(np.concatenate(parts)).astype(np.int64)
