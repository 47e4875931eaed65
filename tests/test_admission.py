"""Admission: every on_over_budget branch, the memory budget, and the runtime OOM rule."""

import signal
from dataclasses import replace

import pytest

from odtd.policy import Policy
from odtd.profiling.profile import DOES_NOT_FIT, OK, ProfileResult, ProfileRow
from odtd.session.admission import (
    RUN,
    SKIP,
    admit,
    admit_session,
)
from odtd.session.oom import learned_oom_limit, oom_retry_batch, record_oom
from odtd.session.prediction import predict
from odtd.store.database import Store
from odtd.trainer.protocol.launch import worker_ran_out_of_memory

SIZES = (4, 8, 16, 32)


def make_profile(energy=(1.0, 0.8, 0.7, 0.65), sps=(10.0, 15.0, 20.0, 22.0), failed=()):
    """A profile whose peak memory is exactly 1000 MB + 50 MB x batch."""
    rows = [ProfileRow(size, "fp32", OK, samples_per_s=rate, energy_per_sample_j=joules,
                       peak_memory_mb=1000.0 + 50.0 * size, energy_source="ina3221",
                       mean_power_w=7.0)
            for size, rate, joules in zip(SIZES, sps, energy)]
    rows += [ProfileRow(size, "fp32", DOES_NOT_FIT, reason="worker killed by SIGKILL")
             for size in failed]
    return ProfileResult(1, "densenet40", "ina3221", "Jetson TX2", 10, tuple(rows))


def test_a_profiled_size_is_predicted_at_no_less_than_its_largest_run():
    rows = [replace(r, peak_memory_mb=1900.0, peak_memory_runs_mb=[1800.0, 1900.0])
            if r.batch_size == 16 else r for r in make_profile().rows]
    profile = replace(make_profile(), rows=tuple(rows))
    assert profile.memory_fit("fp32").predict_mb(16) < 1900.0
    assert predict(profile, "fp32", 16, samples=100, epochs=1).peak_mb == 1900.0
    assert predict(profile, "fp32", 8, samples=100, epochs=1).peak_mb == \
        round(profile.memory_fit("fp32").predict_mb(8), 1)


def policy(size=16, epochs=3, budget_mb=None, budget_j=None, on_over_budget="fewer_epochs",
           on_oom="halve"):
    return Policy.model_validate({
        "batch": {"size": size, "candidates": list(SIZES), "memory_budget_mb": budget_mb,
                  "headroom_pct": 15, "on_oom": on_oom},
        "energy": {"budget_j": budget_j, "on_over_budget": on_over_budget},
        "training": {"epochs": epochs},
    })


def test_prediction_arithmetic():
    p = predict(make_profile(), "fp32", 16, samples=100, epochs=3)
    assert (p.time_s, p.energy_j, p.peak_mb, p.basis) == (15.0, 210.0, 1800.0, "measured")
    between = predict(make_profile(), "fp32", 12, samples=100, epochs=1)
    assert between.basis == "interpolated" and 15.0 < 100 / between.time_s < 20.0
    assert predict(make_profile(), "fp32", 64, 100, 1).basis == "nearest measured"
    assert predict(make_profile(), "fp32", 64, 100, 1).peak_mb == 4200.0
    # Profiled up to 32: 64 is the line extended past it; a micro-batch of 16 is not.
    assert predict(make_profile(), "fp32", 64, 100, 1).memory_extrapolated_past == 32
    assert predict(make_profile(), "fp32", 64, 100, 1, micro_batch_size=16
                   ).memory_extrapolated_past is None
    assert predict(make_profile(), "fp32", 12, 100, 1).memory_extrapolated_past is None


def test_within_budgets_runs_as_the_policy_says():
    a = admit(policy(budget_mb=4000, budget_j=1000), make_profile(), samples=100)
    assert (a.decision, a.batch_size, a.epochs, a.changes) == (RUN, 16, 3, ())
    assert (a.predicted_time_s, a.predicted_energy_j, a.predicted_peak_mb) == (15.0, 210.0, 1800.0)
    assert a.reason == "within budgets"


def test_memory_over_budget_takes_the_largest_fitting_candidate():
    # 2000 MB less 15% = 1700 MB: 32 needs 2600, 16 needs 1800, 8 needs 1400.
    a = admit(policy(size=32, budget_mb=2000), make_profile(), samples=100)
    assert (a.decision, a.batch_size, a.predicted_peak_mb) == (RUN, 8, 1400.0)
    assert a.changes == ("batch 32 -> 8: predicted peak 2600 MB > 1700 MB (2000 MB budget less "
                         "15% headroom)",)


