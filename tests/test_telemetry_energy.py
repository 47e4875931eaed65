"""Energy integration against figures computed by hand."""

import random

import pytest

from odtd.telemetry import PowerSample, StreamingIntegrator, integrate, step_energies


def sample(t, total_mw, rails=None, total_rail="VDD_IN"):
    rails = dict(rails or {})
    if total_rail is not None:
        rails[total_rail] = total_mw
        return PowerSample(t, rails, total_mw, total_rail, False)
    return PowerSample(t, rails, total_mw, None, True)


def test_constant_power():
    # 2 W for the window [2 s, 5 s] = 6 J, sampled every 10 ms.
    samples = [sample(i * 0.01, 2000.0) for i in range(1001)]
    report = integrate(samples, 2.0, 5.0, 0.01, "ina3221")
    assert report.energy_j == pytest.approx(6.0)
    assert report.coverage == pytest.approx(1.0)
    assert report.duration_s == pytest.approx(3.0)
    assert report.mean_power_w == pytest.approx(2.0)
    assert report.peak_power_w == pytest.approx(2.0)
    assert report.samples == 301
    assert (report.source, report.total_rail, report.total_is_sum) == ("ina3221", "VDD_IN", False)


def test_ramp_is_exact_because_power_is_linear_between_samples():
    # P(t) = 1000 t mW sampled once a second: over [0, 10] s, the integral is 1000 * 10^2 / 2 mJ.
    samples = [sample(float(t), 1000.0 * t) for t in range(11)]
    assert integrate(samples, 0.0, 10.0, 1.0).energy_j == pytest.approx(50.0)
    # Over [2.5, 7.5] s: 1000 * (7.5^2 - 2.5^2) / 2 mJ = 25 J, edges interpolated mid-sample.
    report = integrate(samples, 2.5, 7.5, 1.0)
    assert report.energy_j == pytest.approx(25.0)
    assert report.peak_power_w == pytest.approx(7.5)
    assert report.samples == 5  # t = 3, 4, 5, 6, 7


def test_edge_clipping_interpolates_both_edges():
    # 0 -> 1000 mW between t=0 and t=1; window [0.25, 0.75] averages 500 mW over 0.5 s.
    samples = [sample(0.0, 0.0), sample(1.0, 1000.0)]
    report = integrate(samples, 0.25, 0.75, 1.0)
    assert report.energy_j == pytest.approx(0.25)
    assert report.mean_power_w == pytest.approx(0.5)
    assert report.coverage == pytest.approx(1.0)
    assert report.peak_power_w == pytest.approx(0.75)
    assert report.samples == 0


def test_gap_longer_than_three_intervals_is_lost_coverage():
    # 1 W, samples at 0..4 s and 10..14 s, nominal 1 s: the 6 s hole is not integrated.
    samples = [sample(float(t), 1000.0) for t in [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]]
    report = integrate(samples, 0.0, 14.0, 1.0)
    assert report.energy_j == pytest.approx(8.0)
    assert report.coverage == pytest.approx(8.0 / 14.0)
    assert report.mean_power_w == pytest.approx(1.0)


def test_gap_of_exactly_three_intervals_is_still_covered():
    samples = [sample(0.0, 1000.0), sample(3.0, 1000.0)]
    report = integrate(samples, 0.0, 3.0, 1.0)
    assert (report.energy_j, report.coverage) == (pytest.approx(3.0), pytest.approx(1.0))


def test_window_without_samples_has_no_energy():
    samples = [sample(0.0, 1000.0), sample(1.0, 1000.0)]
    report = integrate(samples, 5.0, 6.0, 1.0, "tegrastats")
    assert report.energy_j is None
    assert report.coverage == 0.0
    assert report.mean_power_w is None and report.peak_power_w is None
    assert report.samples == 0 and report.energy_by_rail_j == {}
    assert report.source == "tegrastats"
    assert integrate([], 0.0, 1.0, 0.01).energy_j is None


