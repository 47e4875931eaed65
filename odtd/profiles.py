"""Profiles of a model: measured rows, the memory fit, estimates between sizes, a policy from them.

Data and decisions only: running the workers is ``odtd.profiling``. Admission, ``odtctl policy
explain`` and ``validate`` read profiles through :meth:`ProfileResult.from_store`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from odtd.errors import PolicyError
from odtd.memory_model import MemoryFit, allowed_mb, fit_memory
from odtd.policy import Policy, load_policy
from odtd.store import Store, utc_now

logger = logging.getLogger(__name__)

OK = "ok"
DOES_NOT_FIT = "does_not_fit"


@dataclass(frozen=True)
class ProfileRow:
    """One measured (precision, batch size); figures skip the warm-up steps.

    Attributes:
        batch_size: Samples per step.
        precision: As requested (``auto`` stays ``auto``: it is what a policy names).
        status: ``ok``, or ``does_not_fit`` (OOM error, killed, crashed; see ``reason``).
        reason: Why the size does not fit, None when ok.
        precision_resolved: What the worker ran (``auto`` -> ``mixed_bfloat16`` on this CPU).
        samples_per_s: Throughput over the measured steps.
        step_s: Mean duration of a measured step in seconds.
        energy_per_sample_j: Board total joules per sample, None without telemetry.
        energy_per_sample_by_rail_j: Joules per sample per rail (sub-rails are parts of the total).
        energy_source: Telemetry source label (``ina3221``, ``estimate``, ...), or None.
        energy_coverage: Covered fraction of the measured span, 0..1.
        mean_power_w: Mean board power over the measured span in watts.
        peak_memory_mb: The worker's peak RSS in MB (None when it died before reporting).
        profile_id: The run that measured this row (set once stored).
    """

    batch_size: int
    precision: str
    status: str
    reason: Optional[str] = None
    precision_resolved: Optional[str] = None
    samples_per_s: Optional[float] = None
    step_s: Optional[float] = None
    energy_per_sample_j: Optional[float] = None
    energy_per_sample_by_rail_j: Optional[Dict[str, float]] = None
    energy_source: Optional[str] = None
    energy_coverage: Optional[float] = None
    mean_power_w: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    profile_id: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class ProfileResult:
    """A profile of one model: its rows and where they were measured."""

    profile_id: Optional[int]
    model: str
    backend: Optional[str]
    board: str
    steps: int
    rows: Tuple[ProfileRow, ...]

    @classmethod
    def from_store(cls, store: Store, model: str) -> Optional[ProfileResult]:
        """Return the latest profile of ``model`` (``Store.latest_profile``), or None."""
        records = store.latest_profile(model)
        if not records:
            return None
        fields = set(ProfileRow.__dataclass_fields__)
        rows = tuple(ProfileRow(**{k: v for k, v in r.items() if k in fields}) for r in records)
        newest = max(records, key=lambda r: r["profile_id"])
        return cls(newest["profile_id"], model, newest["backend"], newest["board"],
                   newest["steps"], rows)

    def ok_rows(self, precision: str) -> List[ProfileRow]:
        """Rows that ran at ``precision``, by batch size."""
        return sorted((r for r in self.rows if r.precision == precision and r.status == OK),
                      key=lambda r: r.batch_size)

    def smallest_failure(self, precision: str) -> Optional[ProfileRow]:
        """The smallest size that did not fit at ``precision`` (larger ones will not either)."""
        failed = [r for r in self.rows if r.precision == precision and r.status == DOES_NOT_FIT]
        return min(failed, key=lambda r: r.batch_size) if failed else None

    def memory_fit(self, precision: str) -> MemoryFit:
        """Fit peak memory against batch size over the ok rows at ``precision``."""
        return fit_memory((r.batch_size, r.peak_memory_mb) for r in self.ok_rows(precision)
                          if r.peak_memory_mb is not None)

    def estimate_at(self, batch_size: int, precision: str
                    ) -> Tuple[Optional[float], Optional[float], str]:
        """Throughput and energy per sample at any size, from the measured ones.

        Between measured sizes both are interpolated linearly in log2(batch size); outside
        them the nearest measured size stands in (throughput flattens out at large batches).

        Returns:
            (samples/s, J/sample or None, basis: ``measured``, ``interpolated``,
            ``nearest measured`` or ``no data``).
        """
        rows = self.ok_rows(precision)
        if not rows:
            return None, None, "no data"
        for row in rows:
            if row.batch_size == batch_size:
                return row.samples_per_s, row.energy_per_sample_j, "measured"
        if batch_size < rows[0].batch_size or batch_size > rows[-1].batch_size:
            near = rows[0] if batch_size < rows[0].batch_size else rows[-1]
            return near.samples_per_s, near.energy_per_sample_j, "nearest measured"
        upper = next(i for i, r in enumerate(rows) if r.batch_size > batch_size)
        low, high = rows[upper - 1], rows[upper]
        share = (math.log2(batch_size) - math.log2(low.batch_size)) / \
            (math.log2(high.batch_size) - math.log2(low.batch_size))

        def mix(a: Optional[float], b: Optional[float]) -> Optional[float]:
            return None if a is None or b is None else a + (b - a) * share

        return mix(low.samples_per_s, high.samples_per_s), \
            mix(low.energy_per_sample_j, high.energy_per_sample_j), "interpolated"

    def to_dict(self) -> Dict[str, Any]:
        """Return the ``odtctl profile --json`` object."""
        precisions = sorted({r.precision for r in self.rows})
        return {"profile_id": self.profile_id, "model": self.model, "backend": self.backend,
                "board": self.board, "steps": self.steps,
                "rows": [r.to_dict() for r in self.rows],
                "memory_model": {p: self.memory_fit(p).to_dict() for p in precisions}}


def profile_table(profile: ProfileResult) -> List[str]:
    """The profile as text lines (``odtctl profile`` and a written policy's comments)."""
    lines = [f"{'batch':>5} {'precision':<22} {'status':<12} {'samples/s':>9} {'step s':>8} "
             f"{'J/sample':>9} {'peak MB':>8}"]
    for r in sorted(profile.rows, key=lambda r: (r.precision, r.batch_size)):
        shown = r.precision if r.precision_resolved in (None, r.precision) \
            else f"{r.precision}->{r.precision_resolved}"

        def num(value: Optional[float], fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        lines.append(f"{r.batch_size:>5} {shown:<22} {r.status:<12} "
                     f"{num(r.samples_per_s, '>9.2f')} {num(r.step_s, '>8.3f')} "
                     f"{num(r.energy_per_sample_j, '>9.4f')} {num(r.peak_memory_mb, '>8.0f')}"
                     + (f"  {r.reason}" if r.reason else ""))
    return lines



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
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(text, encoding="utf-8")
    try:
        load_policy(temp, missing_ok=False)
    except PolicyError:
        temp.unlink()
        raise
    os.replace(temp, path)
    return {"path": str(path), "batch_size": size, "objective": objective,
            "memory_budget_mb": budget_mb, "notes": notes}
