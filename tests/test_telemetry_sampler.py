"""The sampler thread with a fast fake backend: cadence, gaps, bounded memory, windows."""

import os
import sys
import time
from pathlib import Path

import pytest

from odtd.telemetry import Backend, PowerSample, Sampler
from odtd.telemetry.integration import DEFAULT_GAP_FACTOR
from odtd.telemetry.null import NullBackend
from odtd.telemetry.playback import PlaybackBackend

FIXTURES = Path(__file__).parent / "fixtures" / "telemetry"


class FastBackend(Backend):
    """A polled backend reading a constant 1 W, with an optional outage (an I2C bus hang)."""

    name = "fast"
    source = "fake"

    def __init__(self, power_mw=1000.0, outage_s=None, error=OSError):
        self.power_mw = power_mw
        self.outage_s = outage_s
        self.error = error
        self.t0 = 0.0

    @classmethod
    def probe(cls, root=Path("/")):
        return None

    def open(self):
        self.t0 = time.monotonic()

    def read(self):
        if self.outage_s and self.outage_s[0] <= time.monotonic() - self.t0 < self.outage_s[1]:
            raise self.error("ina3221: I2C transfer timed out")
        return PowerSample.from_rails(time.monotonic(), {"VDD_IN": self.power_mw,
                                                         "VDD_SYS_GPU": 400.0})


def run_window(sampler, seconds):
    sampler.open_window("session")
    time.sleep(seconds)
    return sampler.close_window("session")


def test_cadence_and_cost_without_busy_waiting():
    backend = FastBackend()
    backend.open()
    sampler = Sampler(backend, interval_s=0.010)
    sampler.start()
    wall_start = time.monotonic()
    report = run_window(sampler, 0.5)
    # The window began at about wall_start (open_window reads the clock right after it).
    window = (wall_start, wall_start + report.duration_s)
    times = [s.t_mono for s in sampler.samples_between(wall_start - 1.0, time.monotonic())]
    sampler.stop()
    wall_s = time.monotonic() - wall_start
    stats = sampler.stats()
    assert not stats.running and stats.failures == 0
    # Never faster than asked; slower only as far as a loaded machine delays the thread
    # (at least 10 reads in half a second, a 50 ms interval: no timing figure is tested).
    assert 0.009 <= stats.achieved_interval_s and stats.samples >= 10
    assert stats.cpu_s < 0.5 * wall_s  # it sleeps between reads
    # The window is covered but where the thread was held up past the gap limit (3 intervals),
    # which a loaded machine does: the coverage is what the samples' spacing says.
    # Only the part of a gap inside the window counts against it: a loaded machine may hold the
    # thread up after the window closed too, which its coverage does not see.
    late = sum(max(0.0, min(b, window[1]) - max(a, window[0])) for a, b in zip(times, times[1:])
               if b - a > DEFAULT_GAP_FACTOR * 0.010)
    assert report.coverage == pytest.approx(1 - late / report.duration_s, abs=0.05)
    assert report.coverage > 0.95 or late > 0
    assert report.energy_j == pytest.approx(report.duration_s * report.coverage * 1.0, rel=1e-6)
    assert report.energy_by_rail_j["VDD_SYS_GPU"] == pytest.approx(0.4 * report.energy_j)
    assert report.total_rail == "VDD_IN" and report.source == "fake"


@pytest.mark.parametrize("error", [OSError, ValueError])
def test_failed_reads_are_gaps_not_crashes(error):
    backend = FastBackend(outage_s=(0.15, 0.35), error=error)
    backend.open()
    sampler = Sampler(backend, interval_s=0.010)
    sampler.start()
    wall_start = time.monotonic()
    report = run_window(sampler, 0.55)
    window = (wall_start, wall_start + report.duration_s)
    times = [s.t_mono for s in sampler.samples_between(wall_start - 1.0, time.monotonic())]
    assert sampler.running  # survived the outage
    sampler.stop()
    stats = sampler.stats()
    assert stats.failures >= 10
    assert stats.reads == stats.samples + stats.failures
    # The outage (0.2 s, far longer than 3 intervals) is a gap, and so is any hold-up of the
    # thread a loaded machine adds: the coverage is what the samples' spacing says.
    gaps = [(a, b) for a, b in zip(times, times[1:]) if b - a > DEFAULT_GAP_FACTOR * 0.010]
    assert any(b - a >= 0.15 for a, b in gaps)  # the outage, whole
    late = sum(max(0.0, min(b, window[1]) - max(a, window[0])) for a, b in gaps)
    assert report.coverage == pytest.approx(1 - late / report.duration_s, abs=0.05)
    assert report.coverage < 0.75
    assert report.energy_j == pytest.approx(report.coverage * report.duration_s, rel=1e-6)


