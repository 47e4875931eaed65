"""A policy from a profile: the batch size best for the objective under the memory budget.

``odtctl profile --write-policy FILE`` writes the active policy with that size; the profile
table and the memory fit go on top as comments.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from odtd import atomic
from odtd.errors import PolicyError
from odtd.policy import Policy, load_policy
from odtd.profiling.memory_fit import allowed_mb
from odtd.profiling.profile import ProfileResult, ProfileRow, profile_table
from odtd.store.database import utc_now

logger = logging.getLogger(__name__)


def choose_batch(profile: ProfileResult, precision: str, objective: str, eta: float,
                 budget_mb: Optional[float], headroom_pct: float) -> Tuple[int, List[str]]:
    """Pick the measured ok size best for ``objective`` among those within the memory budget.

    Sizes at or above one that did not run are never chosen (admission refuses them too).

    energy: least J/sample; time: most samples/s; balanced: least
    ``eta x J/sample + (1 - eta) x max_power_w x s/sample`` (max_power_w: the highest mean
    power among the sizes, which makes both terms joules).

    Returns:
        (batch size, explanation lines).

    Raises:
        PolicyError: No size ran, none fits the budget, or the objective needs energy figures
            the profile lacks.
    """
    rows = profile.ok_rows(precision)
    if not rows:
        raise PolicyError(f"profile {profile.profile_id} of {profile.model} has no batch size "
                          f"that ran at precision {precision}; run `odtctl profile --precisions "
                          f"{precision}`")
    fit = profile.memory_fit(precision)
    notes = [f"memory fit ({precision}): {fit.describe()}"]
    failure = profile.smallest_failure(precision)
    if failure is not None:
        # As admission does: a size that did not run rules out every larger one.
        rows = [r for r in rows if r.batch_size < failure.batch_size]
        notes.append(f"batch {failure.batch_size} did not run ({failure.reason}): larger sizes "
                     "are not chosen")
        if not rows:
            raise PolicyError(f"no batch size of {profile.model} below batch "
                              f"{failure.batch_size} ran; profile smaller sizes")
    if budget_mb is not None:
        limit_mb = allowed_mb(budget_mb, headroom_pct)
        # Measured sizes are judged by what they measured; the fit is for the sizes not run.
        rows = [r for r in rows if r.peak_memory_mb is not None and r.peak_memory_mb <= limit_mb]
        largest = fit.largest_batch(budget_mb, headroom_pct) if fit.fitted and \
            (fit.per_sample_mb or 0) > 0 else None
        notes.append(f"memory budget {budget_mb:.0f} MB less {headroom_pct:g}% headroom = "
                     f"{limit_mb:.0f} MB: measured sizes within it: "
                     f"{', '.join(str(r.batch_size) for r in rows) or 'none'}"
                     + (f"; the fit allows up to batch {largest}" if largest else ""))
        if not rows:
            raise PolicyError(f"no profiled batch size of {profile.model} fits {limit_mb:.0f} MB "
                              f"({budget_mb:.0f} MB less {headroom_pct:g}% headroom); raise "
                              "batch.memory_budget_mb or profile smaller sizes")
    else:
        notes.append("no memory budget (batch.memory_budget_mb is null): every size that ran "
                     "is allowed")
    if objective == "time":
        best = max(rows, key=lambda r: r.samples_per_s or 0.0)
        notes.append(f"objective time: batch {best.batch_size} has the highest throughput, "
                     f"{best.samples_per_s:.2f} samples/s")
        return best.batch_size, notes
    rows = [r for r in rows if r.energy_per_sample_j is not None and r.samples_per_s]
    if not rows:
        raise PolicyError(f"objective {objective} needs energy per sample, and profile "
                          f"{profile.profile_id} has none (telemetry {profile.backend}); set "
                          "telemetry.backend in odtd.yaml, or choose objective time")
    if objective == "energy":
        best = min(rows, key=lambda r: r.energy_per_sample_j)  # type: ignore[arg-type,return-value]
        notes.append(f"objective energy: batch {best.batch_size} has the least energy per "
                     f"sample, {best.energy_per_sample_j:.4f} J ({best.energy_source})")
        return best.batch_size, notes
    max_power_w = max(r.mean_power_w or 0.0 for r in rows)

    def cost_j(r: ProfileRow) -> float:
        return eta * r.energy_per_sample_j + (1 - eta) * max_power_w / r.samples_per_s  # type: ignore

    best = min(rows, key=cost_j)
    notes.append(f"objective balanced (eta {eta:g}, max power {max_power_w:.2f} W): batch "
                 f"{best.batch_size} costs {cost_j(best):.4f} J per sample")
    return best.batch_size, notes


def write_policy(path: Path, base_policy: Policy, profile: ProfileResult, objective: str,
                 memory_budget_mb: Optional[float]) -> Dict[str, Any]:
    """Write ``base_policy`` with the batch size best for ``objective`` to ``path``.

    The profile table and the memory fit go on top as comments. The file is validated with
    ``load_policy`` before it replaces ``path``.

    Args:
        path: The policy YAML to write.
        base_policy: Everything except objective, batch size and memory budget comes from it.
        profile: The profile to choose from (at ``base_policy.training.precision``).
        objective: ``energy``, ``time`` or ``balanced``.
        memory_budget_mb: Budget to write; None keeps ``base_policy``'s.

    Returns:
        ``{"path", "batch_size", "objective", "memory_budget_mb", "notes"}``.

    Raises:
        PolicyError: No size qualifies (see ``choose_batch``).
    """
    budget_mb = memory_budget_mb if memory_budget_mb is not None \
        else base_policy.batch.memory_budget_mb
    batch = base_policy.batch
    size, notes = choose_batch(profile, base_policy.training.precision, objective,
                               base_policy.objective_eta, budget_mb, batch.headroom_pct)
    data = base_policy.model_dump(mode="json")
    data["objective"] = objective
    data["batch"].update(size=size, memory_budget_mb=budget_mb,
                         candidates=sorted(set(batch.candidates) | {size}))
    header = [
        f"odtd policy written by `odtctl profile` at {utc_now()}",
        f"model {profile.model}, board {profile.board}, telemetry {profile.backend}; profile "
        f"{profile.profile_id}, {profile.steps} measured steps per size (warm-up steps skipped)",
        "", *profile_table(profile), "", *notes, "",
        "Edit freely; `odtctl policy validate FILE` checks a batch size against the profile.",
    ]
    text = "".join(f"# {line}".rstrip() + "\n" for line in header) + \
        yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    path = Path(path)
    with atomic.staged(path) as temp:  # checked before it replaces anything
        Path(temp).write_text(text, encoding="utf-8")
        load_policy(Path(temp), missing_ok=False)
    return {"path": str(path), "batch_size": size, "objective": objective,
            "memory_budget_mb": budget_mb, "notes": notes}
