"""Recorded telemetry: loading recordings, and a backend that plays one back in real time.

Two formats are read:

* ``jsonl``, written by :func:`odtd.telemetry.recording.record`: a header line
  ``{"format": "odtd-telemetry", "version": 1, "source": ..., "total_rail": ...,
  "total_is_sum": ..., "interval_s": ...}`` then one sample per line
  ``{"t_mono": ..., "power_mw": {...}, "total_mw": ..., "memory_available_mb": ...}``.
* ``tegrastats``: a saved tegrastats log (``tegrastats --logfile``, or its stdout). Lines carry
  no usable time (JetPack 5+ stamps whole seconds), so the interval it ran at must be given.
"""

import json
import logging
import statistics
import time
from pathlib import Path
from typing import List, NamedTuple, Optional

from odtd.errors import OdtdError, TelemetryUnavailable
from odtd.telemetry.base import Backend, PowerSample
from odtd.telemetry.tegrastats import parse_log

logger = logging.getLogger(__name__)

RECORDING_FORMAT = "odtd-telemetry"
RECORDING_VERSION = 1
FORMATS = ("jsonl", "tegrastats")


class Recording(NamedTuple):
    """A loaded recording.

    Attributes:
        source: The backend source that measured it (``tegrastats`` for a tegrastats log).
        samples: Samples in time order; times are as recorded (a log starts at 0).
        interval_s: Nominal sampling interval in seconds.
    """

    source: str
    samples: List[PowerSample]
    interval_s: float


def guess_format(path: Path) -> str:
    """Return ``jsonl`` for ``.jsonl``/``.json`` files, else ``tegrastats``."""
    return "jsonl" if Path(path).suffix.lower() in (".jsonl", ".json") else "tegrastats"


def load_recording(path: Path, fmt: Optional[str] = None,
                   interval_ms: Optional[float] = None) -> Recording:
    """Load a recording.

    Args:
        path: The file.
        fmt: ``jsonl`` or ``tegrastats``; None guesses from the suffix.
        interval_ms: Interval a tegrastats log was taken at (its ``--interval``), in ms.

    Returns:
        The recording.

    Raises:
        OdtdError: The file is missing, empty, or not in the format; the message names the fix.
    """
    path = Path(path)
    fmt = fmt or guess_format(path)
    if fmt not in FORMATS:
        raise OdtdError(f"telemetry playback: format {fmt!r} is unknown; use one of "
                        f"{', '.join(FORMATS)}")
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError as error:
        raise OdtdError(f"telemetry playback: cannot read {path} ({error.strerror})") from error
    recording = _load_jsonl(path, lines) if fmt == "jsonl" else \
        _load_tegrastats(path, lines, interval_ms)
    if not recording.samples:
        raise OdtdError(f"telemetry playback: {path} has no power samples; is it a {fmt} file?")
    return recording


def _load_jsonl(path: Path, lines: List[str]) -> Recording:
    try:
        header = json.loads(lines[0]) if lines else {}
    except ValueError as error:
        raise OdtdError(f"telemetry playback: {path}:1 is not JSON ({error}); expected the header "
                        "written by `odtctl telemetry record`") from error
    if not isinstance(header, dict) or header.get("format") != RECORDING_FORMAT:
        raise OdtdError(f"telemetry playback: {path}:1 has no {{\"format\": "
                        f"\"{RECORDING_FORMAT}\"}} header; record with `odtctl telemetry "
                        "record`, or pass --format tegrastats for a log")
    total_rail = header.get("total_rail")
    total_is_sum = bool(header.get("total_is_sum"))
    samples = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            total = row.get("total_mw")
            samples.append(PowerSample(
                float(row["t_mono"]), {k: float(v) for k, v in row["power_mw"].items()},
                None if total is None else float(total), total_rail if total is not None
                else None, total_is_sum and total is not None, row.get("memory_available_mb")))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise OdtdError(f"telemetry playback: {path}:{number} is not a sample line "
                            f"({type(error).__name__}: {error})") from error
    samples.sort(key=lambda s: s.t_mono)
    interval_s = header.get("interval_s") or _median_spacing(samples)
    return Recording(str(header.get("source", "unknown")), samples, float(interval_s))


