"""The sampler thread: reads a backend on a fixed cadence, keeps recent samples, integrates windows.

Memory stays bounded however long a session runs. Raw samples go into a ring of the last
``ring_seconds`` (compact float columns, not objects: ten minutes at 10 ms is 60,000 rows).
Anything longer, like a whole training session, is measured with a *window*: ``open_window`` at
the start, ``close_window`` at the end, and a streaming integrator in between that keeps a few
numbers per rail instead of every sample.
"""

import logging
import math
import os
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from odtd.errors import TelemetryUnavailable
from odtd.telemetry.base import Backend, PowerSample
from odtd.telemetry.integration import (
    DEFAULT_GAP_FACTOR,
    EnergyReport,
    StreamingIntegrator,
    integrate,
    step_energies,
)

logger = logging.getLogger(__name__)

_NAN = float("nan")
_CPU_CLOCK_EVERY = 32  # reads between refreshes of the thread's CPU time (~1 us each, cold ~8)


class SamplerStats(NamedTuple):
    """How the sampler has been doing.

    Attributes:
        reads: Read attempts.
        samples: Reads that produced a sample.
        failures: Reads that raised or returned nothing (gaps).
        achieved_interval_s: Mean spacing of the samples, or None before two samples.
        interval_s: The interval being aimed at (the backend's own, if it has one).
        cpu_s: CPU time the sampler thread has used, in seconds.
        running: Whether the thread is running.
    """

    reads: int
    samples: int
    failures: int
    achieved_interval_s: Optional[float]
    interval_s: float
    cpu_s: float
    running: bool


class SampleRing:
    """The last ``capacity`` samples in preallocated float64 columns (rails fixed by the first).

    Not thread-safe on its own; the sampler guards it with its lock.
    """

    def __init__(self, capacity: int) -> None:
        """Allocate nothing yet; columns are sized when the first sample names the rails."""
        if capacity < 2:
            raise ValueError(f"ring capacity must be >= 2, got {capacity!r}")
        self.capacity = capacity
        self.rails: Sequence[str] = ()
        self.total_rail: Optional[str] = None
        self.total_is_sum = False
        self._rows: Optional[np.ndarray] = None
        self._next = 0
        self._count = 0

    def __len__(self) -> int:
        """Number of stored samples."""
        return self._count

    def append(self, sample: PowerSample) -> None:
        """Store a sample, overwriting the oldest when full."""
        if self._rows is None:
            self.rails = tuple(sample.power_mw)
            self.total_rail, self.total_is_sum = sample.total_rail, sample.total_is_sum
            self._rows = np.full((self.capacity, 3 + len(self.rails)), np.nan)
        total = sample.total_power_mw
        memory = sample.memory_available_mb
        get = sample.power_mw.get
        self._rows[self._next] = (sample.t_mono, _NAN if total is None else total,
                                  _NAN if memory is None else memory,
                                  *[get(rail, _NAN) for rail in self.rails])
        self._next = (self._next + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)

    def _ordered(self) -> np.ndarray:
        if self._rows is None:
            return np.empty((0, 3))
        if self._count < self.capacity:
            return self._rows[: self._count]
        return np.concatenate((self._rows[self._next:], self._rows[: self._next]))

    def between(self, t0: float, t1: float, pad: int = 0) -> List[PowerSample]:
        """Return samples with ``t0 <= t_mono <= t1``, plus ``pad`` neighbours on each side."""
        rows = self._ordered()
        times = rows[:, 0]
        first = max(0, int(np.searchsorted(times, t0, side="left")) - pad)
        last = min(len(rows), int(np.searchsorted(times, t1, side="right")) + pad)
        return [self._sample(row) for row in rows[first:last]]

    def _sample(self, row: np.ndarray) -> PowerSample:
        power_mw = {rail: float(value) for rail, value in zip(self.rails, row[3:])
                    if not math.isnan(value)}
        total = None if math.isnan(row[1]) else float(row[1])
        memory = None if math.isnan(row[2]) else float(row[2])
        return PowerSample(float(row[0]), power_mw, total, self.total_rail if total is not None
                           else None, self.total_is_sum and total is not None, memory)


