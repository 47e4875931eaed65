"""Peak memory as a function of batch size: ``peak_mb = fixed_mb + per_sample_mb x batch``.

Parameters, gradients, optimizer state and the framework itself are constant; feature maps and
workspace grow with the batch (DESIGN.md). A least-squares line through the measured peaks of a
profile predicts sizes that were not run, which is how a policy can refuse a batch size before a
session dies for it. Pure arithmetic: no TensorFlow, no I/O.

Some networks' peak is flat over the small sizes and rises only beyond them: there something
that does not grow with the batch (tracing the step, the allocator's first regions) sets the
peak until the step's tensors outgrow it. For those the model is a floor and a line,
``peak_mb = max(floor_mb, fixed_mb + per_sample_mb x batch)``. With four or more profiled sizes
both shapes are fitted and the one whose leave-one-out predictions are closer is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

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


# (floor MB or None, intercept MB, slope MB per sample): max(floor, intercept + slope x batch).
_Shape = Tuple[Optional[float], float, float]


def _at(shape: _Shape, batch_size: float) -> float:
    floor, intercept, slope = shape
    line = intercept + slope * batch_size
    return line if floor is None else max(floor, line)


def _line(points: Sequence[Tuple[int, float]]) -> _Shape:
    return (None, *_least_squares(points))


def _floor_and_line(points: Sequence[Tuple[int, float]]) -> Optional[_Shape]:
    """The best floor-then-line through points of at least 3 sizes; None when none rises.

    The smallest ``k`` sizes set the floor (their mean), a least-squares line runs through the
    others (two sizes or more, rising); the ``k`` with the least squared error wins.
    """
    sizes = sorted({size for size, _ in points})
    best: Optional[Tuple[float, _Shape]] = None
    for count in range(1, len(sizes) - 1):
        low = [peak for size, peak in points if size in sizes[:count]]
        shape = (sum(low) / len(low), *_least_squares(
            [point for point in points if point[0] in sizes[count:]]))
        if shape[2] <= 0:
            continue
        error = sum((peak - _at(shape, size)) ** 2 for size, peak in points)
        if best is None or error < best[0]:
            best = (error, shape)
    return best[1] if best else None


def _errors_pct(points: Sequence[Tuple[int, float]],
                predict: Callable[[int], float]) -> Dict[int, float]:
    """Each size's error in percent of the mean of its peaks, as ``predict(size)`` has it."""
    errors = {}
    for size in sorted({size for size, _ in points}):
        measured = [peak for s, peak in points if s == size]
        mean_peak = sum(measured) / len(measured)
        errors[size] = 100.0 * (predict(size) - mean_peak) / mean_peak
    return errors


def _leave_one_out(points: Sequence[Tuple[int, float]],
                   fit: Callable[[Sequence[Tuple[int, float]]], Optional[_Shape]]
                   ) -> Dict[int, float]:
    """Each size's error predicted by ``fit`` of the others (the line where ``fit`` has none)."""
    def predict(size: int) -> float:
        rest = [point for point in points if point[0] != size]
        return _at(fit(rest) or _line(rest), size)

    return _errors_pct(points, predict)


def _rms(values: Iterable[float]) -> float:
    values = list(values)
    return math.sqrt(sum(v * v for v in values) / len(values))