def test_memory_over_budget_with_no_fitting_candidate_skips():
    # 1400 MB less 15% = 1190 MB: batch 4 needs 1200, batch 1 (not a candidate) would fit.
    a = admit(policy(size=16, budget_mb=1400), make_profile(), samples=100)
    assert a.decision == SKIP
    assert a.reason.endswith("and no smaller candidate fits")


def test_a_model_over_the_memory_cap_at_batch_1_is_refused_naming_the_cap():
    # 1000 MB less 15% = 850 MB; batch 1 needs 1050 MB.
    a = admit(policy(size=16, budget_mb=1000), make_profile(), samples=100)
    assert a.decision == SKIP
    assert a.reason == ("densenet40 does not fit the memory cap even at batch 1 (predicted peak "
                        "1050 MB > 850 MB (1000 MB budget less 15% headroom)): it cannot train "
                        "here under this policy; raise batch.memory_budget_mb, or bring a "
                        "smaller model or input size")


def test_a_size_that_did_not_run_in_the_profile_is_refused():
    a = admit(policy(size=32, budget_mb=None), make_profile(failed=(16,)), samples=100)
    assert (a.decision, a.batch_size) == (RUN, 8)
    assert a.changes[0] == "batch 32 -> 8: batch 16 did not run in the profile"


def test_fewer_epochs_fits_the_energy_budget():
    a = admit(policy(budget_j=150), make_profile(), samples=100)
    assert (a.decision, a.batch_size, a.epochs, a.predicted_energy_j) == (RUN, 16, 2, 140.0)
    assert a.changes == ("epochs 3 -> 2: predicted 210 J > budget 150 J",)


def test_fewer_epochs_skips_when_one_epoch_is_over_budget():
    a = admit(policy(budget_j=50), make_profile(), samples=100)
    assert a.decision == SKIP
    assert a.reason == "predicted 210 J > budget 50 J, and one epoch needs 70 J"


def test_smaller_batch_fits_the_energy_budget():
    # A board where small batches cost less per sample: 0.5 J at 4, 0.6 J at 8, 0.7 J at 16.
    profile = make_profile(energy=(0.5, 0.6, 0.7, 0.8))
    a = admit(policy(budget_j=190, on_over_budget="smaller_batch"), profile, samples=100)
    assert (a.decision, a.batch_size, a.epochs, a.predicted_energy_j) == (RUN, 8, 3, 180.0)
    assert a.changes == ("batch 16 -> 8: predicted 210 J > budget 190 J",)


def test_smaller_batch_skips_when_no_smaller_size_fits():
    a = admit(policy(budget_j=150, on_over_budget="smaller_batch"), make_profile(), samples=100)
    assert a.decision == SKIP
    assert a.reason == "predicted 210 J > budget 150 J, and no smaller candidate fits it"


def test_skip_on_over_budget():
    a = admit(policy(budget_j=150, on_over_budget="skip"), make_profile(), samples=100)
    assert a.decision == SKIP
    assert a.reason == "predicted 210 J > budget 150 J (energy.on_over_budget: skip)"


def test_energy_budget_without_energy_figures_runs_with_a_note():
    a = admit(policy(budget_j=10), make_profile(energy=(None,) * 4), samples=100)
    assert a.decision == RUN and a.predicted_energy_j is None
    assert a.reason == "energy budget not checked: the profile has no energy figures"


def test_a_profile_of_another_board_or_power_mode_is_used_with_a_note():
    profile = make_profile()  # measured on "Jetson TX2"
    same = admit(policy(budget_mb=4000), profile, samples=100, board="Jetson TX2")
    assert same.reason == "within budgets"
    moved = admit(policy(budget_mb=4000), profile, samples=100,
                  board="Jetson TX2 (nvpmodel MAXQ, mode 1)")
    assert (moved.decision, moved.batch_size, moved.predicted_peak_mb) == (RUN, 16, 1800.0)
    assert moved.reason == ("the profile was measured on Jetson TX2, this device is Jetson TX2 "
                            "(nvpmodel MAXQ, mode 1) now: its figures may not hold here; run "
                            "`odtctl profile` again")


def test_memory_past_the_largest_profiled_size_is_named_an_extrapolation():
    # Profiled at 4 to 32; the line says 64 needs 4200 MB, within 8000 less 15%.
    a = admit(policy(size=64, budget_mb=8000), make_profile(), samples=100)
    assert (a.decision, a.batch_size, a.predicted_peak_mb) == (RUN, 64, 4200.0)
    assert a.reason == ("memory predicted past batch 32, the largest profiled: "
                        "the line is extrapolated there (run `odtctl profile --precisions fp32 "
                        "--batch-sizes 64` to measure it)")
    # Without a memory budget there is nothing to check it against, and nothing to say.
    assert admit(policy(size=64), make_profile(), samples=100).reason == "within budgets"


