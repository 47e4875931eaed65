"""Energy from power samples: trapezoids on the monotonic clock, honest about what is missing.

Rules, shared by the batch function and the streaming integrator (one code path):

* Between two consecutive samples power is taken as linear, so each segment is a trapezoid.
* A window ``[start, end]`` clips segments exactly, with power interpolated at the edges.
* A segment longer than ``gap_factor`` nominal intervals is a gap: it is not integrated and its
  time counts against ``coverage``. Time before the first or after the last sample is not covered
  either; nothing is extrapolated.
* ``energy_j`` is what was measured over the covered time. ``mean_power_w`` is that energy over
  the covered time, so ``mean_power_w * duration_s`` is the extrapolation, should a caller want
  one. A window with no covered time has ``energy_j = None`` and ``coverage = 0``.
"""

import bisect
import logging
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from odtd.telemetry.base import PowerSample

logger = logging.getLogger(__name__)

DEFAULT_GAP_FACTOR = 3.0


@dataclass(frozen=True)
class EnergyReport:
    """Energy over one window, with where it came from and how much of the window it covers.

    Attributes:
        energy_j: Board total energy in joules over the covered time; None when nothing covered.
        energy_by_rail_j: Energy per rail in joules (sub-rails are parts of the total).
        source: Backend source label (``ina3221``, ``estimate``, ...).
        coverage: Covered fraction of the window, 0..1.
        duration_s: Window length in seconds.
        mean_power_w: ``energy_j`` over the covered time in watts, or None.
        peak_power_w: Highest board total seen in the window in watts, or None.
        total_rail: Input rail the total is, or None when it is a sum or unknown.
        total_is_sum: True when the total is a sum of rails (no input rail exists).
        samples: Number of samples inside the window.
    """

    energy_j: Optional[float]
    energy_by_rail_j: Dict[str, float]
    source: str
    coverage: float
    duration_s: float
    mean_power_w: Optional[float]
    peak_power_w: Optional[float]
    total_rail: Optional[str]
    total_is_sum: bool
    samples: int

    def to_dict(self) -> Dict[str, object]:
        """Return a JSON-ready dict of the fields."""
        return asdict(self)


@dataclass
class _Accumulator:
    total_mj: float = 0.0
    covered_s: float = 0.0
    rails_mj: Dict[str, float] = field(default_factory=dict)
    peak_mw: Optional[float] = None
    samples: int = 0


def _lerp(t0: float, v0: float, t1: float, v1: float, t: float) -> float:
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