@dataclass(frozen=True)
class MemoryFit:
    """A fitted (or unfittable) memory model: a line, or a floor and a line.

    Attributes:
        points: (batch size, measured peak MB) pairs the fit used, by batch size.
        fixed_mb: Intercept in MB, or None when no line could be fitted.
        per_sample_mb: Slope in MB per sample of batch, or None.
        floor_mb: The flat peak of the small sizes, None when the line alone fits better:
            ``peak_mb = max(floor_mb, fixed_mb + per_sample_mb x batch)``.
        residual_rms_mb: Root mean square of the in-sample residuals in MB (0 for two points).
        errors_pct: Batch size -> signed prediction error in percent of the measured peak.
        error_method: ``leave-one-out`` (three or more sizes: each size predicted by the line
            through the others) or ``in-sample`` (two sizes), None without a fit.
        reason: Why there is no fit, None when there is one.
        spread_pct: The largest run-to-run spread of one size's peaks (max - min, in percent of
            their mean), None when no size was measured twice (``odtctl profile --repeats``). A
            prediction cannot be closer than the measurement repeats.
    """

    points: Tuple[Tuple[int, float], ...]
    fixed_mb: Optional[float] = None
    per_sample_mb: Optional[float] = None
    residual_rms_mb: Optional[float] = None
    errors_pct: Dict[int, float] = field(default_factory=dict)
    error_method: Optional[str] = None
    reason: Optional[str] = None
    spread_pct: Optional[float] = None
    floor_mb: Optional[float] = None

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
        return _at((self.floor_mb, self.fixed_mb, self.per_sample_mb),  # type: ignore[arg-type]
                   batch_size)

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
        if self.floor_mb is not None and self.floor_mb > limit_mb:
            return None
        size = math.floor((limit_mb - self.fixed_mb) / self.per_sample_mb)  # type: ignore[operator]
        return size if size >= 1 else None

    def describe(self) -> str:
        """One line for people: the line, its residual and its prediction errors."""
        if not self.fitted:
            return f"no memory fit: {self.reason}"
        errors = ", ".join(f"batch {size} {error:+.1f}%" for size, error in
                           sorted(self.errors_pct.items()))
        sizes = len({size for size, _ in self.points})
        spread = "" if self.spread_pct is None else \
            f"; runs of one size differ by up to {self.spread_pct:.1f}%"
        return (f"{self.formula()} "
                f"(residual RMS {self.residual_rms_mb:.1f} MB over {sizes} sizes; "
                f"{self.error_method} error: {errors}{spread})")

    def formula(self) -> str:
        """``peak_mb = 808.5 + 2.38 x batch`` or ``peak_mb = max(1062.9, 911.1 + 6.53 x batch)``."""
        line = f"{self.fixed_mb:.1f} + {self.per_sample_mb:.2f} x batch"
        return f"peak_mb = {line}" if self.floor_mb is None else \
            f"peak_mb = max({self.floor_mb:.1f}, {line})"

    def to_dict(self) -> Dict[str, Any]:
        """Return a JSON-ready dict (batch-size keys become strings in JSON)."""
        return {
            "fixed_mb": _round(self.fixed_mb), "per_sample_mb": _round(self.per_sample_mb, 3),
            "floor_mb": _round(self.floor_mb),
            "residual_rms_mb": _round(self.residual_rms_mb),
            "points": [[size, round(peak, 1)] for size, peak in self.points],
            "errors_pct": {str(size): round(error, 2) for size, error in self.errors_pct.items()},
            "error_method": self.error_method, "reason": self.reason,
            "spread_pct": _round(self.spread_pct, 2),
        }


def _round(value: Optional[float], digits: int = 1) -> Optional[float]:
    return None if value is None else round(value, digits)


def allowed_mb(budget_mb: float, headroom_pct: float) -> float:
    """Return the memory a batch may use: the budget less its headroom, in MB."""
    return budget_mb * (1.0 - headroom_pct / 100.0)


def fit_memory(points: Iterable[Tuple[int, float]]) -> MemoryFit:
    """Fit the peak against the batch: a least-squares line, or a floor and a line.

    Args:
        points: (batch size, measured peak MB) of the sizes that ran (``ok`` rows). A size
            measured more than once contributes each measurement to the fit, and is predicted
            against the mean of its measurements.

    Returns:
        The fit, or a ``MemoryFit`` with ``reason`` set when fewer than two distinct sizes
        were measured. With three sizes or more its errors are leave-one-out; with four or
        more the floor-and-line shape is kept where its leave-one-out errors are smaller
        (by root mean square) than the line's.
    """
    ordered = tuple(sorted((int(size), float(peak)) for size, peak in points))
    sizes = sorted({size for size, _ in ordered})
    spread = _spread_pct(ordered)
    if len(sizes) < 2:
        shown = f"only batch {sizes[0]} ran" if sizes else "no batch size ran"
        return MemoryFit(ordered, reason=f"{shown}; a line needs two profiled sizes "
                                         "(profile at least two batch sizes)", spread_pct=spread)
    shape = _line(ordered)
    if len(sizes) >= 3:
        method = LEAVE_ONE_OUT
        errors = _leave_one_out(ordered, _line)
        stepped = _floor_and_line(ordered) if len(sizes) >= 4 else None
        if stepped is not None:
            stepped_errors = _leave_one_out(ordered, _floor_and_line)
            if _rms(stepped_errors.values()) < _rms(errors.values()):
                shape, errors = stepped, stepped_errors
    else:
        method = IN_SAMPLE
        errors = _errors_pct(ordered, lambda size: _at(shape, size))
    rms_mb = _rms(peak - _at(shape, size) for size, peak in ordered)
    floor_mb, fixed_mb, per_sample_mb = shape
    return MemoryFit(ordered, fixed_mb, per_sample_mb, rms_mb, errors, method,
                     spread_pct=spread, floor_mb=floor_mb)


def _spread_pct(points: Sequence[Tuple[int, float]]) -> Optional[float]:
    """The largest (max - min) / mean of one size's peaks in percent; None without repeats."""
    by_size: Dict[int, list] = {}
    for size, peak in points:
        by_size.setdefault(size, []).append(peak)
    spreads = [100.0 * (max(peaks) - min(peaks)) * len(peaks) / sum(peaks)
               for peaks in by_size.values() if len(peaks) > 1]
    return max(spreads) if spreads else None