def test_no_profile_runs_unchecked():
    a = admit(policy(budget_mb=100, budget_j=1), None, samples=100)
    assert (a.decision, a.batch_size, a.predicted_time_s) == (RUN, 16, None)
    assert "no profile" in a.reason


def test_learned_oom_limit_starts_below_it():
    a = admit(policy(size=32), make_profile(), samples=100, oom_limit=32)
    assert (a.decision, a.batch_size) == (RUN, 16)
    assert a.changes == ("batch 32 -> 16: batch 32 ran out of memory in an earlier session",)
    # No candidate below the limit: half of it.
    assert admit(policy(size=4), None, samples=100, oom_limit=4).batch_size == 2


@pytest.mark.parametrize("on_oom,failed,retry", [
    ("halve", 32, 16), ("halve", 3, 1), ("halve", 1, None), ("skip", 32, None),
])
def test_oom_retry_batch(on_oom, failed, retry):
    assert oom_retry_batch(policy(on_oom=on_oom).batch, failed) == retry


def test_out_of_memory_is_the_error_event_or_the_oom_killers_sigkill():
    assert worker_ran_out_of_memory({"event": "error", "kind": "oom", "message": "OOM"}, 2, None)
    assert not worker_ran_out_of_memory({"event": "error", "kind": "exception"}, 2, None)
    # No kill counter (a TX2's 4.9 kernel): a SIGKILL is taken as the OOM killer's.
    assert worker_ran_out_of_memory(None, -signal.SIGKILL, None)
    assert not worker_ran_out_of_memory(None, -signal.SIGSEGV, None)
    assert not worker_ran_out_of_memory(None, 0, None)


def test_learned_limit_is_remembered_in_the_store(tmp_path):
    store = Store(tmp_path / "odtd.db")
    store.set_meta(model="densenet40")
    assert learned_oom_limit(store, "densenet40") is None
    assert record_oom(store, "densenet40", 64) == 64
    assert record_oom(store, "densenet40", 128) == 64  # a larger failure does not raise it
    assert store.meta("oom_limit_densenet40") == 64
    a = admit_session(store, policy(size=64), samples=100)
    assert (a.batch_size, a.decision) == (32, RUN)
    store.close()


# -- plans: precision x recomputation x micro-batches at one batch size ----------------------


def plans_profile(recompute=True, bf16=False, half=False):
    """Whole batches: 1000 + 50 MB x batch; recomputed: 900 + 20 MB x batch at 3/4 the speed;
    half the network recomputed: 950 + 30 MB x batch at 0.9 of the speed."""
    rows = list(make_profile().rows)
    if half:
        rows += [ProfileRow(r.batch_size, "fp32", OK, recompute=0.5,
                            samples_per_s=r.samples_per_s * 0.9,
                            energy_per_sample_j=r.energy_per_sample_j / 0.9,
                            peak_memory_mb=950.0 + 30.0 * r.batch_size, mean_power_w=7.0)
                 for r in make_profile().rows]
    if recompute:
        rows += [ProfileRow(r.batch_size, "fp32", OK, recompute=True,
                            samples_per_s=r.samples_per_s * 0.75,
                            energy_per_sample_j=r.energy_per_sample_j / 0.75,
                            peak_memory_mb=900.0 + 20.0 * r.batch_size, mean_power_w=7.0)
                 for r in make_profile().rows]
    if bf16:
        rows += [ProfileRow(r.batch_size, "mixed_bfloat16", OK, samples_per_s=r.samples_per_s * 1.5,
                            energy_per_sample_j=r.energy_per_sample_j / 1.5,
                            peak_memory_mb=r.peak_memory_mb, mean_power_w=7.0)
                 for r in make_profile().rows]
    return ProfileResult(1, "densenet40", "ina3221", "Jetson TX2", 10, tuple(rows))


def plan_policy(size=32, budget_mb=2000, objective="energy", **training):
    return Policy.model_validate({
        "objective": objective,
        "batch": {"size": size, "candidates": list(SIZES), "memory_budget_mb": budget_mb,
                  "headroom_pct": 15, "precisions": training.pop("precisions", None)},
        "training": training,
    })


def test_recomputation_is_chosen_when_the_whole_batch_does_not_fit():
    # Batch 32 whole: 2600 MB > 1700 MB (2000 less 15%); recomputed: 1540 MB.
    a = admit(plan_policy(recompute="auto"), plans_profile(), samples=100)
    assert (a.decision, a.batch_size, a.recompute, a.micro_batch_size) == (RUN, 32, True, None)
    assert a.predicted_peak_mb == 1540.0
    assert a.predicted_time_s == round(300 / (22.0 * 0.75), 2)
    assert a.changes == ("plan fp32 -> fp32+recompute: predicted peak 2600 MB > 1700 MB "
                         "(2000 MB budget less 15% headroom)",)
    assert {"batch_size": 32, "plan": "fp32", "reason": a.changes[0].split(": ", 1)[1]} \
        in a.rejected


