"""Admission: before a session, predict its time, energy and peak memory and fit it to the budgets.

From the latest profile (DESIGN.md: a few profiled steps predict a whole session), at the
policy's batch size: a batch predicted over ``batch.memory_budget_mb`` less headroom is replaced
by the largest candidate that fits (never overridden, not even by ``--force``); a session
predicted over ``energy.budget_j`` gets fewer epochs, a smaller batch or is skipped, as
``energy.on_over_budget`` says. After a worker dies of memory (an ``oom`` error event or
SIGKILL), ``batch.on_oom`` decides whether to retry at half the batch, and the failed size is
remembered (meta ``oom_limit_<model>``) so later sessions start below it.

Pure except for the functions that take a ``Store``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

from odtd.policy import BatchPolicy, Policy
from odtd.profiling.memory_fit import allowed_mb
from odtd.profiling.profile import ProfileResult
from odtd.store.database import Store

logger = logging.getLogger(__name__)

RUN = "run"
SKIP = "skip"


@dataclass(frozen=True)
class Prediction:
    """A session's predicted cost at one batch size (training steps only).

    Attributes:
        batch_size: Samples per step.
        epochs: Passes over the samples.
        samples: Samples per epoch (new + replay).
        time_s: Predicted training time in seconds, None without throughput data.
        energy_j: Predicted training energy in joules, None without energy data.
        peak_mb: Predicted peak worker memory in MB, None without a memory fit or measurement.
        basis: How throughput and energy were obtained (``measured``, ``interpolated``,
            ``nearest measured``, ``no data``).
        fails_at: The smallest profiled size at or below ``batch_size`` that did not fit, if any.
    """

    batch_size: int
    epochs: int
    samples: int
    time_s: Optional[float]
    energy_j: Optional[float]
    peak_mb: Optional[float]
    basis: str
    fails_at: Optional[int] = None


@dataclass(frozen=True)
class Admission:
    """What a session will run with, or why it will not run.

    Attributes:
        batch_size: The batch size to run (may differ from the policy's; see ``changes``).
        epochs: The epochs to run.
        predicted_time_s: Training time in seconds at that size, None without a profile.
        predicted_energy_j: Training energy in joules, None without energy figures.
        predicted_peak_mb: Peak worker memory in MB, None without a memory fit.
        decision: ``run`` or ``skip``.
        reason: One line for the sessions row and the log.
        changes: Each departure from the policy, in order, e.g. ``batch 64 -> 32: ...``.
    """

    batch_size: int
    epochs: int
    predicted_time_s: Optional[float]
    predicted_energy_j: Optional[float]
    predicted_peak_mb: Optional[float]
    decision: str
    reason: str
    changes: Tuple[str, ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)


def predict(profile: ProfileResult, precision: str, batch_size: int, samples: int,
            epochs: int) -> Prediction:
    """Predict a session's training time, energy and peak memory from a profile.

    Time is ``samples x epochs / samples_per_s``; energy ``samples x epochs x J/sample``; peak
    memory the fitted line at ``batch_size`` (the measured peak when the size was profiled but
    no line can be fitted). Start-up and the before/after evaluations are not included.
    """
    samples_per_s, joules_per_sample, basis = profile.estimate_at(batch_size, precision)
    total = samples * epochs
    fit = profile.memory_fit(precision)
    measured = [r.peak_memory_mb for r in profile.ok_rows(precision) if r.batch_size == batch_size]
    if fit.fitted:
        peak_mb: Optional[float] = fit.predict_mb(batch_size)
    else:
        peak_mb = measured[0] if measured else None
    failure = profile.smallest_failure(precision)
    return Prediction(
        batch_size, epochs, samples,
        time_s=round(total / samples_per_s, 2) if samples_per_s else None,
        energy_j=round(total * joules_per_sample, 3) if joules_per_sample is not None else None,
        peak_mb=None if peak_mb is None else round(peak_mb, 1), basis=basis,
        fails_at=failure.batch_size if failure and failure.batch_size <= batch_size else None,
    )


def memory_problem(prediction: Prediction, batch: BatchPolicy) -> Optional[str]:
    """Say why a predicted batch does not fit the memory budget; None when it fits or unknown."""
    if prediction.fails_at is not None:
        return f"batch {prediction.fails_at} did not run in the profile"
    if batch.memory_budget_mb is None or prediction.peak_mb is None:
        return None
    limit_mb = allowed_mb(batch.memory_budget_mb, batch.headroom_pct)
    if prediction.peak_mb <= limit_mb:
        return None
    return (f"predicted peak {prediction.peak_mb:.0f} MB > {limit_mb:.0f} MB "
            f"({batch.memory_budget_mb:.0f} MB budget less {batch.headroom_pct:g}% headroom)")


def admit(policy: Policy, profile: Optional[ProfileResult], samples: int,
          oom_limit: Optional[int] = None) -> Admission:
    """Decide batch size and epochs of a session of ``samples`` (new + replay) samples.

    Args:
        policy: The active policy.
        profile: The model's latest profile, or None (then only the OOM limit applies).
        samples: Samples per epoch.
        oom_limit: A batch size that ran out of memory in an earlier session (sizes at or above
            it are not tried again).

    Returns:
        The admission; ``decision`` is ``skip`` when no batch size fits the memory budget or
        the energy budget cannot be met as ``energy.on_over_budget`` says.
    """
    batch, precision = policy.batch, policy.training.precision
    size, epochs = batch.size, policy.training.epochs
    changes: List[str] = []
    sizes = sorted(set(batch.candidates) | {batch.size})
    if oom_limit is not None and size >= oom_limit:
        below = [s for s in sizes if s < oom_limit] or [max(1, oom_limit // 2)]
        changes.append(f"batch {size} -> {below[-1]}: batch {oom_limit} ran out of memory in an "
                       "earlier session")
        size = below[-1]
        sizes = [s for s in sizes if s < oom_limit] or [size]
    if profile is None or not profile.ok_rows(precision):
        what = "no profile" if profile is None else f"no profiled size at precision {precision}"
        return Admission(size, epochs, None, None, None, RUN,
                         _reason(f"{what}: memory and energy not checked (run `odtctl profile`)",
                                 changes), tuple(changes))
    prediction = predict(profile, precision, size, samples, epochs)
    problem = memory_problem(prediction, batch)
    if problem:
        fitting = [s for s in sizes if s < size and memory_problem(
            predict(profile, precision, s, samples, epochs), batch) is None]
        if not fitting:
            at_one = memory_problem(predict(profile, precision, 1, samples, epochs), batch)
            if at_one is not None:
                return _skip(prediction, f"{profile.model} does not fit the memory cap even at "
                             f"batch 1 ({at_one}): it cannot train here under this policy; raise "
                             "batch.memory_budget_mb, or bring a smaller model or input size",
                             changes)
            return _skip(prediction, f"batch {size}: {problem}, and no smaller candidate fits",
                         changes)
        changes.append(f"batch {size} -> {fitting[-1]}: {problem}")
        size = fitting[-1]
        prediction = predict(profile, precision, size, samples, epochs)
    budget_j = policy.energy.budget_j
    notes = []
    if batch.memory_budget_mb is not None and prediction.peak_mb is None:
        notes.append(f"memory budget not checked: {profile.memory_fit(precision).reason}")
    if budget_j is not None and prediction.energy_j is None:
        notes.append("energy budget not checked: the profile has no energy figures")
    elif budget_j is not None and prediction.energy_j > budget_j:  # type: ignore[operator]
        over = f"predicted {prediction.energy_j:.0f} J > budget {budget_j:.0f} J"
        action = policy.energy.on_over_budget
        if action == "fewer_epochs":
            per_epoch_j = prediction.energy_j / epochs  # type: ignore[operator]
            affordable = int(math.floor(budget_j / per_epoch_j))
            if affordable < 1:
                return _skip(prediction, f"{over}, and one epoch needs {per_epoch_j:.0f} J",
                             changes)
            changes.append(f"epochs {epochs} -> {affordable}: {over}")
            epochs = affordable
        elif action == "smaller_batch":
            affordable = [s for s in sizes if s < size and _fits(
                predict(profile, precision, s, samples, epochs), batch, budget_j)]
            if not affordable:
                return _skip(prediction, f"{over}, and no smaller candidate fits it", changes)
            changes.append(f"batch {size} -> {affordable[-1]}: {over}")
            size = affordable[-1]
        else:
            return _skip(prediction, f"{over} (energy.on_over_budget: skip)", changes)
        prediction = predict(profile, precision, size, samples, epochs)
    return Admission(size, epochs, prediction.time_s, prediction.energy_j, prediction.peak_mb,
                     RUN, _reason("within budgets", changes + notes), tuple(changes))


def _fits(prediction: Prediction, batch: BatchPolicy, budget_j: float) -> bool:
    return memory_problem(prediction, batch) is None and \
        prediction.energy_j is not None and prediction.energy_j <= budget_j


def _reason(base: str, changes: List[str]) -> str:
    return "; ".join(changes) if changes else base


def _skip(prediction: Prediction, why: str, changes: List[str]) -> Admission:
    return Admission(prediction.batch_size, prediction.epochs, prediction.time_s,
                     prediction.energy_j, prediction.peak_mb, SKIP, "; ".join(changes + [why]),
                     tuple(changes))


def admit_session(store: Store, policy: Policy, samples: int) -> Admission:
    """``admit`` with this home's model, latest profile and learned OOM limit."""
    model = store.meta("model")
    return admit(policy, ProfileResult.from_store(store, model), samples,
                 learned_oom_limit(store, model))


# -- running out of memory during a session ----------------------------------------------------


def learned_oom_limit(store: Store, model: str) -> Optional[int]:
    """The smallest batch size that ran out of memory in a session of ``model``, or None."""
    return store.meta(f"oom_limit_{model}")


def record_oom(store: Store, model: str, batch_size: int) -> int:
    """Remember that ``batch_size`` ran out of memory; return the (possibly lower) limit."""
    known = learned_oom_limit(store, model)
    limit = batch_size if known is None else min(known, batch_size)
    store.set_meta(**{f"oom_limit_{model}": limit})
    logger.warning("%s: batch %d ran out of memory; later sessions stay below batch %d",
                   model, batch_size, limit)
    return limit


def oom_retry_batch(batch: BatchPolicy, failed_batch_size: int) -> Optional[int]:
    """The batch size to retry at after an OOM at ``failed_batch_size``, or None to stop.

    ``on_oom: halve`` retries at half (at least 1; a failure at batch 1 stops); ``skip`` stops.
    """
    if batch.on_oom == "halve" and failed_batch_size > 1:
        return failed_batch_size // 2
    return None
