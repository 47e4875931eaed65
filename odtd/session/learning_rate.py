"""The learning rate a model trains at: the policy's, or a lower one an earlier session found.

A session whose training diverges retries within its worker at ``training.diverged_lr_factor``
times the rate (``training.diverged_retries`` times). The rate that trained is remembered for
the model (``learning_rate_<model>`` in the store's meta), with the policy rate it replaced,
so later sessions start there instead of diverging again; changing ``training.learning_rate``
in the policy starts over from the new rate. ``odtctl policy check`` remembers the rate its
short run trained at the same way, before the first night.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from odtd.policy import TrainingPolicy
from odtd.store.database import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearningRate:
    """The rate a session of a model starts at, and why.

    Attributes:
        rate: The peak learning rate.
        policy_rate: ``training.learning_rate``.
        found_by: Where a lower rate was found (``session 12``, ``policy check``), None when
            ``rate`` is the policy's.
    """

    rate: float
    policy_rate: float
    found_by: Optional[str] = None

    def describe(self) -> str:
        """'0.0005 (the policy's 0.005 diverged; found by session 3)' or '0.005 (the policy's)'."""
        if self.found_by is None:
            return f"{self.rate:g} (the policy's)"
        return (f"{self.rate:g} (the policy's {self.policy_rate:g} diverged on this model; "
                f"found by {self.found_by})")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``status`` and ``policy explain`` show."""
        return {"rate": self.rate, "policy_rate": self.policy_rate, "found_by": self.found_by}


def _key(model: str) -> str:
    return f"learning_rate_{model}"


def starting_rate(store: Store, model: str, training: TrainingPolicy) -> LearningRate:
    """The rate a session of ``model`` starts at under ``training``."""
    known = store.meta(_key(model))
    if isinstance(known, dict) and known.get("policy_rate") == training.learning_rate \
            and isinstance(known.get("rate"), (int, float)) and known["rate"] < training.learning_rate:
        return LearningRate(float(known["rate"]), training.learning_rate, known.get("found_by"))
    return LearningRate(training.learning_rate, training.learning_rate)


def remember_rate(store: Store, model: str, training: TrainingPolicy, result: dict[str, Any],
                  found_by: str) -> Optional[LearningRate]:
    """Remember the rate a worker's ``result`` trained at, if it retried below the policy's.

    Returns the rate remembered, or None (no retry, or training diverged at every rate).
    """
    rate = result.get("learning_rate")
    if not result.get("lr_attempts") or result.get("status") == "diverged" or rate is None:
        return None
    if rate >= training.learning_rate:
        return None
    store.set_meta(**{_key(model): {"rate": rate, "policy_rate": training.learning_rate,
                                    "found_by": found_by}})
    logger.warning("%s: training diverged at learning rate %g; trained at %g, where later "
                   "sessions start", model, result["lr_attempts"][0]["learning_rate"], rate)
    return LearningRate(rate, training.learning_rate, found_by)
