"""What a session costs: each plan's predicted time, energy and peak memory, from a profile.

DESIGN.md: a few profiled steps predict a whole session. A plan (precision, gradient
checkpointing, micro-batches) changes what a step costs, never what it computes;
``choose_plan`` picks the cheapest for the policy's objective among those that fit the memory
budget, and ``admission`` decides batch size and epochs with it. Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from odtd.policy import BatchPolicy, Policy
from odtd.profiling.memory_fit import allowed_mb
from odtd.profiling.profile import ProfileResult, plan_name, recompute_share, recompute_word


@dataclass(frozen=True)
class Plan:
    """How a batch is run: precision, gradient checkpointing, micro-batches.

    None of them changes what a step computes (a micro-batched step sums the same gradients),
    only its memory and time: admission is free to pick the cheapest that fits.
    """

    precision: str
    recompute: float = 0.0
    micro_batch_size: Optional[int] = None

    @property
    def name(self) -> str:
        """``fp32``, ``fp32+recompute``, ``fp32+recompute0.5``, ``mixed_bfloat16+micro8``, ..."""
        micro = f"+micro{self.micro_batch_size}" if self.micro_batch_size else ""
        return plan_name(self.precision, self.recompute) + micro


@dataclass(frozen=True)
class Prediction:
    """A session's predicted cost at one batch size and plan (training steps only).

    Attributes:
        batch_size: Samples per step.
        epochs: Passes over the samples.
        samples: Samples per epoch (new + replay).
        time_s: Predicted training time in seconds, None without throughput data.
        energy_j: Predicted training energy in joules, None without energy data.
        peak_mb: Predicted peak worker memory in MB, None without a memory fit or measurement.
        basis: How throughput and energy were obtained (``measured``, ``interpolated``,
            ``nearest measured``, ``no data``).
        fails_at: The smallest profiled size at or below the step's size that did not fit.
        plan: The plan's name (``Plan.name``).
        memory_extrapolated_past: The largest size the plan was profiled at, when the step (a
            micro-batch, for a micro-batched plan) is larger and ``peak_mb`` is the fitted line
            extended past the profile: the CNN suite's profiles show it can miss by more there
            than between profiled sizes (docs/cnn-suite.md). None otherwise.
    """

    batch_size: int
    epochs: int
    samples: int
    time_s: Optional[float]
    energy_j: Optional[float]
    peak_mb: Optional[float]
    basis: str
    fails_at: Optional[int] = None
    plan: str = "fp32"
    memory_extrapolated_past: Optional[int] = None


def predict(profile: ProfileResult, precision: str, batch_size: int, samples: int,
            epochs: int, recompute: float = 0.0, micro_batch_size: Optional[int] = None,
            accumulator_mb: float = 0.0) -> Prediction:
    """Predict a session's training time, energy and peak memory from a profile.

    Time is ``samples x epochs / samples_per_s``; energy ``samples x epochs x J/sample``; peak
    memory the memory model at the step's size, or the measured peak where the size was
    profiled and peaked higher (the largest of its runs; the model is a fit through the runs).
    A micro-batched step runs, and is predicted, as a step of the micro-batch's size plus
    ``accumulator_mb`` for the summed gradients. Start-up and the before/after evaluations are
    not included.
    """
    step = micro_batch_size if micro_batch_size and micro_batch_size < batch_size else batch_size
    samples_per_s, joules_per_sample, basis = profile.estimate_at(step, precision, recompute)
    total = samples * epochs
    fit = profile.memory_fit(precision, recompute)
    rows = profile.ok_rows(precision, recompute)
    largest = max((r.batch_size for r in rows), default=0)
    # The model at the step's size, and the measured peak where the size was profiled.
    peaks = [r.peak_memory_mb for r in rows if r.batch_size == step and r.peak_memory_mb]
    if fit.fitted:
        peaks.append(fit.predict_mb(step))
    peak_mb = max(peaks) if peaks else None
    if peak_mb is not None and step < batch_size:
        peak_mb += accumulator_mb
    failure = profile.smallest_failure(precision, recompute)
    return Prediction(
        batch_size, epochs, samples,
        time_s=round(total / samples_per_s, 2) if samples_per_s else None,
        energy_j=round(total * joules_per_sample, 3) if joules_per_sample is not None else None,
        peak_mb=None if peak_mb is None else round(peak_mb, 1), basis=basis,
        fails_at=failure.batch_size if failure and failure.batch_size <= step else None,
        plan=Plan(precision, recompute, step if step < batch_size else None).name,
        memory_extrapolated_past=largest if fit.fitted and step > largest else None,
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


def profile_command(plan: Plan) -> str:
    """The ``odtctl profile`` command that measures ``plan``."""
    return f"odtctl profile --precisions {plan.precision}" + (
        f" --recompute {recompute_word(plan.recompute)}" if plan.recompute else "")


def recompute_shares(policy: Policy, profile: Optional[ProfileResult]) -> List[float]:
    """The recomputed shares admission may run.

    The policy's share; for ``auto``, none and every share the profile measured (none and the
    whole network when it measured none).
    """
    value = policy.training.recompute
    if value == "auto":
        measured = sorted({r.recompute for r in profile.rows if r.recompute}) if profile else []
        return [0.0] + (measured or [1.0])
    return [recompute_share(value)]


def plans_at(policy: Policy, size: int, sizes: List[int],
             profile: Optional[ProfileResult] = None) -> List[Plan]:
    """The plans admission may run a batch of ``size`` with, the policy's own plan first."""
    training = policy.training
    precisions = list(dict.fromkeys([training.precision, *(policy.batch.precisions or [])]))
    if policy.batch.precisions:
        precisions = [p for p in precisions if p in policy.batch.precisions]
    recomputes = recompute_shares(policy, profile)
    micro = training.micro_batch_size
    if micro == "off":
        micros: List[Optional[int]] = [None]
    elif micro == "auto":
        micros = [None] + ([s for s in reversed(sizes) if s < size] if training.freeze_bn else [])
    else:
        micros = [micro if micro < size else None]
    return [Plan(p, r, m) for p in precisions for r in recomputes for m in micros]