def test_the_whole_batch_stays_when_it_fits_and_recomputation_costs_more():
    a = admit(plan_policy(budget_mb=4000, recompute="auto"), plans_profile(), samples=100)
    assert (a.batch_size, a.recompute, a.changes) == (32, False, ())
    [other] = a.rejected
    assert other["plan"] == "fp32+recompute" and other["reason"].startswith("fits, but costs")


def test_auto_weighs_every_profiled_share_and_takes_the_cheapest_that_fits():
    # Batch 32: whole 2600 MB, half recomputed 1910 MB, all 1540 MB against a 1700 MB cap.
    a = admit(plan_policy(recompute="auto"), plans_profile(half=True), samples=100)
    assert (a.batch_size, a.recompute, a.predicted_peak_mb) == (32, 1.0, 1540.0)
    assert {"fp32", "fp32+recompute0.5"} <= {r["plan"] for r in a.rejected if r["batch_size"] == 32}
    # A 2300 MB budget (1955 MB cap): half the network is enough, at 0.9 of the speed, not 0.75.
    b = admit(plan_policy(budget_mb=2300, recompute="auto"), plans_profile(half=True),
              samples=100)
    assert (b.batch_size, b.recompute, b.predicted_peak_mb) == (32, 0.5, 1910.0)
    assert any(r["plan"] == "fp32+recompute" and r["reason"].startswith("fits, but costs")
               for r in b.rejected)
    # A share the policy names is the only one it runs.
    c = admit(plan_policy(budget_mb=2300, recompute=0.5), plans_profile(half=True), samples=100)
    assert (c.batch_size, c.recompute) == (32, 0.5)
    d = admit(plan_policy(recompute=0.5), plans_profile(half=True), samples=100)
    assert (d.batch_size, d.recompute) == (16, 0.5)  # 32 at 1910 MB does not fit 1700 MB
    # A share never profiled runs unchecked, and the reason names the command that profiles it.
    e = admit(plan_policy(recompute=0.5), plans_profile(), samples=100)
    assert (e.batch_size, e.recompute, e.predicted_peak_mb) == (32, 0.5, None)
    assert e.reason.startswith("plan fp32+recompute0.5 not profiled: memory and energy not "
                               "checked (run `odtctl profile --precisions fp32 --recompute 0.5`)")


def test_without_recomputation_the_batch_shrinks_instead():
    a = admit(plan_policy(recompute="off"), plans_profile(), samples=100)
    assert (a.batch_size, a.recompute) == (8, False)  # 16 whole: 1800 MB > 1700 MB


def test_an_unprofiled_recomputation_is_named_not_guessed():
    a = admit(plan_policy(recompute="auto"), plans_profile(recompute=False), samples=100)
    assert (a.batch_size, a.recompute) == (8, False)
    assert {"batch_size": 32, "plan": "fp32+recompute",
            "reason": "not profiled: run `odtctl profile --precisions fp32 --recompute on`"} \
        in a.rejected


def test_micro_batches_carry_a_batch_that_fits_no_other_way_with_frozen_batchnorm():
    # Micro 16: 1800 MB; micro 8: 1400 MB + 40 MB of summed gradients fits 1700 MB.
    a = admit(plan_policy(micro_batch_size="auto", freeze_bn=True), plans_profile(), samples=100,
              accumulator_mb=40.0)
    assert (a.batch_size, a.micro_batch_size, a.predicted_peak_mb) == (32, 8, 1440.0)
    assert a.predicted_time_s == round(300 / 15.0, 2)  # steps run at batch 8's throughput
    # A BatchNorm that trains would see 8 images per normalisation: no micro-batches.
    b = admit(plan_policy(micro_batch_size="auto", freeze_bn=False), plans_profile(),
              samples=100)
    assert (b.batch_size, b.micro_batch_size) == (8, None)


def test_the_objective_picks_among_precisions_that_fit():
    policy = plan_policy(budget_mb=None, objective="time",
                         precisions=["fp32", "mixed_bfloat16"])
    a = admit(policy, plans_profile(recompute=False, bf16=True), samples=100)
    assert (a.batch_size, a.precision) == (32, "mixed_bfloat16")
    only = admit(plan_policy(budget_mb=None, precisions=["fp32", "mixed_bfloat16"]),
                 plans_profile(recompute=False), samples=100)
    assert only.precision == "fp32" and "not profiled" in only.rejected[0]["reason"]
