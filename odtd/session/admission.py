"""Admission: before a session, predict its time, energy and peak memory and fit it to the budgets.

From the latest profile (DESIGN.md: a few profiled steps predict a whole session), at the
policy's batch size: a batch predicted over ``batch.memory_budget_mb`` less headroom is replaced
by the largest candidate that fits (never overridden, not even by ``--force``); a session
predicted over ``energy.budget_j`` gets fewer epochs, a smaller batch or is skipped, as
``energy.on_over_budget`` says. After a worker dies of memory (an ``oom`` error event or
SIGKILL), ``batch.on_oom`` decides whether to retry at half the batch, and the failed size is
remembered (meta ``oom_limit_<model>``) so later sessions start below it.

Pure except for the functions that take a ``Store``. What each plan costs is
``session.prediction``'s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from odtd.policy import BatchPolicy, Policy
from odtd.profiling.profile import ProfileResult
from odtd.session.oom import learned_oom_limit
from odtd.session.prediction import (
    Chosen,
    Plan,
    PlanChoice,
    Prediction,
    choose_plan,
    memory_problem,
    plans_at,
    predict,
    profile_command,
)
from odtd.store.database import Store

RUN = "run"
SKIP = "skip"


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


@dataclass
class _Draft:
    """An admission being worked out: the batch and epochs so far, and why they moved.

    Attributes:
        size: The batch size so far.
        epochs: The epochs so far.
        sizes: The candidate sizes (the policy's, below a learned OOM limit).
        changes: Each departure from the policy, in order.
        rejected: Every plan considered and not chosen.
        notes: What the reason adds that is not a change (a budget not checked, ...).
    """

    size: int
    epochs: int
    sizes: List[int]
    changes: List[str] = field(default_factory=list)
    rejected: List[Dict[str, Any]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def admission(self, prediction: Optional[Prediction], plan: Plan, decision: str,
                  reason: str) -> Admission:
        """The admission at ``prediction`` (None: nothing predicted) with ``plan``."""
        return Admission(
            batch_size=prediction.batch_size if prediction else self.size,
            epochs=prediction.epochs if prediction else self.epochs,
            predicted_time_s=prediction.time_s if prediction else None,
            predicted_energy_j=prediction.energy_j if prediction else None,
            predicted_peak_mb=prediction.peak_mb if prediction else None,
            decision=decision, reason=reason, changes=tuple(self.changes),
            precision=plan.precision, recompute=plan.recompute,
            micro_batch_size=plan.micro_batch_size, rejected=tuple(self.rejected))

    def skip(self, prediction: Prediction, why: str, plan: Plan) -> Admission:
        """Skip the session: the changes so far, then ``why``."""
        return self.admission(prediction, plan, SKIP, "; ".join(self.changes + [why]))


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
    draft = _start(policy, oom_limit)
    plans = plans_at(policy, draft.size, draft.sizes, profile)
    own = plans[0]
    if profile is None or not any(profile.ok_rows(p.precision, p.recompute) for p in plans):
        what = "no profile" if profile is None else f"plan {own.name} not profiled"
        return draft.admission(None, own, RUN, _reason(
            f"{what}: memory and energy not checked (run `{profile_command(own)}`)", draft.changes))
    costs = _Costs(policy, profile, samples, accumulator_mb)
    chosen = _fit_memory(costs, draft, named=len(plans) > 1)
    if chosen is None:
        return _memory_skip(costs, draft, own)
    if chosen.plan != own:
        draft.changes.append(f"plan {own.name} -> {chosen.plan.name}: " + next(
            (r["reason"] for r in draft.rejected
             if r["plan"] == own.name and r["batch_size"] == draft.size),
            f"the cheapest for objective {policy.objective}"))
    if board and profile.board and board != profile.board:
        draft.notes.append(f"the profile was measured on {profile.board}, this device is {board} "
                           "now: its figures may not hold here; run `odtctl profile` again")
    if policy.batch.memory_budget_mb is not None and chosen.prediction.peak_mb is None:
        draft.notes.append("memory budget not checked: "
                           f"{profile.memory_fit(chosen.plan.precision, chosen.plan.recompute).reason}")
    prediction, skip = _fit_energy(costs, draft, chosen)
    if skip is not None:
        return draft.skip(chosen.prediction, skip, chosen.plan)
    beyond = prediction.memory_extrapolated_past
    if policy.batch.memory_budget_mb is not None and beyond is not None:
        draft.notes.append(f"memory predicted past batch {beyond}, the largest profiled: the line "
                           f"is extrapolated there (run `{profile_command(chosen.plan)} "
                           f"--batch-sizes {chosen.plan.micro_batch_size or draft.size}` to "
                           "measure it)")
    return draft.admission(prediction, chosen.plan, RUN,
                           _reason("within budgets", draft.changes + draft.notes))


@dataclass(frozen=True)
class _Costs:
    """What every prediction of one admission shares: the policy, the profile, the session."""

    policy: Policy
    profile: ProfileResult
    samples: int
    accumulator_mb: float

    def choose(self, size: int, sizes: List[int], epochs: int) -> PlanChoice:
        """`choose_plan` at ``size``."""
        return choose_plan(self.policy, self.profile, size, sizes, self.samples, epochs,
                           self.accumulator_mb)

    def predict(self, plan: Plan, size: int, epochs: int) -> Prediction:
        """`predict` with ``plan`` at ``size`` and ``epochs``."""
        return predict(self.profile, plan.precision, size, self.samples, epochs, plan.recompute,
                       plan.micro_batch_size, self.accumulator_mb)


def _start(policy: Policy, oom_limit: Optional[int]) -> _Draft:
    """The policy's batch and epochs, the batch below a size that ran out of memory before."""
    batch = policy.batch
    draft = _Draft(batch.size, policy.training.epochs, sorted(set(batch.candidates) | {batch.size}))
    if oom_limit is not None and draft.size >= oom_limit:
        below = [s for s in draft.sizes if s < oom_limit] or [max(1, oom_limit // 2)]
        draft.changes.append(f"batch {draft.size} -> {below[-1]}: batch {oom_limit} ran out of "
                             "memory in an earlier session")
        draft.size = below[-1]
        draft.sizes = [s for s in draft.sizes if s < oom_limit] or [draft.size]
    return draft


def _fit_memory(costs: _Costs, draft: _Draft, named: bool) -> Optional[Chosen]:
    """The cheapest plan that fits at the draft's size, else at the largest smaller candidate.

    ``named``: the policy allows several plans, so a change names the one that did not fit.
    """
    choice = costs.choose(draft.size, draft.sizes, draft.epochs)
    draft.rejected += choice.rejected
    if choice.chosen is not None:
        return choice.chosen
    for smaller in reversed([s for s in draft.sizes if s < draft.size]):
        choice = costs.choose(smaller, draft.sizes, draft.epochs)
        draft.rejected += choice.rejected
        if choice.chosen is not None:
            first = next(r for r in draft.rejected if r["batch_size"] == draft.size)
            plan = f"{first['plan']}: " if named else ""
            draft.changes.append(f"batch {draft.size} -> {smaller}: {plan}{first['reason']}")
            draft.size = smaller
            return choice.chosen
    return None


def _memory_skip(costs: _Costs, draft: _Draft, own: Plan) -> Admission:
    """Skip a session no candidate batch fits, saying whether even batch 1 does not."""
    profile, size = costs.profile, draft.size
    prediction = costs.predict(own, size, draft.epochs)
    if costs.choose(1, draft.sizes, draft.epochs).chosen is None and \
            profile.ok_rows(own.precision, own.recompute):
        at_one = memory_problem(predict(profile, own.precision, 1, costs.samples, draft.epochs,
                                        own.recompute), costs.policy.batch)
        return draft.skip(prediction, f"{profile.model} does not fit the memory cap even at "
                          f"batch 1 ({at_one}): it cannot train here under this policy; raise "
                          "batch.memory_budget_mb, or bring a smaller model or input size", own)
    problem = next((r["reason"] for r in draft.rejected if r["batch_size"] == size), "")
    return draft.skip(prediction, f"batch {size}: {problem}, and no smaller candidate fits", own)


def _fit_energy(costs: _Costs, draft: _Draft, chosen: Chosen
                ) -> Tuple[Prediction, Optional[str]]:
    """Fit the session to ``energy.budget_j`` as ``energy.on_over_budget`` says.

    Returns:
        The prediction at the draft's (perhaps fewer) epochs and (perhaps smaller) batch, and
        why the session is skipped instead (None: it runs).
    """
    policy, prediction, plan = costs.policy, chosen.prediction, chosen.plan
    budget_j = policy.energy.budget_j
    if budget_j is None:
        return prediction, None
    if prediction.energy_j is None:
        draft.notes.append("energy budget not checked: the profile has no energy figures")
        return prediction, None
    if prediction.energy_j <= budget_j:
        return prediction, None
    over = f"predicted {prediction.energy_j:.0f} J > budget {budget_j:.0f} J"
    action = policy.energy.on_over_budget
    if action == "fewer_epochs":
        per_epoch_j = prediction.energy_j / draft.epochs
        affordable = int(math.floor(budget_j / per_epoch_j))
        if affordable < 1:
            return prediction, f"{over}, and one epoch needs {per_epoch_j:.0f} J"
        draft.changes.append(f"epochs {draft.epochs} -> {affordable}: {over}")
        draft.epochs = affordable
    elif action == "smaller_batch":
        fitting = [s for s in draft.sizes if s < draft.size and
                   _fits(costs.predict(plan, s, draft.epochs), policy.batch, budget_j)]
        if not fitting:
            return prediction, f"{over}, and no smaller candidate fits it"
        draft.changes.append(f"batch {draft.size} -> {fitting[-1]}: {over}")
        draft.size = fitting[-1]
    else:
        return prediction, f"{over} (energy.on_over_budget: skip)"
    return costs.predict(plan, draft.size, draft.epochs), None


def _fits(prediction: Prediction, batch: BatchPolicy, budget_j: float) -> bool:
    return memory_problem(prediction, batch) is None and \
        prediction.energy_j is not None and prediction.energy_j <= budget_j


def _reason(base: str, changes: List[str]) -> str:
    return "; ".join(changes) if changes else base


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
