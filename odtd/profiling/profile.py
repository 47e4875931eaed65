"""Profiles of a model: measured rows, the memory fit, estimates between sizes, a policy from them.

Data and decisions only: running the workers is ``odtd.profiling.sweep``. Admission, ``odtctl policy
explain`` and ``validate`` read profiles through :meth:`ProfileResult.from_store`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

from odtd.profiling.memory_fit import MemoryFit, fit_memory
from odtd.store.database import Store
from odtd.table import table

logger = logging.getLogger(__name__)

OK = "ok"
DOES_NOT_FIT = "does_not_fit"


@dataclass(frozen=True)
class ProfileRow:
    """One measured (precision, recompute, batch size); figures skip the warm-up steps.

    Attributes:
        batch_size: Samples per step.
        precision: As requested (``auto`` stays ``auto``: it is what a policy names).
        recompute: The share of the network measured under gradient checkpointing (0: none,
            1: every segment but the last; ``training.recompute``).
        status: ``ok``, or ``does_not_fit`` (OOM error, killed, crashed; see ``reason``).
        reason: Why the size does not fit, None when ok.
        precision_resolved: What the worker ran (``auto`` -> ``mixed_bfloat16`` or ``fp32`` on a CPU).
        samples_per_s: Throughput over the measured steps.
        step_s: Mean duration of a measured step in seconds.
        energy_per_sample_j: Board total joules per sample, None without telemetry.
        energy_per_sample_by_rail_j: Joules per sample per rail (sub-rails are parts of the total).
        energy_source: Telemetry source label (``ina3221``, ``estimate``, ...), or None.
        energy_coverage: Covered fraction of the measured span, 0..1.
        mean_power_w: Mean board power over the measured span in watts.
        peak_memory_mb: The worker's peak RSS in MB (None when it died before reporting); the
            largest of the runs' when the size ran more than once.
        peak_memory_runs_mb: Each run's peak RSS in MB when the size ran more than once
            (``odtctl profile --repeats``; the other figures are then the runs' means), else None.
        profile_id: The run that measured this row (set once stored).
    """

    batch_size: int
    precision: str
    status: str
    recompute: float = 0.0
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
    peak_memory_runs_mb: Optional[List[float]] = None
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

    def ok_rows(self, precision: str, recompute: float = 0.0) -> List[ProfileRow]:
        """Rows that ran at ``precision`` and ``recompute`` share, by batch size."""
        return sorted((r for r in self.rows if r.precision == precision and r.status == OK
                       and r.recompute == recompute), key=lambda r: r.batch_size)

    def smallest_failure(self, precision: str, recompute: float = 0.0) -> Optional[ProfileRow]:
        """The smallest size that did not fit at ``precision`` (larger ones will not either)."""
        failed = [r for r in self.rows if r.precision == precision and r.status == DOES_NOT_FIT
                  and r.recompute == recompute]
        return min(failed, key=lambda r: r.batch_size) if failed else None

    def memory_fit(self, precision: str, recompute: float = 0.0) -> MemoryFit:
        """Fit peak memory against batch size over the ok rows at ``precision``.

        A size that ran more than once contributes each run's peak.
        """
        return fit_memory((r.batch_size, peak) for r in self.ok_rows(precision, recompute)
                          for peak in (r.peak_memory_runs_mb or [r.peak_memory_mb])
                          if peak is not None)

    def plans(self) -> List[Tuple[str, float]]:
        """The (precision, recompute share) pairs this profile measured."""
        return sorted({(r.precision, r.recompute) for r in self.rows})

    def estimate_at(self, batch_size: int, precision: str, recompute: float = 0.0
                    ) -> Tuple[Optional[float], Optional[float], str]:
        """Throughput and energy per sample at any size, from the measured ones.

        Between measured sizes both are interpolated linearly in log2(batch size); outside
        them the nearest measured size stands in (throughput flattens out at large batches).

        Returns:
            (samples/s, J/sample or None, basis: ``measured``, ``interpolated``,
            ``nearest measured`` or ``no data``).
        """
        rows = self.ok_rows(precision, recompute)
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
        return {"profile_id": self.profile_id, "model": self.model, "backend": self.backend,
                "board": self.board, "steps": self.steps,
                "rows": [r.to_dict() for r in self.rows],
                "memory_model": {plan_name(p, r): self.memory_fit(p, r).to_dict()
                                 for p, r in self.plans()}}


def recompute_share(value: Any) -> float:
    """A policy's or ``--recompute``'s value as the share recomputed: off 0, on 1, a share itself.

    Raises:
        ValueError: Neither off, on nor a number from 0 to 1.
    """
    share = {"off": 0.0, "on": 1.0}[value] if value in ("off", "on") else float(value)
    if not 0 <= share <= 1:
        raise ValueError(f"recompute {value!r} is not off, on or a share from 0 to 1")
    return share


def recompute_word(share: float) -> str:
    """The inverse of :func:`recompute_share`: ``off``, ``on`` or the share (``0.35``)."""
    return "off" if not share else "on" if share >= 1 else format(share, "g")


def plan_name(precision: str, recompute: float) -> str:
    """A plan as profiles and admission name it.

    ``fp32``, ``fp32+recompute`` (every segment but the last recomputed) or
    ``fp32+recompute0.5`` (the first half of the network).
    """
    if not recompute:
        return precision
    word = recompute_word(recompute)
    return f"{precision}+recompute" + ("" if word == "on" else word)


def parse_plan(name: str) -> Tuple[str, float, Optional[int]]:
    """``fp32+recompute0.5+micro8`` -> (precision, recompute share, micro-batch size or None).

    Raises:
        ValueError: A part that is not ``recompute``, ``recomputeS`` (0 < S <= 1) or ``microN``.
    """
    precision, *parts = name.split("+")
    recompute, micro = 0.0, None  # type: float, Optional[int]
    for part in parts:
        try:
            if part.startswith("recompute"):
                recompute = float(part[len("recompute"):] or 1)
                if not 0 < recompute <= 1:
                    raise ValueError
            elif part.startswith("micro"):
                micro = int(part[len("micro"):])
                if micro < 1:
                    raise ValueError
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"unknown part {part!r} of plan {name!r}; plans look like fp32, "
                             "fp32+recompute, fp32+recompute0.5, fp32+micro8, "
                             "fp32+recompute+micro16") from None
    return precision, recompute, micro


def profile_table(profile: ProfileResult) -> List[str]:
    """The profile as text lines (``odtctl profile`` and a written policy's comments)."""
    def num(value: Optional[float], fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    rows = []
    for r in sorted(profile.rows, key=lambda r: (r.precision, r.recompute, r.batch_size)):
        shown = r.precision if r.precision_resolved in (None, r.precision) \
            else f"{r.precision}->{r.precision_resolved}"
        rows.append((r.batch_size, plan_name(shown, r.recompute), r.status,
                     num(r.samples_per_s, ".2f"), num(r.step_s, ".3f"),
                     num(r.energy_per_sample_j, ".4f"), num(r.peak_memory_mb, ".0f"),
                     "  ".join(part for part in (r.reason, _runs(r.peak_memory_runs_mb).strip())
                               if part)))
    return table(rows, ("batch", "precision", "status", "samples/s", "step s", "J/sample",
                        "peak MB"), align="><<>>>>")


def _runs(peaks: Optional[List[float]]) -> str:
    """`` (3 runs: 1,544-1,739 MB)`` beside a peak measured more than once, else nothing."""
    if not peaks or len(peaks) < 2:
        return ""
    return f"  ({len(peaks)} runs: {min(peaks):,.0f}-{max(peaks):,.0f} MB)"
