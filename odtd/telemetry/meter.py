"""Energy of a session: the telemetry sampler's samples joined with the worker's step spans.

The sampler runs in this process (the daemon, or the CLI for a foreground session) on the
monotonic clock; the worker reports each step's start and end on the same clock, so one
integration gives the session's joules per rail and another each step's.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from odtd.config import TelemetryConfig
from odtd.telemetry import Sampler, open_backend

logger = logging.getLogger(__name__)

BASELINE_S = 2.0


class SessionEnergyMeter:
    """Measures sessions with a running sampler (the session runner's ``energy_meter``).

    Args:
        sampler: a started ``Sampler``.
        baseline_s: the idle window just before a session whose mean power is its baseline.
    """

    def __init__(self, sampler: Sampler, baseline_s: float = BASELINE_S) -> None:
        self.sampler = sampler
        self.baseline_s = baseline_s

    def begin(self) -> dict[str, Any]:
        """Open the session's energy window; return the token ``end`` needs."""
        now = time.monotonic()
        baseline = self.sampler.energy_between(now - self.baseline_s, now)
        key = f"session-{uuid.uuid4().hex[:8]}"
        self.sampler.open_window(key)
        return {"key": key, "baseline_power_w": baseline.mean_power_w if baseline.coverage > 0.5 else None}

    def end(self, token: dict[str, Any], steps: list[dict[str, Any]], warmup_steps: int) -> dict[str, Any]:
        """Close the window; set each step's ``energy_j``; return the session's energy fields.

        ``warmup_steps``: the first steps, left out of the per-step figures (the worker
        protocol's ``WARMUP_STEPS``: graph tracing, allocator growth).
        """
        report = self.sampler.close_window(token["key"])
        if steps:
            # Per-step figures come from the sampler's ring (10 minutes): in a longer session
            # the earliest steps have none, and the session total (streamed) is unaffected.
            per_step = self.sampler.span_energies([(s["start"], s["end"]) for s in steps])
            for step, step_report in zip(steps, per_step):
                step["energy_j"] = step_report.energy_j
        baseline_w = token["baseline_power_w"]
        incremental = None
        if report.energy_j is not None and baseline_w is not None:
            incremental = report.energy_j - baseline_w * report.duration_s * report.coverage
        measured = [s["energy_j"] for s in steps[warmup_steps:] if s.get("energy_j") is not None]
        return {
            "energy_j": _round(report.energy_j),
            "energy_by_rail_j": {rail: round(j, 3) for rail, j in report.energy_by_rail_j.items()}
            or None,
            "energy_source": report.source,
            "energy_coverage": round(report.coverage, 4),
            "energy_details": {
                "mean_power_w": _round(report.mean_power_w),
                "peak_power_w": _round(report.peak_power_w),
                "baseline_power_w": _round(baseline_w),
                "incremental_energy_j": _round(incremental),
                "total_rail": report.total_rail,
                "total_is_sum": report.total_is_sum,
                "samples": report.samples,
                "mean_step_energy_j": _round(sum(measured) / len(measured)) if measured else None,
            },
        }


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def make_sampler(telemetry: TelemetryConfig) -> Sampler:
    """Open the configured telemetry backend and build (not start) its sampler.

    Raises:
        TelemetryUnavailable: the named backend cannot run here (the message says the fix).
    """
    # A played-back recording loops, so a demo or test session never runs out of samples.
    options: dict[str, Any] = {}
    if telemetry.backend == "playback":
        options = {"path": telemetry.playback_file, "loop": True,
                   "interval_ms": telemetry.playback_interval_ms}
    backend = open_backend(telemetry.backend, **options)
    return Sampler(backend, interval_s=telemetry.interval_ms / 1000.0,
                   nice_increment=telemetry.sampler_nice)


@contextmanager
def running_sampler(telemetry: TelemetryConfig, wait_baseline: bool = True) -> Iterator[Sampler]:
    """Open the configured backend and run a sampler for the duration of the block.

    Args:
        telemetry: the config's telemetry section (backend name, interval).
        wait_baseline: sample for ``BASELINE_S`` before yielding, so the first session has
            an idle baseline (the daemon's always-running sampler has one anyway).
    """
    sampler = make_sampler(telemetry)
    backend = sampler.backend
    sampler.start()
    try:
        if wait_baseline:
            time.sleep(BASELINE_S)
        yield sampler
    finally:
        sampler.stop()
        backend.close()
