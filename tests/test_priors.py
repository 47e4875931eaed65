"""The device's class priors (``training.prior_correction``): EM, the worker's offset, the version.

The numpy part (calibration, EM) and a session's record run here; the worker's part is in
tests/test_worker.py (the real worker on tinycnn, the option on and off, the same images).
"""

import json
import shutil

import numpy as np
import pytest
from conftest import CLASSES as HOME_CLASSES
from conftest import odtctl, odtctl_json, write_images

from odtd.trainer.learning.evaluation import evaluate
from odtd.trainer.learning.judging import Validation
from odtd.trainer.learning.priors import (
    DISAGREEMENT_Z,
    better_offset,
    calibrate,
    carried_offset,
    correct_priors,
    disagreement,
    estimate_priors,
    logit_offset,
    refresh_served,
)


def _logits(rng, labels, classes, signal=2.5, noise=1.5):
    """Logits a noisy classifier gives images of ``labels``: its class's logit raised."""
    return signal * np.eye(classes)[labels] + noise * rng.standard_normal((len(labels), classes))


def test_em_recovers_a_skewed_prior_and_the_offset_raises_accuracy_on_it():
    rng = np.random.default_rng(0)
    classes = 10
    source_y = rng.integers(0, classes, 400)  # the reference set: evenly mixed
    device = rng.dirichlet([0.3] * classes)
    device_y = rng.choice(classes, 3000, p=device)
    target = _logits(rng, device_y, classes)
    estimate = logit_offset(_logits(rng, source_y, classes), source_y, np.array([], np.int64),
                            target, classes)
    assert np.abs(estimate.device - device).sum() < 0.3  # total variation below 0.15
    plain = np.mean(target.argmax(axis=1) == device_y)
    corrected = np.mean((target + estimate.offset).argmax(axis=1) == device_y)
    assert corrected > plain + 0.05, (plain, corrected)


def test_labelled_images_count_by_their_labels_and_unlabelled_ones_by_the_posteriors():
    source = np.full(3, 1 / 3)
    priors, steps = estimate_priors(np.zeros((0, 3)), np.array([0] * 8 + [1] * 2), source)
    assert steps == 1
    assert np.allclose(priors, np.array([9, 3, 1]) / 13.0)  # one pseudo-count per class
    # Unlabelled images the model is sure are class 2 move the estimate there.
    sure = np.tile([0.01, 0.01, 0.98], (40, 1))
    priors, _ = estimate_priors(sure, np.array([0] * 8 + [1] * 2), source)
    assert priors.argmax() == 2 and priors[2] > 0.7


def test_calibration_finds_the_temperature_of_overconfident_logits():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 5, 2000)
    logits = _logits(rng, y, 5)
    assert calibrate(logits, y).temperature == pytest.approx(1.0, abs=0.15)
    assert calibrate(4 * logits, y).temperature == pytest.approx(4.0, rel=0.15)


def test_without_calibration_images_the_labels_alone_set_the_offset():
    assert logit_offset(None, None, np.array([], np.int64), np.zeros((0, 3)), 3) is None
    estimate = logit_offset(None, None, np.array([0] * 8 + [1] * 2), np.zeros((0, 3)), 3)
    assert estimate.temperature == 1.0
    assert np.allclose(estimate.offset, np.log([9, 3, 1]) - np.log([9, 3, 1]).mean())


