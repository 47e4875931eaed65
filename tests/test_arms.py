"""The reproduction's arms and their comparison: choosing arms, paired differences over images
and seeds, joules per point, the run's rows, the scoring files (no worker); plain fine-tuning and
BatchNorm re-estimation, one worker job each (the reproduction's sliver runs the session arms)."""

import json
import shutil

import numpy as np
import pytest

from odtd.config import TelemetryConfig
from odtd.errors import ConfigError
from odtd.home.paths import Home
from odtd.session.acceptance import paired_standard_error
from odtd.sim import datasets
from odtd.sim.arms import ARMS, Day, ReplayPool, Trial, link_home, parse_arms
from odtd.sim.controls import AdaBnArm, PlainArm, PriorArm, TentArm
from odtd.sim.scoring import (
    VALIDATION_GROUP,
    RunLog,
    Scores,
    ScoringSets,
    combine_runs,
    paired_difference,
    per_validation_point,
)


def test_arms_by_name_or_letter_in_order_and_all_that_apply():
    assert parse_arms(None, shifted=True) == [arm for arm in ARMS if arm not in ("priors", "tent", "labels")]
    assert parse_arms("all", shifted=False) == ["odtd", "replay", "plain", "adabn", "none"]
    assert parse_arms("e, a,b", shifted=False) == ["odtd", "replay", "adabn"]
    assert parse_arms("none,plain", shifted=False) == ["plain", "none"]
    # The priors arm (g) applies where the device's classes are uneven.
    assert parse_arms(None, shifted=True, priors=True, uneven=True) == list(ARMS)
    assert "priors" not in parse_arms(None, shifted=True) and parse_arms("g", False) == ["priors"]
    # TENT (h) and labels only (i) in any scenario but the even, shuffled, labelled stream.
    assert parse_arms(None, shifted=False, uneven=True)[-2:] == ["tent", "labels"]
    assert "labels" not in parse_arms(None, shifted=True)


@pytest.mark.parametrize("text, shifted, message", [
    ("odtd,sepia", True, r"'sepia' is not an arm; use names or letters of odtd \(a\), replay \(b\)"),
    ("a,c", False, "the original domain is the device's without --shift"),
    ("clean,plain", True, "replay and clean repeat odtd's days with other images; add odtd"),
    (" , ", True, "no arm named"),
])
def test_bad_arms_say_why(text, shifted, message):
    with pytest.raises(ConfigError, match=message):
        parse_arms(text, shifted)


def test_one_run_paired_difference_is_the_acceptance_tests_standard_error():
    rng = np.random.default_rng(0)
    a, b = rng.random(400) < 0.6, rng.random(400) < 0.5
    gained, lost = int(np.sum(a & ~b)), int(np.sum(b & ~a))
    out = paired_difference(a, b)
    assert out["points"] == pytest.approx(100 * (a.mean() - b.mean()), abs=1e-3)
    assert out["se"] == pytest.approx(100 * paired_standard_error(gained, lost, 400), abs=1e-3)
    assert out["seeds"] == 1 and "se_seeds" not in out
    assert paired_difference(a, a) == {"points": 0.0, "se": 0.0, "seeds": 1}


