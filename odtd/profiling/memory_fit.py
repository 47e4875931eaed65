"""Peak memory as a function of batch size: ``peak_mb = fixed_mb + per_sample_mb x batch``.

Parameters, gradients, optimizer state and the framework itself are constant; feature maps and
workspace grow with the batch (DESIGN.md). A least-squares line through the measured peaks of a
profile predicts sizes that were not run, which is how a policy can refuse a batch size before a
session dies for it. Pure arithmetic: no TensorFlow, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

from odtd.errors import PolicyError

LEAVE_ONE_OUT = "leave-one-out"
IN_SAMPLE = "in-sample"


def _least_squares(points: Sequence[Tuple[int, float]]) -> Tuple[float, float]:
    """Return (intercept, slope) of the least-squares line through (x, y) points."""
    count = len(points)
    mean_x = sum(x for x, _ in points) / count
    mean_y = sum(y for _, y in points) / count
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, slope


@dataclass(frozen=True)
class MemoryFit:
    """A fitted (or unfittable) memory line.

    Attributes:
        points: (batch size, measured peak MB) pairs the fit used, by batch size.
        fixed_mb: Intercept in MB, or None when no line could be fitted.
        per_sample_mb: Slope in MB per sample of batch, or None.
        residual_rms_mb: Root mean square of the in-sample residuals in MB (0 for two points).
        errors_pct: Batch size -> signed prediction error in percent of the measured peak.
        error_method: ``leave-one-out`` (three or more sizes: each size predicted by the line
            through the others) or ``in-sample`` (two sizes), None without a fit.
        reason: Why there is no fit, None when there is one.
    """

    points: Tuple[Tuple[int, float], ...]
    fixed_mb: Optional[float] = None
    per_sample_mb: Optional[float] = None
    residual_rms_mb: Optional[float] = None
    errors_pct: Dict[int, float] = field(default_factory=dict)
    error_method: Optional[str] = None
    reason: Optional[str] = None

    @property
    def fitted(self) -> bool:
        """Whether a line was fitted."""
        return self.fixed_mb is not None and self.per_sample_mb is not None

    def predict_mb(self, batch_size: int) -> float:
        """Return the predicted peak memory in MB at ``batch_size``.

        Raises:
            PolicyError: There is no fit (fewer than two profiled sizes); the message says why.
        """
        if not self.fitted:
            raise PolicyError(f"cannot predict memory at batch {batch_size}: {self.reason}")
        return self.fixed_mb + self.per_sample_mb * batch_size  # type: ignore[operator]

    def largest_batch(self, budget_mb: float, headroom_pct: float,
                      candidates: Optional[Iterable[int]] = None) -> Optional[int]:
        """Return the largest batch whose predicted peak stays under the budget less headroom.

        Args:
            budget_mb: Memory budget in MB.
            headroom_pct: Percent of the budget kept free for prediction error.
            candidates: Sizes to choose from; None means any size >= 1.

        Returns:
            The largest fitting size, or None when none fits.

        Raises:
            PolicyError: No fit, or a fit without positive per-sample memory and no candidates
                (the answer would be unbounded).
        """
        limit_mb = allowed_mb(budget_mb, headroom_pct)
        if candidates is not None:
            fitting = [size for size in candidates if self.predict_mb(size) <= limit_mb]
            return max(fitting) if fitting else None
        if not self.fitted:
            raise PolicyError(f"cannot size a batch for {budget_mb:.0f} MB: {self.reason}")
        if self.per_sample_mb <= 0:  # type: ignore[operator]
            raise PolicyError(
                f"the memory fit has no positive per-sample memory ({self.per_sample_mb:.3f} MB); "
                "profile sizes further apart, or give candidate sizes")
        size = math.floor((limit_mb - self.fixed_mb) / self.per_sample_mb)  # type: ignore[operator]
        return size if size >= 1 else None

    def describe(self) -> str:
        """One line for people: the line, its residual and its prediction errors."""
        if not self.fitted:
            return f"no memory fit: {self.reason}"
        errors = ", ".join(f"batch {size} {error:+.1f}%" for size, error in
                           sorted(self.errors_pct.items()))
        return (f"peak_mb = {self.fixed_mb:.1f} + {self.per_sample_mb:.2f} x batch "
                f"(residual RMS {self.residual_rms_mb:.1f} MB over {len(self.points)} sizes; "
                f"{self.error_method} error: {errors})")

    def to_dict(self) -> Dict[str, Any]:
        """Return a JSON-ready dict (batch-size keys become strings in JSON)."""
        return {
            "fixed_mb": _round(self.fixed_mb), "per_sample_mb": _round(self.per_sample_mb, 3),
            "residual_rms_mb": _round(self.residual_rms_mb),
            "points": [[size, round(peak, 1)] for size, peak in self.points],
            "errors_pct": {str(size): round(error, 2) for size, error in self.errors_pct.items()},
            "error_method": self.error_method, "reason": self.reason,
        }


def _round(value: Optional[float], digits: int = 1) -> Optional[float]:
    return None if value is None else round(value, digits)


def allowed_mb(budget_mb: float, headroom_pct: float) -> float:
    """Return the memory a batch may use: the budget less its headroom, in MB."""
    return budget_mb * (1.0 - headroom_pct / 100.0)


def fit_memory(points: Iterable[Tuple[int, float]]) -> MemoryFit:
    """Fit ``peak_mb = fixed_mb + per_sample_mb x batch`` by least squares.

    Args:
        points: (batch size, measured peak MB) of the sizes that ran (``ok`` rows). A size
            measured more than once contributes each measurement.

    Returns:
        The fit, or a ``MemoryFit`` with ``reason`` set when fewer than two distinct sizes
        were measured.
    """
    ordered = tuple(sorted((int(size), float(peak)) for size, peak in points))
    sizes = sorted({size for size, _ in ordered})
    if len(sizes) < 2:
        shown = f"only batch {sizes[0]} ran" if sizes else "no batch size ran"
        return MemoryFit(ordered, reason=f"{shown}; a line needs two profiled sizes "
                                         "(profile at least two batch sizes)")
    fixed_mb, per_sample_mb = _least_squares(ordered)
    residuals = [peak - (fixed_mb + per_sample_mb * size) for size, peak in ordered]
    rms_mb = math.sqrt(sum(r * r for r in residuals) / len(residuals))
    errors: Dict[int, float] = {}
    if len(sizes) >= 3:
        method = LEAVE_ONE_OUT
        for size in sizes:
            rest = [point for point in ordered if point[0] != size]
            intercept, slope = _least_squares(rest)
            measured = [peak for s, peak in ordered if s == size]
            mean_peak = sum(measured) / len(measured)
            errors[size] = 100.0 * (intercept + slope * size - mean_peak) / mean_peak
    else:
        method = IN_SAMPLE
        for size in sizes:
            measured = [peak for s, peak in ordered if s == size]
            mean_peak = sum(measured) / len(measured)
            errors[size] = 100.0 * (fixed_mb + per_sample_mb * size - mean_peak) / mean_peak
    return MemoryFit(ordered, fixed_mb, per_sample_mb, rms_mb, errors, method)