def test_a_served_offset_carried_to_new_priors_is_its_own_calibration_with_them():
    """The served offset moved to today's priors (``carried_offset``) is the offset its own
    calibration (temperature, biases) gives today's priors: only the priors change."""
    rng, classes = np.random.default_rng(11), 5
    source_y = rng.integers(0, classes, 300)
    calibration = (3.0 * _logits(rng, source_y, classes) + np.array([1.0, 0, 0, -1.0, 0]), source_y)
    day1, day2 = np.array([0] * 9 + [1] * 3 + [2]), np.array([0] * 30 + [1] * 4 + [3] * 6)
    first = logit_offset(*calibration, day1, np.zeros((0, classes)), classes)
    later = logit_offset(*calibration, np.concatenate([day1, day2]), np.zeros((0, classes)), classes)
    job = {"logit_offset": first.offset.tolist(), "logit_offset_priors": first.device.tolist(),
           "logit_offset_temperature": first.temperature}
    assert first.temperature == pytest.approx(3.0, rel=0.2)
    carried, basis = carried_offset(job, later.device.tolist())
    np.testing.assert_allclose(carried, later.offset, atol=1e-5)
    assert basis == {"priors": later.device.tolist(), "temperature": first.temperature}
    assert not np.allclose(later.offset, first.offset, atol=0.1)  # the priors did move
    no_basis = dict(job, logit_offset_priors=None, logit_offset_temperature=None)
    assert carried_offset(no_basis, later.device.tolist()) == (None, None)
    assert carried_offset(dict(job, logit_offset=None), later.device.tolist()) == (None, None)


def test_the_candidate_keeps_the_served_offset_carried_where_its_own_calibration_misleads():
    """A trained model's calibration, fitted on the reference images, can read the original
    domain otherwise than the device's camera shows it: here the model over-predicts class 0
    on the reference rows only, so its own estimate holds class 0 down, while the device sees
    mostly class 0. The served offset carried to today's priors (its calibration, the new
    labels' priors) scores highest and is kept, with its basis for the manifest."""
    classes, rng = 4, np.random.default_rng(12)
    y = np.array([0] * 30 + [1] * 6 + [2] * 2 + [3] * 2 + list(range(4)) * 5)
    groups = np.array(["0"] * 40 + ["2"] * 20)
    logits = _logits(rng, y, classes, signal=1.0, noise=1.5)
    logits[40:, 0] += 4.0  # the reference rows: class 0 over-predicted there alone
    x = np.arange(len(y), dtype=np.float32)[:, None]

    def eval_step(images, labels):
        rows = images[:, 0].astype(int)
        return np.zeros(len(rows)).view(_Array), logits[rows].copy().view(_Array)

    validation = Validation(x, y, groups, None, None, {"vector": None}, eval_step)
    job = {"prior_correction": True, "logit_offset": [0.0] * classes,
           "logit_offset_priors": [0.25] * classes, "logit_offset_temperature": 1.0,
           "eval_batch_size": 16, "batch_size": 16, "classes": ["a", "b", "c", "d"]}
    data = {"priors": {"labels": np.array([0] * 40 + [1] * 6 + [2] * 2 + [3] * 2),
                       "unlabelled": x[:0], "calibration": (x[:0], y[:0])}}
    fields = {}
    correct_priors(job, data, validation, lambda: False, fields)
    priors = fields["priors"]
    assert priors["calibrated_on"] == "reference" and priors["offset"] == "carried", priors
    scores = priors["offset_accuracy"]
    assert scores["carried"] > max(scores["candidate"], scores["served"]), scores
    expected = np.log(priors["device"]) - np.mean(np.log(priors["device"]))
    np.testing.assert_allclose(fields["logit_offset_after"], expected, atol=1e-5)
    assert fields["logit_offset_basis_after"] == {"priors": priors["device"], "temperature": 1.0}
    # Without what the served offset was estimated with there is nothing to carry.
    fields = {}
    correct_priors(dict(job, logit_offset_priors=None, logit_offset_temperature=None), data,
                   Validation(x, y, groups, None, None, {"vector": None}, eval_step),
                   lambda: False, fields)
    assert "carried" not in fields["priors"]["offset_accuracy"]


class _Array(np.ndarray):
    def numpy(self):
        return np.asarray(self)