def test_several_runs_pool_per_image_and_report_the_spread_between_runs():
    a = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0]], bool)
    b = np.array([[0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    out = paired_difference(a, b)
    per_image = (a.astype(float) - b).mean(axis=0)
    assert list(per_image) == pytest.approx([2 / 3, 0, 1 / 3, -1 / 3])
    assert out["points"] == pytest.approx(100 * per_image.mean(), abs=1e-3)
    assert out["se"] == pytest.approx(100 * per_image.std() / 2, abs=1e-3)
    per_run = np.array([0.25, 0.5, -0.25])
    assert out["se_seeds"] == pytest.approx(100 * per_run.std(ddof=1) / np.sqrt(3), abs=1e-3)
    assert out["seeds"] == 3


def test_per_validation_point_only_for_a_gain():
    assert per_validation_point(5000.0, 0.025) == 2000.0
    assert per_validation_point(5000.0, 0.0) is None and per_validation_point(5000.0, -0.01) is None
    assert per_validation_point(None, 0.02) is None and per_validation_point(100.0, None) is None


def scores(shifted, clean, full=False, validation=None):
    return Scores({"shifted": np.array(shifted, bool), "clean": np.array(clean, bool)}, full, validation)


def test_a_run_reports_the_subset_every_day_and_all_images_after_the_last():
    daily = np.array([0, 2])
    base = scores([1, 0, 0, 0], [1, 1, 0, 0], full=True, validation=0.50)
    run = RunLog(7, ["odtd", "plain", "none"], base, daily)
    # Day 0 is the base model on the daily subset, like every other day.
    assert run.rows[0]["arms"]["odtd"] == {"shifted": 0.5, "clean": 0.5, "validation": 0.5,
                                           "energy_j_total": 0.0}
    row = run.day(1, {"odtd": {"weights": "x", "energy_j": 300.0, "validation": 0.52, "outcome": "promoted"},
                      "plain": {"weights": "y", "energy_j": 100.0},
                      "none": {"weights": "z", "energy_j": 0.0}},
                  {"odtd": scores([1, 1], [1, 1]), "plain": scores([0, 0], [1, 0], validation=0.45),
                   "none": run._subset(base)})
    odtd, plain = row["arms"]["odtd"], row["arms"]["plain"]
    assert odtd == {"shifted": 1.0, "clean": 1.0, "energy_j": 300.0, "validation": 0.52,
                    "outcome": "promoted", "energy_j_total": 300.0, "joules_per_point": 150.0}
    assert plain["validation"] == 0.45 and plain["joules_per_point"] is None
    assert row["differences"]["odtd-plain"]["shifted"]["points"] == 100.0
    assert row["differences"]["odtd-none"]["clean"]["points"] == 50.0
    assert row["differences"]["odtd-none"]["shifted"]["points"] == 50.0
    last = run.day(2, {"odtd": {"weights": "x", "energy_j": 200.0, "validation": 0.55},
                       "plain": {"weights": "y", "energy_j": None},
                       "none": {"weights": "z", "energy_j": 0.0}},
                   {"odtd": scores([1, 1, 1, 0], [1, 1, 1, 0], full=True),
                    "plain": scores([0, 0, 0, 0], [1, 0, 0, 1], full=True, validation=0.6),
                    "none": base})
    assert last["arms"]["odtd"]["shifted"] == 1.0  # the subset of its scores on all images
    assert last["arms"]["odtd"]["energy_j_total"] == 500.0
    assert last["arms"]["odtd"]["joules_per_point"] == 100.0
    assert last["arms"]["plain"]["energy_j_total"] is None  # an unmeasured day: no total
    report = run.report()
    assert report["final"]["odtd"] == {"accuracy": {"shifted": 0.75, "clean": 0.75},
                                       "gain_points": {"shifted": 50.0, "clean": 25.0}}
    assert report["final_differences"]["odtd-plain"]["shifted"]["points"] == 75.0
    combined = combine_runs([run, run])
    assert combined["seeds"] == [7, 7]
    assert combined["arms"]["none"]["gain_points"] == {"shifted": 0.0, "clean": 0.0}
    two = combined["differences"]["odtd-plain"]["shifted"]
    assert two["points"] == 75.0 and two["se_seeds"] == 0.0 and two["seeds"] == 2


def test_a_scoring_file_makes_each_test_image_its_own_group(tmp_path):
    trial = Trial("tinycnn", list(datasets.CLASSES), [32, 32, 3], "fp32", tmp_path)
    x, y = datasets.synthetic(20, "server", seed=1)
    vx, vy = datasets.synthetic(5, "device", seed=2)
    tests = ScoringSets(trial, {"shifted": 255 - x, "clean": x}, y, np.array([3, 7]), (vx, vy))
    with np.load(tests._file(full=False, validation=True)) as data:
        assert np.array_equal(data["x"], np.concatenate([255 - x[[3, 7]], x[[3, 7]], vx]))
        assert np.array_equal(data["y"], np.concatenate([y[[3, 7]], y[[3, 7]], vy]))
        assert list(data["group"]) == [0, 1, 2, 3] + [VALIDATION_GROUP] * 5
    with np.load(tests._file(full=True, validation=False)) as data:
        assert len(data["y"]) == 40 and list(data["group"]) == list(range(40))
        assert data["offset"].all()  # a version's priors apply to every domain of one mix


def test_under_a_scenario_each_domain_has_its_images_and_the_priors_apply_to_the_devices(tmp_path):
    trial = Trial("tinycnn", list(datasets.CLASSES), [32, 32, 3], "fp32", tmp_path)
    x, y = datasets.synthetic(6, "server", seed=1)
    cx, cy = datasets.synthetic(6, "device", seed=2)
    vx, vy = datasets.synthetic(3, "device", seed=3)
    tests = ScoringSets(trial, {"device": x, "clean": cx}, {"device": y, "clean": cy},
                        np.arange(6), (vx, vy), offset_domains=("device", "validation"))
    with np.load(tests._file(full=True, validation=True)) as data:
        assert np.array_equal(data["y"], np.concatenate([y, cy, vy]))
        assert list(data["offset"]) == [True] * 6 + [False] * 6 + [True] * 3
    with pytest.raises(ValueError, match="as many test images"):
        ScoringSets(trial, {"device": x, "clean": cx[:4]}, {"device": y, "clean": cy[:4]},
                    np.arange(4), (vx, vy))


def test_the_replay_pool_lends_each_image_once(tmp_path):
    x, y = datasets.synthetic(30, "server", seed=3)
    datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path / "set" / "train")
    dataset = datasets.open_dataset(tmp_path / "set")
    pool = ReplayPool(dataset, np.arange(0, 30, 2), seed=1)
    first, _ = pool.take(10)
    second, _ = pool.take(5)
    whole, _ = dataset.load_arrays("train", np.arange(0, 30, 2))
    lent = {image.tobytes() for image in np.concatenate([first, second])}
    assert lent == {image.tobytes() for image in whole}
    with pytest.raises(ConfigError, match="has used 15 of the 15 replay seed images and needs 1 more"):
        pool.take(1)


def test_an_arms_home_links_the_samples_and_copies_the_rest(tmp_path):
    template = tmp_path / "template"
    (template / "samples" / "ab").mkdir(parents=True)
    (template / "samples" / "ab" / "abc.npy").write_bytes(b"pixels")
    (template / "odtd.db").write_bytes(b"db")
    home = link_home(template, tmp_path / "arm")
    assert (home.root / "samples" / "ab" / "abc.npy").stat().st_ino == \
        (template / "samples" / "ab" / "abc.npy").stat().st_ino
    assert (home.root / "odtd.db").stat().st_ino != (template / "odtd.db").stat().st_ino
    (home.root / "odtd.db").write_bytes(b"changed")
    assert (template / "odtd.db").read_bytes() == b"db"


def changed(before, after):
    with np.load(before) as a, np.load(after) as b:
        return {key for key in a.files if not np.array_equal(a[key], b[key])}


def test_plain_fine_tuning_trains_and_adabn_only_moves_batchnorm_statistics(home, tmp_path):
    from odtd.sim.shifts import SHIFTS
    from odtd.telemetry.meter import SessionEnergyMeter, running_sampler

    base = home / "models" / "tinycnn" / "v0" / "weights.npz"
    x, y = datasets.synthetic(24, "server", seed=8)
    day = Day(1, "2026-01-01", [f"{i}.png" for i in range(24)], SHIFTS["dusk"](x, seed=1), y, True)
    with running_sampler(TelemetryConfig(backend="estimate")) as sampler:
        trial = Trial("tinycnn", list(datasets.CLASSES), [32, 32, 3], "fp32", tmp_path,
                      meter=SessionEnergyMeter(sampler))
        plain = PlainArm(trial, base, tmp_path / "plain.npz", seed=0).day(day)
        adabn = AdaBnArm(trial, base, tmp_path / "adabn.npz", batch_size=8).day(day)
    assert plain["energy_j"] > 0 and adabn["energy_j"] > 0
    # w0000 stage1_conv/kernel ... w0003/w0004 stage1_bn moving mean/variance, w0008/w0009
    # stage2's, w0010/w0011 the logits (the manifest's weight_names).
    assert {"w0000", "w0003", "w0004", "w0010"} <= changed(base, plain["weights"])
    assert changed(base, adabn["weights"]) == {"w0003", "w0004", "w0008", "w0009"}
    with np.load(adabn["weights"]) as after:
        assert (after["w0004"] > 0).all()  # variances over the day's images


def test_the_priors_arm_keeps_the_devices_priors_as_an_offset_and_trains_nothing(home, tmp_path):
    base = home / "models" / "tinycnn" / "v0" / "weights.npz"
    x, y = datasets.synthetic(40, "server", seed=9)
    y = np.where(np.arange(40) < 32, 3, y)  # the device sees class 3 four times in five
    calibration = datasets.synthetic(20, "server", seed=10)
    day = Day(1, "2026-01-01", [f"{i}.png" for i in range(40)], x, y, False,
              unlabelled=datasets.synthetic(16, "device", seed=11)[0])
    trial = Trial("tinycnn", list(datasets.CLASSES), [32, 32, 3], "fp32", tmp_path)
    record = PriorArm(trial, base, tmp_path / "priors", calibration, (x[:10], y[:10]),
                      batch_size=8).day(day)
    assert changed(base, record["weights"]) == set()
    offset = json.loads((tmp_path / "priors" / "manifest.json").read_text())["logit_offset"]
    assert int(np.argmax(offset)) == 3
    # The images without a label reached the EM: counted, or set aside where their posteriors
    # disagree with the labels (the record says which).
    assert record["priors"]["labelled"] == 40
    assert record["priors"]["unlabelled"] + record["priors"]["set_aside"] == 16


def test_tent_trains_batchnorms_scale_and_offset_online_and_nothing_else(home, tmp_path):
    base = home / "models" / "tinycnn" / "v0" / "weights.npz"
    x, y = datasets.synthetic(24, "server", seed=12)
    trial = Trial("tinycnn", list(datasets.CLASSES), [32, 32, 3], "fp32", tmp_path)
    tent = TentArm(trial, base, tmp_path / "tent.npz", batch_size=8)
    more = datasets.synthetic(8, "device", seed=13)[0]
    first = tent.day(Day(1, "2026-01-01", [], x, y, False, unlabelled=more))
    # Gamma, beta and the moving statistics of both BatchNorm layers; no convolution, no logits.
    assert changed(base, first["weights"]) == {f"w{i:04d}" for i in (1, 2, 3, 4, 6, 7, 8, 9)}
    shutil.copyfile(first["weights"], tmp_path / "day1.npz")
    tent.day(Day(2, "2026-01-02", [], x[::-1].copy(), y, False))
    assert changed(tmp_path / "day1.npz", tent.weights)  # the next day goes on from the first's


def test_the_labels_arm_runs_odtd_on_the_labelled_images_with_the_label_free_options_off(home, tmp_path):
    """(i): the same recipe as (a) but prior_correction, pseudo_labels and bn_class_balanced,
    on the day's labelled images (shifted as (a)'s, some held out), none without a label."""
    from odtd.policy import load_policy
    from odtd.sim.arms import SessionArm, labels_only

    policy = load_policy(home / "policy.yaml")
    options = {"prior_correction": True, "pseudo_labels": 0.9, "bn_class_balanced": True}
    policy = policy.model_copy(update={"training": policy.training.model_copy(update=options)})
    recipe = labels_only(policy)
    assert (recipe.training.prior_correction, recipe.training.pseudo_labels,
            recipe.training.bn_class_balanced) == (False, None, False)
    assert recipe.training.model_dump(exclude=set(options)) == \
        policy.training.model_dump(exclude=set(options))
    (home / "policy.yaml").write_text(json.dumps(recipe.model_dump()))
    x, y = datasets.synthetic(40, "device", seed=12)
    day = Day(1, "2026-01-01", [f"{i}.png" for i in range(40)], x, y, True,
              unlabelled=datasets.synthetic(16, "device", seed=13)[0])
    trial = Trial("tinycnn", list(datasets.CLASSES), [32, 32, 3], "fp32", tmp_path)
    # No data set: a shifted day's images are written from its arrays, not extracted by name.
    arm = SessionArm("labels", trial, Home(home), None)
    try:
        record = arm.day(day)
        session = arm.store.sessions(limit=1)[0]
        held = len(arm.store.samples("holdout"))
    finally:
        arm.close()
    assert record["ingested"] == 40 and held > 0  # the labelled images only, some held out
    assert day.trained is None  # (a)'s record of what it trained on is (a)'s alone
    assert record["outcome"] in ("promoted", "rolled_back") and session.details.priors is None