class StreamingIntegrator:
    """Integrate a window incrementally, one sample at a time, keeping O(rails) state.

    Feed samples in time order. The end may be unknown while feeding (an open window); once it is
    set, later samples are clipped at it, and ``done`` turns True at the first sample at or past
    the end, which is the one the right edge interpolates towards.
    """

    def __init__(
        self,
        start: float,
        nominal_interval_s: float,
        source: str,
        end: Optional[float] = None,
        gap_factor: float = DEFAULT_GAP_FACTOR,
    ) -> None:
        """Start a window.

        Args:
            start: Window start, monotonic seconds.
            nominal_interval_s: Expected spacing of samples in seconds.
            source: Backend source label carried into the report.
            end: Window end if already known, monotonic seconds.
            gap_factor: Segments longer than this many nominal intervals are gaps.
        """
        if nominal_interval_s <= 0:
            raise ValueError(f"nominal_interval_s must be > 0, got {nominal_interval_s!r}")
        self.start = start
        self.end = end
        self.source = source
        self.max_segment_s = gap_factor * nominal_interval_s
        self.done = False
        self._previous: Optional[PowerSample] = None
        self._acc = _Accumulator()
        self._total_rail: Optional[str] = None
        self._total_is_sum = False
        self._labelled = False

    @property
    def last_t_mono(self) -> Optional[float]:
        """Time of the last sample fed, or None."""
        return self._previous.t_mono if self._previous is not None else None

    def set_end(self, end: float) -> None:
        """Fix the window end (monotonic seconds); it must not precede integrated samples."""
        if end < self.start:
            raise ValueError(f"window end {end:.6f} is before its start {self.start:.6f}")
        if self._previous is not None and self._previous.t_mono > end:
            raise ValueError(
                f"window end {end:.6f} is before the last integrated sample at "
                f"{self._previous.t_mono:.6f}; use integrate() over stored samples for windows "
                "in the past")
        self.end = end
        if self._previous is not None and self._previous.t_mono >= end:
            self.done = True

    def feed(self, sample: PowerSample) -> None:
        """Add the next sample (out-of-order or repeated times are ignored)."""
        previous = self._previous
        if previous is not None and sample.t_mono <= previous.t_mono:
            logger.debug("ignored sample at %.6f after %.6f", sample.t_mono, previous.t_mono)
            return
        if self.end is not None and previous is not None and previous.t_mono >= self.end:
            return  # The window is complete; nothing later can matter.
        if previous is not None:
            self._segment(previous, sample)
        end = self.end
        if sample.t_mono >= self.start and (end is None or sample.t_mono <= end):
            self._acc.samples += 1
            self._label(sample)
            self._peak(sample.total_power_mw)
        self._previous = sample
        if end is not None and sample.t_mono >= end:
            self.done = True

    def _label(self, sample: PowerSample) -> None:
        if not self._labelled and sample.total_power_mw is not None:
            self._total_rail = sample.total_rail
            self._total_is_sum = sample.total_is_sum
            self._labelled = True

    def _peak(self, value_mw: Optional[float]) -> None:
        if value_mw is not None and (self._acc.peak_mw is None or value_mw > self._acc.peak_mw):
            self._acc.peak_mw = value_mw

    def _segment(self, a: PowerSample, b: PowerSample) -> None:
        ta, tb = a.t_mono, b.t_mono
        if tb - ta > self.max_segment_s:
            return  # A gap: neither integrated nor covered.
        lo = max(ta, self.start)
        hi = tb if self.end is None else min(tb, self.end)
        if hi <= lo:
            return
        width_s = hi - lo
        acc = self._acc
        clipped = lo != ta or hi != tb  # Only edge segments need interpolation.
        a_total, b_total = a.total_power_mw, b.total_power_mw
        if a_total is not None and b_total is not None:
            if clipped:
                a_total, b_total = (_lerp(ta, a_total, tb, b_total, lo),
                                    _lerp(ta, a_total, tb, b_total, hi))
            acc.total_mj += 0.5 * (a_total + b_total) * width_s
            acc.covered_s += width_s
            self._label(a)
            self._peak(a_total)
            self._peak(b_total)
        rails_mj = acc.rails_mj
        b_power = b.power_mw
        for rail, a_mw in a.power_mw.items():
            b_mw = b_power.get(rail)
            if b_mw is None:
                continue
            if clipped:
                a_mw, b_mw = _lerp(ta, a_mw, tb, b_mw, lo), _lerp(ta, a_mw, tb, b_mw, hi)
            rails_mj[rail] = rails_mj.get(rail, 0.0) + 0.5 * (a_mw + b_mw) * width_s

    def report(self) -> EnergyReport:
        """Return the report for ``[start, end]``; the end must be set."""
        if self.end is None:
            raise ValueError("the window has no end yet; call set_end() first")
        acc = self._acc
        duration_s = self.end - self.start
        covered = acc.covered_s > 0.0 and duration_s > 0.0
        energy_j = acc.total_mj / 1000.0 if covered else None
        return EnergyReport(
            energy_j=energy_j,
            energy_by_rail_j={r: mj / 1000.0 for r, mj in sorted(acc.rails_mj.items())},
            source=self.source,
            coverage=min(1.0, acc.covered_s / duration_s) if covered else 0.0,
            duration_s=duration_s,
            mean_power_w=(energy_j / acc.covered_s) if energy_j is not None else None,
            peak_power_w=acc.peak_mw / 1000.0 if acc.peak_mw is not None else None,
            total_rail=self._total_rail,
            total_is_sum=self._total_is_sum,
            samples=acc.samples,
        )


def integrate(
    samples: Iterable[PowerSample],
    start: float,
    end: float,
    nominal_interval_s: float,
    source: str = "unknown",
    gap_factor: float = DEFAULT_GAP_FACTOR,
) -> EnergyReport:
    """Integrate raw samples over ``[start, end]``.

    Args:
        samples: Samples in time order (include one before ``start`` and one after ``end`` so
            the edges can be interpolated).
        start: Window start, monotonic seconds.
        end: Window end, monotonic seconds.
        nominal_interval_s: Expected spacing of samples in seconds.
        source: Backend source label for the report.
        gap_factor: Segments longer than this many nominal intervals are gaps.

    Returns:
        The energy report.
    """
    integrator = StreamingIntegrator(start, nominal_interval_s, source, end, gap_factor)
    for sample in samples:
        integrator.feed(sample)
        if integrator.done:
            break
    return integrator.report()


def step_energies(
    samples: Sequence[PowerSample],
    spans: Iterable[Tuple[float, float]],
    nominal_interval_s: float,
    source: str = "unknown",
    gap_factor: float = DEFAULT_GAP_FACTOR,
) -> List[EnergyReport]:
    """Integrate each ``(start, end)`` span (e.g. worker training steps) over the same samples.

    The caller drops warm-up steps (the first 3) from any statistic; this function reports all.

    Args:
        samples: Samples in time order covering the spans.
        spans: ``(start, end)`` pairs in monotonic seconds.
        nominal_interval_s: Expected spacing of samples in seconds.
        source: Backend source label for the reports.
        gap_factor: Segments longer than this many nominal intervals are gaps.

    Returns:
        One report per span, in the order given.
    """
    times = [s.t_mono for s in samples]
    reports = []
    for start, end in spans:
        first = max(0, bisect.bisect_left(times, start) - 1)
        last = bisect.bisect_right(times, end) + 1
        reports.append(integrate(samples[first:last], start, end, nominal_interval_s, source,
                                 gap_factor))
    return reports