def test_a_refresh_scores_the_device_images_anew_and_keeps_the_reference_rows_as_scored():
    """The served model with a new offset is run on the device's images only: the reference
    rows (no offset applies there) keep the served model's results, and the rest match a
    full scoring with the new offset."""
    classes, rng = 4, np.random.default_rng(7)
    y = np.array([0] * 30 + [1] * 6 + [2] * 2 + [3] * 2 + list(range(4)) * 5)
    groups = np.array(["0"] * 40 + ["2"] * 20)
    logits = _logits(rng, y, classes, signal=1.0, noise=1.5)
    x = np.arange(len(y), dtype=np.float32)[:, None]  # each image names its row
    ran = []

    def eval_step(images, labels):
        rows = images[:, 0].astype(int)
        ran.extend(rows.tolist())
        return np.zeros(len(rows)).view(_Array), logits[rows].copy().view(_Array)

    offset = {"vector": None}
    device = groups != "2"

    def score(cached=None):
        vector = offset["vector"]
        return evaluate(eval_step, x, y, classes, 16, lambda: False, groups, cached,
                        None if vector is None else (vector, device))

    validation = Validation(x, y, groups, score, None, offset, eval_step)
    before = score()
    job = {"logit_offset": None, "eval_batch_size": 16, "batch_size": 16,
           "classes": ["a", "b", "c", "d"]}
    data = {"priors": {"labels": np.array([0] * 40 + [1] * 8), "unlabelled": x[:0],
                       "calibration": (x[:0], y[:0])}}
    fields, ran[:] = {}, []
    refresh_served(job, data, validation, (before["correct"], before["losses"]), lambda: False,
                   fields)
    refresh = fields["prior_refresh"]
    # The first 20 rows run are the reference set the calibration reads; then the score's.
    assert ran[:20] == list(range(40, 60)) and set(ran[20:]) == set(np.flatnonzero(device))
    assert refresh["by_group"]["2"] == before["by_group"]["2"]
    offset["vector"] = np.asarray(refresh["logit_offset"], np.float32)
    assert refresh["by_group"]["0"] == score()["by_group"]["0"]
    assert refresh["by_group"]["0"] > before["by_group"]["0"]  # mostly class 0: the offset helps
    assert refresh["paired_by_group"]["2"] == {"gained": 0, "lost": 0, "samples": 20}
    assert refresh["acceptance"] == {"served": round(before["by_group"]["0"], 5),
                                     "refresh": round(refresh["by_group"]["0"], 5)}


def test_the_candidate_keeps_the_offset_it_scores_higher_with():
    """Of the candidate's own offset, the served version's and the served model's priors
    estimated anew, the one under which it scores highest on the acceptance group (only that
    group's images run)."""
    classes, rng = 4, np.random.default_rng(8)
    y = np.array([0] * 30 + [1] * 6 + [2] * 2 + [3] * 2 + list(range(4)) * 5)
    groups = np.array(["0"] * 40 + ["2"] * 20)
    logits = _logits(rng, y, classes, signal=1.0, noise=1.5)
    x = np.arange(len(y), dtype=np.float32)[:, None]
    ran = []

    def eval_step(images, labels):
        rows = images[:, 0].astype(int)
        ran.extend(rows.tolist())
        return np.zeros(len(rows)).view(_Array), logits[rows].copy().view(_Array)

    validation = Validation(x, y, groups, None, None, {"vector": None}, eval_step)
    job = {"eval_batch_size": 16, "batch_size": 16, "classes": ["a", "b", "c", "d"]}
    even = np.zeros(classes, np.float32)
    skewed = np.array([3.0, 0.0, -1.5, -1.5], np.float32)  # the acceptance group's mix
    accuracy = {name: float(np.mean(np.argmax(logits[:40] + vector, axis=1) == y[:40]))
                for name, vector in (("even", even), ("skewed", skewed))}
    assert accuracy["skewed"] > accuracy["even"]
    info = {}
    kept, basis = better_offset(job, validation, [("candidate", even, "c"), ("served", skewed, "s")],
                                lambda: False, info)
    assert kept is skewed and basis == "s"  # the kept offset's basis, for the manifest
    assert info == {"offset": "served", "offset_accuracy": {
        "candidate": round(accuracy["even"], 5), "served": round(accuracy["skewed"], 5)}}
    assert sorted(ran) == list(range(40))  # the reference rows did not run
    info = {}
    assert better_offset(job, validation, [("candidate", skewed, "c"), ("served", even, "s")],
                         lambda: False, info)[1] == "c"
    assert info["offset"] == "candidate"
    # A tie keeps the earlier; an offset the same as an earlier one, or none, is left out.
    kept, basis = better_offset(job, validation, [("candidate", skewed, "c"), ("served", None, "s"),
                                                  ("refresh", skewed.copy(), "r")], lambda: False, info)
    assert kept is skewed and basis == "c"
    assert info == {"offset": "candidate", "offset_accuracy": {"candidate": round(accuracy["skewed"], 5)}}
    # The same offset read back rounded to 6 decimals, as a version's offset travels (result
    # event, manifest, job), is the same: not scored twice under two names.
    thirds = skewed + np.float32(1.0 / 3.0)
    rounded = np.asarray([round(float(v), 6) for v in thirds], np.float32)
    assert not np.array_equal(rounded, thirds)
    kept, basis = better_offset(job, validation, [("refresh", rounded, "r"), ("carried", thirds, "k")],
                                lambda: False, info)
    assert basis == "r" and list(info["offset_accuracy"]) == ["refresh"]
    # The third (today's estimate on the served model) where it is the one that scores highest.
    kept, basis = better_offset(job, validation, [("candidate", even, "c"), ("served", even - 1.0, "s"),
                                                  ("refresh", skewed, "r")], lambda: False, info)
    assert kept is skewed and basis == "r"
    assert info["offset"] == "refresh"


