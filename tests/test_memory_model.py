"""The memory model (a line, or a floor and a line), its errors, a batch under a budget."""

import pytest

from odtd.errors import PolicyError
from odtd.profiling.memory_fit import IN_SAMPLE, LEAVE_ONE_OUT, allowed_mb, fit_memory


def test_exact_line_is_recovered_with_zero_leave_one_out_error():
    fit = fit_memory([(4, 700.0), (8, 900.0), (16, 1300.0)])
    assert fit.fitted
    assert fit.fixed_mb == pytest.approx(500.0)
    assert fit.per_sample_mb == pytest.approx(50.0)
    assert fit.residual_rms_mb == pytest.approx(0.0, abs=1e-9)
    assert fit.error_method == LEAVE_ONE_OUT
    assert all(error == pytest.approx(0.0, abs=1e-9) for error in fit.errors_pct.values())
    assert fit.predict_mb(32) == pytest.approx(2100.0)


def test_noisy_points_report_residual_and_leave_one_out_error_per_size():
    fit = fit_memory([(4, 710.0), (8, 880.0), (16, 1310.0), (32, 2100.0)])
    assert fit.residual_rms_mb > 0
    assert sorted(fit.errors_pct) == [4, 8, 16, 32]
    # Leaving out 8 (measured low) predicts it from the others: too high.
    assert fit.errors_pct[8] > 0
    assert "leave-one-out error: batch 4" in fit.describe()
    assert fit.to_dict()["errors_pct"]["8"] == round(fit.errors_pct[8], 2)


def test_a_flat_start_then_a_rise_is_fitted_as_a_floor_and_a_line():
    # Xception 71x71 recomputed, profiled here: nothing that grows with the batch sets the peak
    # up to batch 16, then the step's tensors do.
    points = [(4, 1064.0), (8, 1061.0), (16, 1063.0), (32, 1144.0), (64, 1344.0)]
    fit = fit_memory(points)
    assert fit.floor_mb == pytest.approx((1064.0 + 1061.0 + 1063.0) / 3)
    assert fit.per_sample_mb == pytest.approx(200.0 / 32)  # the line through 32 and 64
    assert fit.predict_mb(4) == fit.floor_mb and fit.predict_mb(48) == pytest.approx(1244.0)
    assert fit.formula().startswith("peak_mb = max(1062.7, 944.0 + 6.25 x batch")
    # The line alone misses batch 64 by 8.5% when the others predict it; the floor and the line
    # through 16 and 32 by 2.8%.
    assert fit.errors_pct[64] == pytest.approx(-2.8, abs=0.05)
    assert max(abs(e) for e in fit.errors_pct.values()) < 5
    largest = fit.largest_batch(1100.0, 0)
    assert fit.predict_mb(largest) <= 1100.0 < fit.predict_mb(largest + 1)
    assert fit.largest_batch(1050.0, 0) is None  # the floor alone is over the budget
    assert fit.to_dict()["floor_mb"] == 1062.7


def test_a_straight_line_keeps_no_floor():
    fit = fit_memory([(4, 700.0), (8, 900.0), (16, 1300.0), (32, 2100.0)])
    assert fit.floor_mb is None and fit.formula() == "peak_mb = 500.0 + 50.00 x batch"


def test_two_sizes_fit_exactly_and_say_the_error_is_in_sample():
    fit = fit_memory([(4, 2200.0), (64, 5900.0)])
    assert fit.error_method == IN_SAMPLE
    assert fit.residual_rms_mb == pytest.approx(0.0, abs=1e-9)


def test_published_tx2_densenet40_figures_predict_the_oom_at_128():
    # DenseNet40 on an 8 GB TX2: 2.2 GB at batch 4, 5.9 GB at batch 64, batch 128 ran out.
    fit = fit_memory([(4, 2200.0), (64, 5900.0)])
    assert fit.per_sample_mb == pytest.approx(61.67, abs=0.01)
    assert fit.fixed_mb == pytest.approx(1953.3, abs=0.1)
    assert fit.predict_mb(128) > 8 * 1024
    assert fit.largest_batch(5000, 15) == 37  # (4250 - 1953.3) / 61.67
    assert fit.largest_batch(5000, 15, candidates=[4, 8, 16, 32, 64]) == 32


def test_one_point_cannot_fit_and_says_so():
    fit = fit_memory([(16, 1500.0)])
    assert not fit.fitted
    assert "only batch 16 ran" in fit.reason and "two profiled sizes" in fit.reason
    with pytest.raises(PolicyError, match="cannot predict memory at batch 32: only batch 16"):
        fit.predict_mb(32)
    with pytest.raises(PolicyError, match="cannot size a batch"):
        fit.largest_batch(4000, 10)
    assert fit.describe().startswith("no memory fit: only batch 16 ran")


def test_repeated_size_is_not_two_sizes():
    assert not fit_memory([(8, 900.0), (8, 905.0)]).fitted
    assert not fit_memory([]).fitted


def test_repeated_runs_of_a_size_give_the_spread_and_are_predicted_by_their_mean():
    fit = fit_memory([(4, 100.0), (8, 140.0), (8, 160.0), (16, 230.0), (16, 250.0)])
    assert fit.spread_pct == pytest.approx(100.0 * 20.0 / 150.0)
    intercept_without_8, slope = 160.0 / 3, 35.0 / 3  # through (4, 100), (16, 230), (16, 250)
    assert fit.errors_pct[8] == pytest.approx(100.0 * (intercept_without_8 + slope * 8 - 150) / 150)
    assert "runs of one size differ by up to 13.3%" in fit.describe()
    assert "over 3 sizes" in fit.describe()
    assert fit_memory([(4, 100.0), (8, 140.0)]).spread_pct is None


def test_largest_batch_none_when_nothing_fits():
    fit = fit_memory([(4, 700.0), (8, 900.0)])
    assert fit.largest_batch(500, 0) is None
    assert fit.largest_batch(650, 0, candidates=[4, 8]) is None
    assert allowed_mb(1000, 15) == pytest.approx(850)


def test_flat_fit_needs_candidates():
    fit = fit_memory([(4, 900.0), (8, 899.0)])
    with pytest.raises(PolicyError, match="no positive per-sample memory"):
        fit.largest_batch(2000, 10)
    assert fit.largest_batch(2000, 10, candidates=[4, 8, 64]) == 64


def test_tx2_policy_is_consistent_with_the_published_figures():
    from pathlib import Path

    from odtd.policy import load_policy

    policy = load_policy(Path(__file__).parents[1] / "policies" / "densenet40-tx2.yaml",
                         missing_ok=False)
    batch = policy.batch
    fit = fit_memory([(4, 2200.0), (64, 5900.0)])
    assert fit.largest_batch(batch.memory_budget_mb, batch.headroom_pct,
                             candidates=batch.candidates) == batch.size == 32
    assert round(fit.predict_mb(batch.size)) == 3927
