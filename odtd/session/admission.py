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

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from odtd.policy import BatchPolicy, Policy
from odtd.profiling.memory_fit import allowed_mb
from odtd.profiling.profile import ProfileResult, plan_name, recompute_share, recompute_word
from odtd.session.oom import learned_oom_limit
from odtd.store.database import Store

RUN = "run"
SKIP = "skip"


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
        precision: The precision to run (one of ``batch.precisions`` when the policy lists
            several).
        recompute: The share of the network to run with gradient checkpointing (0: none).
        micro_batch_size: Split each batch into micro-batches of this size; None: whole.
        rejected: Every other plan considered, ``{batch_size, plan, reason}``: why it was not
            chosen (does not fit, not profiled, costs more).
    """

    batch_size: int
    epochs: int
    predicted_time_s: Optional[float]
    predicted_energy_j: Optional[float]
    predicted_peak_mb: Optional[float]
    decision: str
    reason: str
    changes: Tuple[str, ...] = ()
    precision: str = "fp32"
    recompute: float = 0.0
    micro_batch_size: Optional[int] = None
    rejected: Tuple[Dict[str, Any], ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)


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


def choose_plan(policy: Policy, profile: ProfileResult, size: int, sizes: List[int],
                samples: int, epochs: int, accumulator_mb: float = 0.0
                ) -> Tuple[Optional[Tuple[Plan, Prediction]], List[Dict[str, Any]]]:
    """The cheapest plan for a batch of ``size`` that fits the memory budget, and the rest.

    Returns:
        ((plan, prediction) or None when none fits, the rejected plans with their reasons).
    """
    fitting, rejected = [], []
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
            fitting.append((plan, p))
    if not fitting:
        return None, rejected
    cost = _cost(policy, [p for _, p in fitting])
    best = min(fitting, key=lambda pair: cost(pair[1]))  # the first of equals: the policy's own
    unit = "s" if policy.objective == "time" or best[1].energy_j is None else "J"
    for plan, p in fitting:
        if plan != best[0]:
            rejected.append({"batch_size": size, "plan": plan.name, "reason": (
                f"fits, but costs {cost(p):.3g} {unit} against {cost(best[1]):.3g} {unit} "
                f"({best[0].name}, objective {policy.objective})")})
    return best, rejected


def admit(policy: Policy, profile: Optional[ProfileResult], samples: int,
          oom_limit: Optional[int] = None, accumulator_mb: float = 0.0,
          board: Optional[str] = None) -> Admission:
    """Decide batch size, plan and epochs of a session of ``samples`` (new + replay) samples.

    The policy's batch size is kept when any plan fits it (the batch size sets how the model
    learns; a plan only sets memory and time), with the cheapest plan for the objective; else
    the largest smaller candidate that fits.

    Args:
        policy: The active policy.
        profile: The model's latest profile, or None (then only the OOM limit applies).
        samples: Samples per epoch.
        oom_limit: A batch size that ran out of memory in an earlier session (sizes at or above
            it are not tried again).
        accumulator_mb: Memory a micro-batched step adds for the summed gradients (the
            trainable weights in float32).
        board: This device as ``odtctl profile`` names it (``board_description``); a profile
            taken on another board or power mode is used, with a note in the reason.

    Returns:
        The admission; ``decision`` is ``skip`` when no batch size fits the memory budget or
        the energy budget cannot be met as ``energy.on_over_budget`` says.
    """
    batch = policy.batch
    size, epochs = batch.size, policy.training.epochs
    changes: List[str] = []
    sizes = sorted(set(batch.candidates) | {batch.size})
    if oom_limit is not None and size >= oom_limit:
        below = [s for s in sizes if s < oom_limit] or [max(1, oom_limit // 2)]
        changes.append(f"batch {size} -> {below[-1]}: batch {oom_limit} ran out of memory in an "
                       "earlier session")
        size = below[-1]
        sizes = [s for s in sizes if s < oom_limit] or [size]
    plans = plans_at(policy, size, sizes, profile)
    own = plans[0]
    if profile is None or not any(profile.ok_rows(p.precision, p.recompute) for p in plans):
        what = "no profile" if profile is None else f"plan {own.name} not profiled"
        return Admission(size, epochs, None, None, None, RUN,
                         _reason(f"{what}: memory and energy not checked (run "
                                 f"`{profile_command(own)}`)",
                                 changes), tuple(changes), own.precision, own.recompute,
                         own.micro_batch_size)
    chosen, rejected = choose_plan(policy, profile, size, sizes, samples, epochs, accumulator_mb)
    if chosen is None:
        for smaller in reversed([s for s in sizes if s < size]):
            chosen, more = choose_plan(policy, profile, smaller, sizes, samples, epochs,
                                       accumulator_mb)
            rejected += more
            if chosen is not None:
                first = next(r for r in rejected if r["batch_size"] == size)
                named = f"{first['plan']}: " if len(plans) > 1 else ""
                changes.append(f"batch {size} -> {smaller}: {named}{first['reason']}")
                size = smaller
                break
    if chosen is None:
        p = predict(profile, own.precision, size, samples, epochs, own.recompute,
                    own.micro_batch_size, accumulator_mb)
        problem = next((r["reason"] for r in rejected if r["batch_size"] == size), "")
        one = choose_plan(policy, profile, 1, sizes, samples, epochs, accumulator_mb)[0]
        if one is None and profile.ok_rows(own.precision, own.recompute):
            at_one = memory_problem(predict(profile, own.precision, 1, samples, epochs,
                                            own.recompute), batch)
            return _skip(p, f"{profile.model} does not fit the memory cap even at batch 1 "
                         f"({at_one}): it cannot train here under this policy; raise "
                         "batch.memory_budget_mb, or bring a smaller model or input size",
                         changes, rejected, own)
        return _skip(p, f"batch {size}: {problem}, and no smaller candidate fits", changes,
                     rejected, own)
    plan, prediction = chosen
    if plan != own:
        changes.append(f"plan {own.name} -> {plan.name}: " + (next(
            (r["reason"] for r in rejected if r["plan"] == own.name and r["batch_size"] == size),
            f"the cheapest for objective {policy.objective}")))
    budget_j = policy.energy.budget_j
    notes = []
    if board and profile.board and board != profile.board:
        notes.append(f"the profile was measured on {profile.board}, this device is {board} now: "
                     "its figures may not hold here; run `odtctl profile` again")
    if batch.memory_budget_mb is not None and prediction.peak_mb is None:
        notes.append("memory budget not checked: "
                     f"{profile.memory_fit(plan.precision, plan.recompute).reason}")
    if budget_j is not None and prediction.energy_j is None:
        notes.append("energy budget not checked: the profile has no energy figures")
    elif budget_j is not None and prediction.energy_j > budget_j:  # type: ignore[operator]
        over = f"predicted {prediction.energy_j:.0f} J > budget {budget_j:.0f} J"
        action = policy.energy.on_over_budget

        def at(s: int, e: int) -> Prediction:
            return predict(profile, plan.precision, s, samples, e, plan.recompute,  # type: ignore
                           plan.micro_batch_size, accumulator_mb)

        if action == "fewer_epochs":
            per_epoch_j = prediction.energy_j / epochs  # type: ignore[operator]
            affordable = int(math.floor(budget_j / per_epoch_j))
            if affordable < 1:
                return _skip(prediction, f"{over}, and one epoch needs {per_epoch_j:.0f} J",
                             changes, rejected, plan)
            changes.append(f"epochs {epochs} -> {affordable}: {over}")
            epochs = affordable
        elif action == "smaller_batch":
            affordable = [s for s in sizes if s < size and _fits(at(s, epochs), batch, budget_j)]
            if not affordable:
                return _skip(prediction, f"{over}, and no smaller candidate fits it", changes,
                             rejected, plan)
            changes.append(f"batch {size} -> {affordable[-1]}: {over}")
            size = affordable[-1]
        else:
            return _skip(prediction, f"{over} (energy.on_over_budget: skip)", changes, rejected,
                         plan)
        prediction = at(size, epochs)
    beyond = prediction.memory_extrapolated_past
    if batch.memory_budget_mb is not None and beyond is not None:
        notes.append(f"memory predicted past batch {beyond}, the largest profiled: the line is "
                     f"extrapolated there (run `{profile_command(plan)} --batch-sizes "
                     f"{plan.micro_batch_size or size}` to measure it)")
    return Admission(size, epochs, prediction.time_s, prediction.energy_j, prediction.peak_mb,
                     RUN, _reason("within budgets", changes + notes), tuple(changes),
                     plan.precision, plan.recompute, plan.micro_batch_size, tuple(rejected))


def _fits(prediction: Prediction, batch: BatchPolicy, budget_j: float) -> bool:
    return memory_problem(prediction, batch) is None and \
        prediction.energy_j is not None and prediction.energy_j <= budget_j


def _reason(base: str, changes: List[str]) -> str:
    return "; ".join(changes) if changes else base


def _skip(prediction: Prediction, why: str, changes: List[str],
          rejected: List[Dict[str, Any]], plan: Plan) -> Admission:
    return Admission(prediction.batch_size, prediction.epochs, prediction.time_s,
                     prediction.energy_j, prediction.peak_mb, SKIP, "; ".join(changes + [why]),
                     tuple(changes), plan.precision, plan.recompute, plan.micro_batch_size,
                     tuple(rejected))


def admit_session(store: Store, policy: Policy, samples: int) -> Admission:
    """``admit`` with this home's model, latest profile and learned OOM limit."""
    model = store.meta("model")
    versions = store.model_versions(model)
    # Micro-batches sum their gradients in float32: at most one copy of the weights.
    weights = versions[0]["param_count"] if versions else None
    # Imported here: sweep brings the worker's job and launch modules, which admission's pure
    # functions (and `policy explain` without a home) do not need.
    from odtd.profiling.sweep import board_description

    return admit(policy, ProfileResult.from_store(store, model), samples,
                 learned_oom_limit(store, model),
                 accumulator_mb=(weights or 0) * 4 / 2 ** 20, board=board_description())