def test_a_promoted_version_keeps_its_offset_in_its_manifest(home, tmp_path):
    policy = (home / "policy.yaml").read_text()
    (home / "policy.yaml").write_text(policy.replace("training:\n", "training:\n  prior_correction: true\n"))
    write_images(tmp_path / "day", per_class=2, seed=21)
    write_images(tmp_path / "day", per_class=24, classes=HOME_CLASSES[:1], seed=22)
    odtctl("ingest", str(tmp_path / "day"), home=home)
    odtctl("train-now", "--foreground", "--force", home=home)
    session = odtctl_json("history", home=home)[0]
    priors = session["details"]["priors"]
    # No reference set, no replay seed: the model is taken as calibrated on even classes.
    assert priors["status"] == "estimated" and priors["calibrated_on"] == "none", priors
    airplane = HOME_CLASSES.index("airplane")
    assert np.argmax(priors["device"]) == airplane  # the class the device sees most
    # The held-out images are mostly airplanes too: the candidate, scored with its offset, wins.
    assert session["outcome"] == "promoted", session["reason"]
    models = home / "models" / "tinycnn"
    current = (models / "current").read_text().strip()
    assert current == f"v{session['model_version_after']}"
    manifest = json.loads((models / current / "manifest.json").read_text())
    offset = manifest["logit_offset"]
    assert len(offset) == len(HOME_CLASSES) and np.argmax(offset) == airplane
    # What the kept offset was estimated with: the candidate's estimate or the served model's.
    kept = priors if priors["offset"] == "candidate" else session["details"]["prior_refresh"]["priors"]
    assert manifest["logit_offset_basis"] == {"priors": kept["device"],
                                              "temperature": kept["temperature"]}
    _check_the_export_carries_the_offset(home, models / current / "manifest.json", offset, tmp_path)
    # The next session has the served offset to carry to its own day's priors: more airplanes.
    write_images(tmp_path / "day2", per_class=1, seed=23)
    write_images(tmp_path / "day2", per_class=12, classes=HOME_CLASSES[:1], seed=24)
    odtctl("ingest", str(tmp_path / "day2"), home=home)
    odtctl("train-now", "--foreground", "--force", home=home)
    details = odtctl_json("history", home=home)[0]["details"]
    tried = set(details["priors"]["offset_accuracy"]) | set(
        ((details.get("prior_refresh") or {}).get("priors") or {}).get("offset_accuracy") or {})
    assert "carried" in tried, details