def _load_tegrastats(path: Path, lines: List[str], interval_ms: Optional[float]) -> Recording:
    parsed = list(parse_log(lines))
    if interval_ms is None:
        stamps = [p.timestamp for p in parsed if p.timestamp is not None]
        if len(stamps) < 2 or len(stamps) != len(parsed) or stamps[-1] <= stamps[0]:
            raise OdtdError(f"telemetry playback: {path} is a tegrastats log without usable "
                            "timestamps; pass the interval it was taken at (--interval-ms, the "
                            "value given "
                            "to tegrastats --interval)")
        # Whole-second stamps: the spacing is only known on average over the whole log.
        interval_s = (stamps[-1] - stamps[0]).total_seconds() / (len(stamps) - 1)
        logger.debug("%s: interval %.3f s from its timestamps", path, interval_s)
    elif interval_ms <= 0:
        raise OdtdError(f"telemetry playback: interval_ms must be > 0, got {interval_ms!r}")
    else:
        interval_s = interval_ms / 1000.0
    samples = [p.to_sample(i * interval_s) for i, p in enumerate(parsed)]
    return Recording("tegrastats", samples, interval_s)


def _median_spacing(samples: List[PowerSample]) -> float:
    gaps = [b.t_mono - a.t_mono for a, b in zip(samples, samples[1:]) if b.t_mono > a.t_mono]
    return statistics.median(gaps) if gaps else 1.0


class PlaybackBackend(Backend):
    """Plays a recording back in real time (or ``speed`` times faster), for tests and demos.

    Samples are stamped with the present monotonic clock at their scheduled time, so windows and
    step spans measured during a playback see the recorded power.
    """

    name = "playback"
    source = "playback"

    def __init__(self, root: Path = Path("/"), path: Optional[str] = None,
                 fmt: Optional[str] = None, interval_ms: Optional[float] = None,
                 speed: float = 1.0, loop: bool = False) -> None:
        """Store options.

        Args:
            root: Unused; kept for a uniform constructor.
            path: The recording (``telemetry.playback_file`` in odtd.yaml).
            fmt: ``jsonl`` or ``tegrastats``; None guesses from the suffix.
            interval_ms: Interval of a tegrastats log, in milliseconds.
            speed: Playback speed factor (2.0 plays twice as fast).
            loop: Start over at the end instead of running dry.
        """
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed!r}")
        self.root = Path(root)
        self.path = path
        self.fmt = fmt
        self.interval_ms = interval_ms
        self.speed = speed
        self.loop = loop
        self.finished = False
        self._samples: List[PowerSample] = []
        self._offsets_s: List[float] = []
        self._index = 0
        self._t0 = 0.0

    @classmethod
    def probe(cls, root: Path = Path("/")) -> Optional[str]:
        """Always available given a recording; never chosen by auto-detection."""
        return None

    def open(self) -> None:
        """Load the recording and start the clock."""
        if not self.path:
            raise TelemetryUnavailable("playback: no recording given; set telemetry.playback_file "
                                       "to a file written by `odtctl telemetry record`")
        try:
            recording = load_recording(Path(self.path), self.fmt, self.interval_ms)
        except OdtdError as error:
            raise TelemetryUnavailable(str(error)) from error
        first = recording.samples[0].t_mono
        self._samples = recording.samples
        self._offsets_s = [(s.t_mono - first) / self.speed for s in recording.samples]
        self.nominal_interval_s = recording.interval_s / self.speed
        self._index = 0
        self.finished = False
        self._t0 = time.monotonic()

    def read(self) -> Optional[PowerSample]:
        """Wait for the next recorded sample's time and return it, restamped."""
        if not self._samples:
            raise TelemetryUnavailable("playback: read() before open()")
        interval_s = self.nominal_interval_s or 0.1
        if self._index >= len(self._samples):
            if not self.loop:
                self.finished = True
                time.sleep(interval_s)
                return None
            self._t0 += self._offsets_s[-1] + interval_s
            self._index = 0
        target = self._t0 + self._offsets_s[self._index]
        delay = target - time.monotonic()
        if delay > 3.0 * interval_s:
            time.sleep(3.0 * interval_s)  # A gap in the recording is a gap in the playback.
            return None
        if delay > 0:
            time.sleep(delay)
        sample = self._samples[self._index]
        self._index += 1
        return sample._replace(t_mono=target)

    def close(self) -> None:
        """Forget the recording."""
        self._samples = []