def _cost(policy: Policy, predictions: List[Prediction]) -> Callable[[Prediction], float]:
    """The objective as a cost: time in s, energy in J, or balanced (both in joules)."""
    energies = [p.energy_j for p in predictions]
    if policy.objective == "time" or None in energies:
        return lambda p: p.time_s if p.time_s is not None else math.inf
    if policy.objective == "energy":
        return lambda p: p.energy_j  # type: ignore[return-value]
    max_power_w = max((p.energy_j / p.time_s for p in predictions  # type: ignore[operator]
                       if p.time_s), default=0.0)
    eta = policy.objective_eta
    return lambda p: eta * p.energy_j + (1 - eta) * max_power_w * (p.time_s or math.inf)


@dataclass(frozen=True)
class Chosen:
    """A plan that fits, and its prediction."""

    plan: Plan
    prediction: Prediction


@dataclass(frozen=True)
class PlanChoice:
    """The plans for one batch size: the cheapest that fits (None when none does) and the rest.

    Attributes:
        chosen: The cheapest plan for the objective among those that fit the memory budget.
        rejected: Every other plan, ``{batch_size, plan, reason}``: why it was not chosen.
    """

    chosen: Optional[Chosen]
    rejected: List[Dict[str, Any]]


def choose_plan(policy: Policy, profile: ProfileResult, size: int, sizes: List[int],
                samples: int, epochs: int, accumulator_mb: float = 0.0) -> PlanChoice:
    """The cheapest plan for a batch of ``size`` that fits the memory budget, and the rest."""
    fitting: List[Chosen] = []
    rejected: List[Dict[str, Any]] = []
    for plan in plans_at(policy, size, sizes, profile):
        if not profile.ok_rows(plan.precision, plan.recompute):
            rejected.append({"batch_size": size, "plan": plan.name,
                             "reason": f"not profiled: run `{profile_command(plan)}`"})
            continue
        p = predict(profile, plan.precision, size, samples, epochs, plan.recompute,
                    plan.micro_batch_size, accumulator_mb)
        problem = memory_problem(p, policy.batch)
        if problem:
            rejected.append({"batch_size": size, "plan": plan.name, "reason": problem})
        else:
            fitting.append(Chosen(plan, p))
    if not fitting:
        return PlanChoice(None, rejected)
    cost = _cost(policy, [c.prediction for c in fitting])
    best = min(fitting, key=lambda c: cost(c.prediction))  # the first of equals: the policy's own
    unit = "s" if policy.objective == "time" or best.prediction.energy_j is None else "J"
    for other in fitting:
        if other.plan != best.plan:
            rejected.append({"batch_size": size, "plan": other.plan.name, "reason": (
                f"fits, but costs {cost(other.prediction):.3g} {unit} against "
                f"{cost(best.prediction):.3g} {unit} ({best.plan.name}, objective "
                f"{policy.objective})")})
    return PlanChoice(best, rejected)