@pytest.mark.trains
def test_a_refused_candidate_leaves_the_served_model_with_its_priors_estimated_anew(home, tmp_path):
    # Training diverges (a rate no step survives), so the trained candidate is refused (without
    # the option the session is rolled back: tests/test_divergence.py). The served weights with
    # the device's priors (mostly airplanes) estimated anew score higher on the held-out
    # images and are served as a new version.
    policy = (home / "policy.yaml").read_text().replace("learning_rate: 0.01", "learning_rate: 10.0")
    policy = policy.replace("training:\n", "training:\n  clip_norm: null\n  diverged_retries: 0\n"
                            "  prior_correction: true\n")
    (home / "policy.yaml").write_text(policy)
    write_images(tmp_path / "day", per_class=2, seed=23)
    write_images(tmp_path / "day", per_class=30, classes=HOME_CLASSES[:1], seed=24)
    odtctl("ingest", str(tmp_path / "day"), home=home)
    odtctl("train-now", "--foreground", "--force", home=home)
    session = odtctl_json("history", home=home)[0]
    assert session["outcome"] == "promoted", session["reason"]
    assert session["reason"].startswith("the device's class priors estimated anew")
    assert "the trained candidate was refused (training diverged" in session["reason"]
    models = home / "models" / "tinycnn"
    assert session["accuracy_after"] > session["accuracy_before"]
    refresh = session["details"]["prior_refresh"]
    assert refresh["served"] and refresh["accuracy"] == session["accuracy_after"]
    assert refresh["candidate_accuracy"] is None or refresh["candidate_accuracy"] <= \
        session["accuracy_after"]
    assert np.argmax(refresh["priors"]["device"]) == HOME_CLASSES.index("airplane")
    before, after = session["model_version_before"], session["model_version_after"]
    assert after == before + 1
    old = json.loads((models / f"v{before}" / "manifest.json").read_text())
    new = json.loads((models / f"v{after}" / "manifest.json").read_text())
    assert new["sha256"] == old["sha256"] and new["parent"] == before  # the served weights
    assert np.argmax(new["logit_offset"]) == HOME_CLASSES.index("airplane")
    assert (models / "current").read_text().strip() == f"v{after}"
    # The served weights' cached results were scored with the old offset: the next session
    # scores the new version afresh.
    assert not (models / "eval-cache.npz").exists()


def test_the_served_model_with_new_priors_is_served_where_it_beats_an_accepted_candidate(home, tmp_path):
    # The worker scores the served weights with the device's priors estimated anew in every
    # session (``prior_refresh``). A candidate the guard accepts is still not served where that
    # scores higher on the acceptance group: the version is the served weights, the new offset.
    from odtd.home.paths import Home
    from odtd.home.versions import ModelRepo
    from odtd.policy import load_policy
    from odtd.session.promotion import Promotion
    from odtd.store.records import SessionRecord

    odtd_home = Home(home)
    store = odtd_home.open_store()
    repo = ModelRepo(home / "models", "tinycnn")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    offset = [0.9] + [-0.1] * (len(HOME_CLASSES) - 1)

    def conclude(refreshed_accuracy, priors=None):
        shutil.copyfile(repo.weights_path(repo.current()), job_dir / "candidate.npz")
        record = SessionRecord(day="2026-11-29", trigger="cli", model_version_before=repo.current(),
                               accuracy_before=0.5, accuracy_after=0.8)
        store.start_session(record)
        result = {"prior_refresh": {"logit_offset": offset,
                                    "priors": priors or {"status": "estimated"},
                                    "by_group": {"1": refreshed_accuracy}}}
        Promotion(odtd_home, store, repo, load_policy(home / "policy.yaml"),
                  lambda message: None).conclude(record, [], job_dir, result)
        return record

    try:
        below = conclude(0.75)  # the candidate (80%) beats the new priors: the candidate
        assert below.outcome == "promoted" and below.reason == "accepted"
        assert below.details.prior_refresh == {"accuracy": 0.75, "served": False,
                                               "priors": {"status": "estimated"}}
        assert repo.manifest(repo.current()).get("logit_offset") is None
        served_sha = repo.manifest(repo.current())["sha256"]
        above = conclude(0.85)  # the new priors (85%) beat the candidate: they are served
        assert above.outcome == "promoted", above.reason
        assert above.reason.startswith("the device's class priors estimated anew: the served "
                                       "model with them 85.00% vs 50.00%")
        assert above.reason.endswith("the trained candidate scored 80.00%")
        assert above.accuracy_after == 0.85
        assert above.details.prior_refresh["served"] and \
            above.details.prior_refresh["candidate_accuracy"] == 0.8
        assert above.details.prior_refresh["candidate_refusal"] is None
        manifest = repo.manifest(repo.current())
        assert manifest["sha256"] == served_sha and manifest["parent"] == below.model_version_after
        assert manifest["logit_offset"] == pytest.approx(offset)
        # Where the served offset was carried to the new priors (``carried_offset``), the reason
        # says so: the estimate's calibration did not make that offset.
        carried = conclude(0.9, {"status": "estimated", "offset": "carried"})
        assert carried.reason.startswith("the device's class priors estimated anew: the served "
                                         "model with its offset carried to them 90.00% vs 50.00%")
    finally:
        store.close()