def test_ring_is_bounded_and_searchable():
    backend = FastBackend()
    backend.open()
    # gap_factor 1000: a loaded machine can delay the 5 ms thread past the default gap limit, and
    # this test is about the ring and its edges, not gap detection (tests/test_telemetry_energy.py).
    sampler = Sampler(backend, interval_s=0.005, ring_seconds=0.05, gap_factor=1000.0)
    sampler.start()
    time.sleep(0.3)
    sampler.stop()
    everything = sampler.samples_between(0.0, time.monotonic())
    assert 2 <= len(everything) <= 11  # 0.05 s / 5 ms + 1 rows
    times = [s.t_mono for s in everything]
    assert times == sorted(times)
    middle = sampler.samples_between(times[2], times[4])
    assert [s.t_mono for s in middle] == times[2:5]
    assert middle[0].power_mw == {"VDD_IN": 1000.0, "VDD_SYS_GPU": 400.0}
    assert middle[0].total_rail == "VDD_IN"
    report = sampler.energy_between(times[2], times[4])
    assert report.energy_j == pytest.approx(times[4] - times[2])
    # Spans between samples still interpolate at both edges (the ring's neighbours are used).
    # (The middle half of each gap: a loaded machine can put two samples a millisecond apart.)
    middle_of = [(a + (b - a) / 4, b - (b - a) / 4) for a, b in ((times[2], times[3]),
                                                                 (times[3], times[4]))]
    spans = sampler.span_energies(middle_of)
    assert [r.coverage for r in spans] == [pytest.approx(1.0)] * 2
    assert spans[0].energy_j == pytest.approx((times[3] - times[2]) / 2)
    assert sampler.span_energies([]) == []
    assert sampler.latest().t_mono == times[-1]


def test_windows_are_independent_and_checked():
    backend = FastBackend()
    backend.open()
    sampler = Sampler(backend, interval_s=0.01)
    sampler.start()
    sampler.open_window("session")
    time.sleep(0.1)
    sampler.open_window("step")
    with pytest.raises(ValueError, match="already open"):
        sampler.open_window("step")
    time.sleep(0.1)
    step = sampler.close_window("step")
    assert sampler.open_windows() == ["session"]
    time.sleep(0.05)
    session = sampler.close_window("session")
    with pytest.raises(KeyError):
        sampler.close_window("session")
    sampler.stop()
    assert step.duration_s < session.duration_s
    assert step.energy_j < session.energy_j


def test_self_paced_backend_sets_the_cadence():
    backend = PlaybackBackend(path=str(FIXTURES / "recording_tx2_jp46_ina3221.jsonl"))
    backend.open()
    seen = []
    sampler = Sampler(backend, interval_s=0.001, on_sample=seen.append)
    assert sampler.interval_s == pytest.approx(0.01)
    sampler.start()
    assert sampler.wait_for_sample_after(time.monotonic(), timeout_s=1.0)
    time.sleep(0.25)
    sampler.stop()
    stats = sampler.stats()
    assert stats.achieved_interval_s == pytest.approx(0.01, rel=0.05)  # recorded times
    assert len(seen) == stats.samples >= 20
    assert {s.total_power_mw for s in seen} == {3056.0, 8411.0}


def test_backend_that_measures_nothing_needs_no_thread():
    sampler = Sampler(NullBackend())
    sampler.start()
    assert not sampler.running
    report = run_window(sampler, 0.01)
    assert report.energy_j is None and report.coverage == 0.0 and report.source == "none"
    assert not sampler.wait_for_sample_after(0.0, timeout_s=0.01)


class NiceRecordingBackend(FastBackend):
    """Records the nice value of the thread that reads it (Linux: nice is per thread)."""

    def read(self):
        self.reader_nice = os.getpriority(os.PRIO_PROCESS, 0)
        return super().read()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_sampler_thread_is_niced_and_the_caller_is_not():
    backend = NiceRecordingBackend()
    backend.open()
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    sampler = Sampler(backend, interval_s=0.010, nice_increment=5)
    sampler.start()
    try:
        assert sampler.wait_for_sample_after(time.monotonic(), timeout_s=2.0)
    finally:
        sampler.stop()
    assert backend.reader_nice == min(19, own_nice + 5)
    assert os.getpriority(os.PRIO_PROCESS, 0) == own_nice