def test_time_before_the_first_sample_is_not_extrapolated():
    samples = [sample(2.0, 1000.0), sample(3.0, 1000.0)]
    report = integrate(samples, 0.0, 5.0, 1.0)
    assert report.energy_j == pytest.approx(1.0)
    assert report.coverage == pytest.approx(0.2)


def test_rails_are_integrated_separately_and_total_is_not_their_sum():
    rails = {"VDD_SYS_GPU": 4480.0, "VDD_SYS_DDR": 1561.0}
    samples = [sample(t * 0.1, 8411.0, rails) for t in range(11)]
    report = integrate(samples, 0.0, 1.0, 0.1)
    assert report.energy_j == pytest.approx(8.411)
    assert report.energy_by_rail_j == {"VDD_IN": pytest.approx(8.411),
                                       "VDD_SYS_DDR": pytest.approx(1.561),
                                       "VDD_SYS_GPU": pytest.approx(4.480)}


def test_summed_total_is_labelled_as_a_sum():
    samples = [sample(t, 3000.0, {"GPU": 1000.0, "CPU": 2000.0}, total_rail=None)
               for t in range(3)]
    report = integrate(samples, 0.0, 2.0, 1.0)
    assert report.total_rail is None and report.total_is_sum
    assert report.energy_j == pytest.approx(6.0)


def test_streaming_matches_batch_with_the_end_set_late():
    rng = random.Random(3)
    t, samples = 0.0, []
    for _ in range(500):
        t += rng.choice([0.01, 0.01, 0.011, 0.009, 0.05])  # 0.05 s is a gap at 10 ms nominal
        samples.append(sample(t, rng.uniform(1500, 9000), {"VDD_SYS_GPU": rng.uniform(0, 5000)}))
    start, end = samples[10].t_mono + 0.003, samples[400].t_mono + 0.004
    batch = integrate(samples, start, end, 0.01, "jtop")
    streaming = StreamingIntegrator(start, 0.01, "jtop")
    streaming.feed(samples[9])
    for s in samples[10:401]:
        streaming.feed(s)
    streaming.set_end(end)
    assert not streaming.done
    for s in samples[401:]:
        streaming.feed(s)
    assert streaming.done
    assert streaming.report() == batch
    assert 0.5 < batch.coverage < 1.0


def test_end_before_integrated_samples_is_refused():
    streaming = StreamingIntegrator(0.0, 1.0, "x")
    for t in range(5):
        streaming.feed(sample(float(t), 1000.0))
    with pytest.raises(ValueError, match="before the last integrated sample"):
        streaming.set_end(2.0)
    with pytest.raises(ValueError, match="no end yet"):
        StreamingIntegrator(0.0, 1.0, "x").report()


def test_step_energies_join_spans_with_samples():
    # 1 W until t=1 s, 3 W from t=1 s on (the ramp between 1.00 and 1.01 s is linear).
    samples = [sample(i * 0.01, 1000.0 if i <= 100 else 3000.0) for i in range(301)]
    spans = [(0.2, 0.7), (1.5, 2.5), (0.95, 1.05), (5.0, 6.0)]
    reports = step_energies(samples, spans, 0.01, "ina3221")
    assert [r.source for r in reports] == ["ina3221"] * 4
    assert reports[0].energy_j == pytest.approx(0.5)
    assert reports[1].energy_j == pytest.approx(3.0)
    # 0.95-1.00: 1 W; 1.00-1.01: 2 W mean; 1.01-1.05: 3 W.
    assert reports[2].energy_j == pytest.approx(0.05 + 0.02 + 0.12)
    assert reports[3].energy_j is None and reports[3].coverage == 0.0


def test_report_serialises():
    report = integrate([sample(0.0, 1000.0), sample(1.0, 1000.0)], 0.0, 1.0, 1.0, "rapl")
    as_dict = report.to_dict()
    assert set(as_dict) == {"energy_j", "energy_by_rail_j", "source", "coverage", "duration_s",
                            "mean_power_w", "peak_power_w", "total_rail", "total_is_sum",
                            "samples"}
