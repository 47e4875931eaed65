"""Record a backend to a file and measure a recording: ``odtctl telemetry record|playback``."""

import json
import logging
import threading
import time
from pathlib import Path
from typing import IO, Dict, Optional

from odtd.errors import OdtdError
from odtd.telemetry.base import Backend, PowerSample
from odtd.telemetry.integration import integrate
from odtd.telemetry.playback import RECORDING_FORMAT, RECORDING_VERSION, load_recording
from odtd.telemetry.sampler import Sampler

logger = logging.getLogger(__name__)


class _JsonlWriter:
    """Writes the header before the first sample, when the total rail is known."""

    def __init__(self, handle: IO[str], backend: Backend, interval_s: float) -> None:
        self.handle = handle
        self.header: Dict[str, object] = {
            "format": RECORDING_FORMAT, "version": RECORDING_VERSION, "source": backend.source,
            "backend": backend.name, "interval_s": interval_s, "total_rail": None,
            "total_is_sum": False}
        self.samples = 0
        self.error: Optional[OSError] = None
        self._lock = threading.Lock()

    def write_header(self, sample: Optional[PowerSample]) -> None:
        if sample is not None:
            self.header["total_rail"] = sample.total_rail
            self.header["total_is_sum"] = sample.total_is_sum
        self.handle.write(json.dumps(self.header) + "\n")

    def __call__(self, sample: PowerSample) -> None:
        with self._lock:
            if self.error is not None:
                return
            try:
                if self.samples == 0:
                    self.write_header(sample)
                self.handle.write(json.dumps({
                    "t_mono": round(sample.t_mono, 6),
                    "power_mw": {k: round(v, 3) for k, v in sample.power_mw.items()},
                    "total_mw": None if sample.total_power_mw is None
                    else round(sample.total_power_mw, 3),
                    "memory_available_mb": None if sample.memory_available_mb is None
                    else round(sample.memory_available_mb, 1),
                }) + "\n")
                self.samples += 1
            except OSError as error:
                self.error = error


def record(backend: Backend, seconds: float, out_path: Path,
           interval_s: float = 0.010) -> Dict[str, object]:
    """Sample an opened backend for ``seconds`` and write a jsonl recording.

    Args:
        backend: An opened backend (the caller closes it).
        seconds: How long to record, in seconds.
        out_path: The jsonl file to write (replaced if it exists).
        interval_s: Polling interval for backends without their own cadence, in seconds.

    Returns:
        ``{"path", "seconds", "samples", "failures", "achieved_interval_s", "source",
        "total_rail"}``.

    Raises:
        OdtdError: The file cannot be written, or the arguments are invalid.
    """
    if seconds <= 0:
        raise OdtdError(f"telemetry record: seconds must be > 0, got {seconds!r}")
    out_path = Path(out_path)
    try:
        handle = open(out_path, "w", encoding="utf-8")
    except OSError as error:
        raise OdtdError(f"telemetry record: cannot write {out_path} ({error.strerror})") from error
    with handle:
        writer = _JsonlWriter(handle, backend, backend.nominal_interval_s or interval_s)
        sampler = Sampler(backend, interval_s, ring_seconds=1.0, on_sample=writer)
        sampler.start()
        try:
            time.sleep(seconds)
        finally:
            sampler.stop()
        if writer.samples == 0 and writer.error is None:
            writer.write_header(None)
    if writer.error is not None:
        raise OdtdError(f"telemetry record: writing {out_path} failed ({writer.error.strerror})")
    stats = sampler.stats()
    return {"path": str(out_path), "seconds": seconds, "samples": writer.samples,
            "failures": stats.failures, "achieved_interval_s": stats.achieved_interval_s,
            "source": backend.source, "total_rail": writer.header["total_rail"]}


def integrate_recording(path: Path, fmt: Optional[str] = "jsonl",
                        interval_ms: Optional[float] = None) -> Dict[str, object]:
    """Integrate a whole recording at once (no real-time playback).

    Args:
        path: A jsonl recording or a tegrastats log.
        fmt: ``jsonl`` or ``tegrastats``; None guesses from the suffix (``.jsonl`` or not).
        interval_ms: The interval a tegrastats log was taken at, in milliseconds.

    Returns:
        ``{"duration_s", "samples", "total_j", "energy_by_rail_j", "total_rail", "coverage",
        "source"}``; ``source`` is what measured the recording.

    Raises:
        OdtdError: The file cannot be read or is not in the format.
    """
    recording = load_recording(Path(path), fmt, interval_ms)
    samples = recording.samples
    report = integrate(samples, samples[0].t_mono, samples[-1].t_mono, recording.interval_s,
                       recording.source)
    return {"duration_s": report.duration_s, "samples": report.samples,
            "total_j": report.energy_j, "energy_by_rail_j": report.energy_by_rail_j,
            "total_rail": report.total_rail, "coverage": report.coverage,
            "source": report.source}