class Sampler:
    """Reads a backend in a thread at ``interval_s`` (or the backend's own cadence).

    A failed read is a gap, counted and logged at debug level, never a crash. Timestamps are the
    backend's (``time.monotonic()`` right after each read), so they can be joined with the step
    spans the trainer worker reports on the same clock.
    """

    def __init__(
        self,
        backend: Backend,
        interval_s: float = 0.010,
        ring_seconds: float = 600.0,
        gap_factor: float = DEFAULT_GAP_FACTOR,
        on_sample: Optional[Callable[[PowerSample], None]] = None,
        nice_increment: int = 0,
    ) -> None:
        """Prepare the sampler; the backend must already be open.

        Args:
            backend: An opened backend (the caller closes it after ``stop()``).
            interval_s: Polling interval in seconds, for backends without their own cadence.
            ring_seconds: How many seconds of raw samples to keep for ``samples_between``.
            gap_factor: Segments longer than this many intervals are gaps in energy figures.
            on_sample: Called in the sampler thread with each new sample (e.g. a recorder).
            nice_increment: Added to the sampler thread's own nice value (Linux: per thread),
                so its wake-ups do not preempt the trainer worker's threads mid-step.
        """
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.backend = backend
        self.interval_s = backend.nominal_interval_s or interval_s
        self.gap_factor = gap_factor
        self._on_sample = on_sample
        self.nice_increment = nice_increment
        self._ring = SampleRing(max(2, int(math.ceil(ring_seconds / self.interval_s)) + 1))
        self._lock = threading.Lock()
        self._sampled = threading.Condition(self._lock)
        self._windows: Dict[str, StreamingIntegrator] = {}
        self._latest: Optional[PowerSample] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._reads = self._samples = self._failures = 0
        self._first_t: Optional[float] = None
        self._cpu_s = 0.0
        self._waiters = 0  # threads in close_window / wait_for_sample_after: notify only then

    def start(self) -> None:
        """Start the thread (a no-op for a backend that measures nothing, or when running)."""
        if self._thread is not None and self._thread.is_alive():
            return
        if not self.backend.measures_energy:
            logger.debug("backend %s measures nothing; no sampler thread", self.backend.name)
            return
        with self._lock:  # Statistics describe the current run.
            self._reads = self._samples = self._failures = 0
            self._first_t = None
            self._cpu_s = 0.0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="odtd-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and wait for it (the backend stays open)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("sampler thread still in a backend read after %.1f s", timeout_s)
            self._thread = None
        with self._sampled:
            self._sampled.notify_all()

    @property
    def running(self) -> bool:
        """Whether the sampler thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _lower_priority(self) -> None:
        # On a machine whose cores all train, a wake-up at the worker's priority preempts a
        # TensorFlow thread; the step then waits for it. A niced sampler reads in the gaps.
        try:
            tid = threading.get_native_id()
            nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice_increment)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (AttributeError, OSError) as error:  # not Linux, or not allowed
            logger.debug("sampler thread keeps its priority: %s", error)

    def _run(self) -> None:
        if self.nice_increment:
            self._lower_priority()
        self_paced = self.backend.nominal_interval_s is not None
        deadline = time.monotonic()
        iteration = 0
        while not self._stop.is_set():
            sample = None
            try:
                sample = self.backend.read()
            except (OSError, ValueError, TelemetryUnavailable) as error:
                logger.debug("%s read failed: %s", self.backend.name, error)
            self._record(sample)
            iteration += 1
            if iteration % _CPU_CLOCK_EVERY == 0:
                self._cpu_s = time.thread_time()
            if self_paced:
                # read() waited for the backend's own next sample; after a failure, back off
                # one interval so a dead source is not polled in a tight loop.
                if sample is None:
                    time.sleep(self.interval_s)
                continue
            deadline += self.interval_s
            delay = deadline - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            elif delay < -self.interval_s:
                deadline = time.monotonic()  # Fell behind: skip ahead rather than burst.
        self._cpu_s = time.thread_time()

    def _record(self, sample: Optional[PowerSample]) -> None:
        with self._sampled:
            self._reads += 1
            if sample is None:
                self._failures += 1
                return
            self._samples += 1
            if self._first_t is None:
                self._first_t = sample.t_mono
            self._latest = sample
            self._ring.append(sample)
            for integrator in self._windows.values():
                integrator.feed(sample)
            if self._waiters:
                self._sampled.notify_all()
        if self._on_sample is not None:
            self._on_sample(sample)

    def latest(self) -> Optional[PowerSample]:
        """Return the newest sample, or None."""
        with self._lock:
            return self._latest

    def stats(self) -> SamplerStats:
        """Return counters, the achieved interval and the thread's CPU time."""
        with self._lock:
            achieved = None
            if self._samples >= 2 and self._latest is not None and self._first_t is not None:
                achieved = (self._latest.t_mono - self._first_t) / (self._samples - 1)
            return SamplerStats(self._reads, self._samples, self._failures, achieved,
                                self.interval_s, self._cpu_s, self.running)

    def samples_between(self, t0: float, t1: float) -> List[PowerSample]:
        """Return stored raw samples with ``t0 <= t_mono <= t1`` (the ring keeps recent ones)."""
        with self._lock:
            return self._ring.between(t0, t1)

    def energy_between(self, t0: float, t1: float) -> EnergyReport:
        """Integrate stored samples over ``[t0, t1]`` (coverage drops if the ring lost them)."""
        with self._lock:
            samples = self._ring.between(t0, t1, pad=1)
        return integrate(samples, t0, t1, self.interval_s, self.backend.source, self.gap_factor)

    def span_energies(self, spans: Sequence[Tuple[float, float]]) -> List[EnergyReport]:
        """Integrate each ``(start, end)`` span (e.g. worker steps) over the stored samples.

        Unlike ``samples_between`` plus ``step_energies``, this includes the sample just
        outside each end of the spans, so the first and last spans' edges interpolate too.
        Spans older than the ring (``ring_seconds``) come back with low or zero coverage.
        """
        if not spans:
            return []
        with self._lock:
            samples = self._ring.between(min(s for s, _ in spans), max(e for _, e in spans),
                                         pad=1)
        return step_energies(samples, spans, self.interval_s, self.backend.source,
                             self.gap_factor)

    def open_window(self, key: str) -> None:
        """Start integrating from now under ``key`` until ``close_window(key)``."""
        with self._lock:
            if key in self._windows:
                raise ValueError(f"energy window {key!r} is already open")
            integrator = StreamingIntegrator(time.monotonic(), self.interval_s,
                                             self.backend.source, gap_factor=self.gap_factor)
            if self._latest is not None:
                integrator.feed(self._latest)  # The left edge interpolates from it.
            self._windows[key] = integrator

    def close_window(self, key: str) -> EnergyReport:
        """End window ``key`` now and return its energy.

        Waits up to ``gap_factor`` intervals for the first sample past the end, which the right
        edge interpolates towards; without one, the tail counts as not covered.

        Raises:
            KeyError: No window ``key`` is open.
        """
        with self._sampled:
            integrator = self._windows[key]
            integrator.set_end(max(time.monotonic(), integrator.last_t_mono or 0.0))
            deadline = time.monotonic() + self.gap_factor * self.interval_s
            self._waiters += 1
            try:
                while not integrator.done and self.running:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._sampled.wait(remaining)
            finally:
                self._waiters -= 1
            del self._windows[key]
        return integrator.report()

    def open_windows(self) -> List[str]:
        """Return the keys of the open windows."""
        with self._lock:
            return sorted(self._windows)

    def wait_for_sample_after(self, t_mono: float, timeout_s: float) -> bool:
        """Block until a sample newer than ``t_mono`` exists; False on timeout or when stopped."""
        deadline = time.monotonic() + timeout_s
        with self._sampled:
            self._waiters += 1
            try:
                while self._latest is None or self._latest.t_mono <= t_mono:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self.running:
                        return False
                    self._sampled.wait(remaining)
                return True
            finally:
                self._waiters -= 1