def _check_the_export_carries_the_offset(home, manifest_path, offset, tmp_path):
    """The version's export, opened by plain Keras: its log-probabilities are those of the same
    weights exported without the offset, plus the offset (up to a constant per image)."""
    from test_byom import predict

    version = manifest_path.parent.name[1:]
    with_offset = odtctl_json("models", "export", version, "--out", str(tmp_path / "with.keras"),
                              home=home)
    assert with_offset["logit_offset"] == "in the last layer's bias"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({k: v for k, v in manifest.items() if k != "logit_offset"}))
    try:
        without = odtctl_json("models", "export", version, "--out", str(tmp_path / "without.keras"),
                              home=home)
    finally:
        manifest_path.write_text(json.dumps(manifest))
    assert without["logit_offset"] is None
    images = np.random.default_rng(5).integers(0, 255, (6, 32, 32, 3)).astype(np.float32)
    np.savez(tmp_path / "images.npz", x=images)
    plain, corrected = predict([(tmp_path / "without.keras", tmp_path / "images.npz"),
                                (tmp_path / "with.keras", tmp_path / "images.npz")])
    assert np.allclose(corrected.sum(axis=1), 1.0, atol=1e-5)
    moved = np.log(corrected) - np.log(plain)
    np.testing.assert_allclose(moved - moved.mean(axis=1, keepdims=True),
                               np.tile(np.asarray(offset) - np.mean(offset), (6, 1)), atol=1e-3)


@pytest.mark.trains
def test_unlabelled_images_reach_the_priors(home, tmp_path):
    # The labelled day is even; the images without a label go to the EM by their posteriors,
    # or are set aside where those disagree with the labels (the home's tiny model is far from
    # calibrated on these images: ``disagreement`` decides, and the record says which).
    policy = (home / "policy.yaml").read_text()
    (home / "policy.yaml").write_text(policy.replace("training:\n", "training:\n  prior_correction: true\n"))
    write_images(tmp_path / "day", per_class=3, seed=31)
    odtctl("ingest", str(tmp_path / "day"), home=home)
    write_images(tmp_path / "seen", per_class=5, seed=32)
    report = odtctl_json("ingest", "--unlabelled", str(tmp_path / "seen"), home=home)
    assert report["unlabelled"] == 5 * len(HOME_CLASSES)
    odtctl("train-now", "--foreground", "--force", home=home)
    priors = odtctl_json("history", home=home)[0]["details"]["priors"]
    assert priors["status"] == "estimated", priors
    assert priors["unlabelled"] + priors["set_aside"] == 5 * len(HOME_CLASSES), priors
    assert priors["disagreement_z"] is not None  # the posteriors were computed and tested
    if priors["set_aside"]:
        assert priors["disagreement_z"] > DISAGREEMENT_Z and priors["em_steps"] == 1
    else:
        assert priors["em_steps"] > 1  # the posteriors of the images without a label were iterated


def test_earlier_days_images_count_by_their_labels_where_the_train_file_has_them(tmp_path):
    """The device's earlier images come with their labels (``device_y``): the priors' EM counts
    them by those, not by the model's posteriors, which a model trained elsewhere (a fleet's
    global weights) can skew; without ``device_y`` they are counted by the posteriors."""
    from odtd.trainer.worker.data import load_prior_data

    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (6, 4, 4, 3), dtype=np.uint8)
    y = np.array([1, 1, 2, 0, 0, 0])
    mask = np.array([True, True, True, False, False, False])  # the session's 3; 3 rehearsed
    earlier = rng.integers(0, 255, (4, 4, 4, 3), dtype=np.uint8)
    without = rng.integers(0, 255, (2, 4, 4, 3), dtype=np.uint8)
    path = tmp_path / "train.npz"
    np.savez(path, device_x=earlier, device_y=np.array([3, 3, 3, 1]), unlabelled_x=without)
    data = load_prior_data(str(path), x, y, mask)
    assert sorted(data["labels"].tolist()) == [1, 1, 1, 2, 3, 3, 3]
    assert data["session_labelled"] == 3
    assert np.array_equal(data["unlabelled"], without)
    assert np.array_equal(data["unlabelled_x"], without)
    assert np.array_equal(data["calibration"][1], [0, 0, 0])
    np.savez(path, device_x=earlier, unlabelled_x=without)  # an older daemon's file: no labels
    data = load_prior_data(str(path), x, y, mask)
    assert sorted(data["labels"].tolist()) == [1, 1, 2]
    assert np.array_equal(data["unlabelled"], np.concatenate([earlier, without]))


def test_labels_drawn_from_a_mix_agree_with_it_and_labels_from_another_do_not():
    rng = np.random.default_rng(3)
    mix = rng.dirichlet([0.5] * 10)
    agreeing = [disagreement(rng.choice(10, 300, p=mix), mix) for _ in range(200)]
    assert np.mean(np.array(agreeing) > DISAGREEMENT_Z) < 0.02  # about 0.1% by construction
    other = rng.dirichlet([0.5] * 10)
    assert disagreement(rng.choice(10, 300, p=other), mix) > DISAGREEMENT_Z


def test_posteriors_that_disagree_with_the_labels_are_set_aside():
    """A camera's shift leaves the model's posteriors uncalibrated: here they favour class 0 on
    every image. With the device's labels drawn from its true mix, EM would follow the many
    unlabelled images; the labels disagree with them, so the labels alone set the priors."""
    rng = np.random.default_rng(4)
    classes = 5
    mix = np.array([0.1, 0.4, 0.3, 0.1, 0.1])
    labels = rng.choice(classes, 200, p=mix)
    truth = rng.choice(classes, 2000, p=mix)
    skewed = _logits(rng, truth, classes) + 3.0 * np.eye(classes)[0]
    source_y = rng.integers(0, classes, 400)
    calibration = (_logits(rng, source_y, classes), source_y)
    estimate = logit_offset(*calibration, labels, skewed, classes)
    assert estimate.disagreement_z > DISAGREEMENT_Z
    assert (estimate.set_aside, estimate.unlabelled) == (2000, 0)
    assert np.abs(estimate.device - mix).max() < 0.06  # the labels' mix, not class 0
    # Posteriors as calibrated as the reference's agree with the labels: both count.
    calibrated = logit_offset(*calibration, labels, _logits(rng, truth, classes), classes)
    assert calibrated.disagreement_z < DISAGREEMENT_Z
    assert (calibrated.set_aside, calibrated.unlabelled) == (0, 2000)
    assert np.abs(calibrated.device - mix).max() < 0.06
