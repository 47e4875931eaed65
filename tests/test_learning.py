"""Replay plus guarded promotion against plain fine-tuning, with tinycnn on the synthetic drift data."""

import json
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, built_once, odtctl, odtctl_json, worker_config, worker_home, write_images

from odtd.home.create import InitRequest, init_home
from odtd.home.ingest import Ingestor, discover
from odtd.home.paths import Home
from odtd.home.versions import ModelRepo, file_sha256, rollback
from odtd.policy import load_policy
from odtd.report.status import render_status, status
from odtd.session.acceptance import paired_standard_error, refusal_reason
from odtd.session.runner import SessionRunner
from odtd.sim import datasets
from odtd.sim.simulate import DataSource, SimulationOptions, pretrain_base
from odtd.trainer.protocol.job import make_job
from odtd.trainer.protocol.launch import run_job

DAYS = 3


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory):
    """A tinycnn home pre-trained on server images; its fixed validation set is server images too."""
    def build(root: Path) -> None:
        home = Home(worker_home(root / "home"))
        options = SimulationOptions(model="tinycnn", pretrain_samples=1500, pretrain_epochs=6)
        init_home(home, InitRequest("tinycnn", list(datasets.CLASSES),
                                    validation_arrays=datasets.synthetic(400, "server", seed=77)))
        pretrain_base(home, DataSource(options), options, lambda message: None)
        shutil.copyfile(REPO / "policies" / "tinycnn-test.yaml", home.root / "policy.yaml")

    return Home(built_once(tmp_path_factory, "learning", build) / "home")


def _copy(home: Home, tmp_path: Path) -> Home:
    target = tmp_path / "home"
    shutil.copytree(home.root, target)
    return Home(target)


def test_guarded_replay_keeps_base_accuracy_while_plain_fine_tuning_forgets(pretrained, tmp_path):
    home = _copy(pretrained, tmp_path)
    store = home.open_store()
    runner = SessionRunner(home, store, worker_config(), load_policy(home.root / "policy.yaml"))
    ingestor = Ingestor.for_home(home, store)
    repo = ModelRepo(home.models, "tinycnn")
    plain = tmp_path / "plain.npz"
    shutil.copyfile(repo.weights_path(repo.current()), plain)
    validation = home.validation_file()
    tolerance = 0.01
    kept = []  # the served model's validation accuracy after each session
    for day in range(DAYS):
        x, y = datasets.synthetic(64, "device", seed=500 + day)
        with tempfile.TemporaryDirectory() as tmp:
            datasets.write_image_folder(x, y, datasets.CLASSES, Path(tmp), start_index=day * 64)
            ingestor.ingest(discover(Path(tmp), None), day=f"2026-01-0{day + 1}")
            np.savez(Path(tmp) / "day.npz", x=x, y=y)
            record = runner.run(trigger="simulate", day=f"2026-01-0{day + 1}")
            session = record.to_dict()
            assert session["outcome"] in ("promoted", "rolled_back")
            if session["outcome"] == "promoted":
                assert session["accuracy_after"] >= session["accuracy_before"] - tolerance
            kept.append(record.kept_accuracy)
            if day == 0:
                start = session["accuracy_before"]  # the base model, on the same validation set
            # Plain fine-tuning: every image, BatchNorm trained, no replay, no guard.
            job = make_job("train", "tinycnn", datasets.CLASSES, [32, 32, 3], weights_in=str(plain),
                           weights_out=str(Path(tmp) / "next.npz"),
                           train_data=str(Path(tmp) / "day.npz"), batch_size=4, epochs=3,
                           optimizer="sgd", learning_rate=0.05, momentum=0.9, seed=day,
                           # Scored after its last day, in the same run.
                           validation_data=str(validation) if day == DAYS - 1 else None)
            result, _, _ = run_job(worker_config().trainer.command(), job, Path(tmp) / "job")
            shutil.move(Path(tmp) / "next.npz", plain)
    guarded, forgot = kept[-1], result["accuracy_after"]
    store.close()
    print(f"base-validation accuracy: start {start:.3f}, guarded {guarded:.3f}, plain {forgot:.3f}")
    assert start > 0.3  # the pre-trained model is far above chance on its own domain
    assert guarded >= start - DAYS * tolerance
    assert forgot < start - 0.05, (start, guarded, forgot)


def test_worse_candidate_is_rolled_back_and_current_unchanged(pretrained, tmp_path):
    home = _copy(pretrained, tmp_path)
    policy = (home.root / "policy.yaml").read_text()
    policy = policy.replace("optimizer: sgd", "optimizer: adam").replace(
        "learning_rate: 0.01", "learning_rate: 5.0").replace("freeze_bn: true", "freeze_bn: false")
    (home.root / "policy.yaml").write_text(policy)
    store = home.open_store()
    repo = ModelRepo(home.models, "tinycnn")
    current, sha = repo.current(), file_sha256(repo.weights_path(repo.current()))
    x, y = datasets.synthetic(64, "device", seed=900)
    datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path / "imgs")
    Ingestor.for_home(home, store).ingest(discover(tmp_path / "imgs", None))
    session = SessionRunner(home, store, worker_config(),
                            load_policy(home.root / "policy.yaml")).run().to_dict()
    assert session["outcome"] == "rolled_back", session["reason"]
    assert session["accuracy_after"] < session["accuracy_before"] - 0.01
    assert repo.current() == current and file_sha256(repo.weights_path(current)) == sha
    assert session["model_version_after"] == current
    # The day's samples still enter the replay buffer, to be rehearsed later.
    assert session["details"]["replay_buffer"]["added"] == session["samples_new"]
    store.close()


def _policy(home: Home, training: str = "", acceptance: str = "", **replace: str) -> None:
    text = (REPO / "policies" / "tinycnn-test.yaml").read_text()
    for old, new in replace.items():
        text = text.replace(old.replace("__", " "), new)
    text = text.replace("training:\n", "training:\n" + training).replace(
        "acceptance:\n", "acceptance:\n" + acceptance)
    (home.root / "policy.yaml").write_text(text)


def _day(home: Home, store, tmp_path: Path, seed: int, progress=None) -> dict:
    x, y = datasets.synthetic(64, "device", seed=seed)
    datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path / f"imgs{seed}", start_index=seed)
    Ingestor.for_home(home, store).ingest(discover(tmp_path / f"imgs{seed}", None))
    return SessionRunner(home, store, worker_config(), load_policy(home.root / "policy.yaml"),
                         progress=progress).run().to_dict()


def test_refused_candidate_is_resumed_and_judged_against_current(pretrained, tmp_path):
    home = _copy(pretrained, tmp_path)
    # A recipe that wrecks the model: every candidate is refused; resume_within 100 keeps it.
    _policy(home, training="  resume_within: 100.0\n", acceptance="  confidence_z: 2.0\n",
            **{"optimizer: sgd": "optimizer: adam", "learning_rate: 0.01": "learning_rate: 5.0"})
    store = home.open_store()
    repo = ModelRepo(home.models, "tinycnn")
    current, sha = repo.current(), file_sha256(repo.weights_path(repo.current()))
    first = _day(home, store, tmp_path, 910)
    assert first["outcome"] == "rolled_back" and "standard error" in first["reason"]
    assert not first["details"]["resumed"] and first["details"]["kept_for_resume"]
    # The paired counts are of the validation set and add up to the two accuracies.
    paired = first["details"]["paired"]
    assert paired["samples"] == 400
    change = (first["accuracy_after"] - first["accuracy_before"]) * paired["samples"]
    assert paired["gained"] - paired["lost"] == round(change)
    kept = file_sha256(repo.resume_path)
    scored_before = 400 + len(store.samples("holdout"))
    messages = []
    second = _day(home, store, tmp_path, 911, progress=messages.append)
    job = json.loads((home.runs / f"session-{second['id']}" / "job.json").read_text())
    assert second["details"]["resumed"]
    # Current is unchanged: its results on the images scored yesterday come from the cache.
    assert job["eval_cache"] == str(repo.eval_cache_path)
    assert any(m.startswith(f"session {second['id']}: accuracy before training")
               and m.endswith(f", {scored_before} scored in an earlier session)") for m in messages)
    assert (job["weights_in"], job["served_weights"]) == (str(repo.resume_path),
                                                             str(repo.weights_path(current)))
    # Judged against current, not against the candidate it went on from.
    assert second["accuracy_before"] == first["accuracy_before"]
    assert second["outcome"] == "rolled_back" and file_sha256(repo.resume_path) != kept
    assert repo.current() == current and file_sha256(repo.weights_path(current)) == sha
    shown = status(home, store)["model"]["resume"]
    assert shown == {"session": second["id"], "accuracy": second["accuracy_after"],
                     "current_accuracy": first["accuracy_before"]}
    assert f"session {second['id']}'s refused candidate" in render_status(status(home, store))
    # A manual rollback forgets the resumable candidate: it descends from the version left.
    rollback(home, store, current)
    assert not repo.resume_path.exists() and status(home, store)["model"]["resume"] is None
    # resume_within 0: a candidate below current is dropped, the next session starts from current.
    _policy(home, training="  resume_within: 0.0\n",
            **{"optimizer: sgd": "optimizer: adam", "learning_rate: 0.01": "learning_rate: 5.0"})
    third = _day(home, store, tmp_path, 912)
    assert third["outcome"] == "rolled_back" and not third["details"]["resumed"]
    assert third["accuracy_after"] < third["accuracy_before"]
    assert not repo.resume_path.exists()
    store.close()


def test_promotion_clears_the_resumable_candidate(pretrained, tmp_path):
    home = _copy(pretrained, tmp_path)
    _policy(home, training="  resume_within: 100.0\n  lr_schedule: cosine\n",
            **{"tolerance: 1.0": "tolerance: 100.0"})
    store = home.open_store()
    repo = ModelRepo(home.models, "tinycnn")
    repo.resume_path.write_bytes(repo.weights_path(repo.current()).read_bytes())
    session = _day(home, store, tmp_path, 920)
    assert session["details"]["resumed"] and session["outcome"] == "promoted"
    job = json.loads((home.runs / f"session-{session['id']}" / "job.json").read_text())
    assert job["lr_schedule"] == "cosine"
    assert not repo.resume_path.exists()
    # The candidate's validation results became the eval cache: the new served model is not
    # scored again on the images its session scored it on.
    scored = 400 + len(store.samples("holdout"))
    messages = []
    _day(home, store, tmp_path, 921, progress=messages.append)
    assert any(m.endswith(f", {scored} scored in an earlier session)") for m in messages), messages
    store.close()


@pytest.mark.parametrize("gained, lost, z, tolerance, refused", [
    (0, 0, 2.0, 0.0, True),       # right and wrong on the same images: no gain clear of zero
    (0, 0, 2.0, 0.01, False),     # ...but within a 1-point tolerance, as a small loss would be
    (0, 0, 0.0, 0.0, False),      # measured as is: not below the served model
    (60, 40, 0.0, 0.0, False),    # +1 point, measured as is
    (40, 60, 0.0, 0.0, True),     # -1 point
    (40, 60, 0.0, 0.015, False),  # -1 point within a 1.5-point tolerance
    (55, 40, 2.0, 0.0, True),     # +0.75 points, but the standard error is 0.49: not clear of zero
    (60, 40, 2.0, 0.0, False),    # +1 point, standard error 0.4995: just clear
    (120, 20, 2.0, 0.0, False),   # +5 points, standard error 0.58: clear
    (40, 60, 2.0, 0.03, False),   # -1 - 2 x 0.5 points is above a 3-point tolerance
])
def test_refusal_rule(gained, lost, z, tolerance, refused):
    before = 0.6
    after = before + (gained - lost) / 2000
    paired = {"gained": gained, "lost": lost, "samples": 2000}
    assert (refusal_reason(before, after, tolerance, z, paired) is not None) == refused


def test_paired_standard_error_is_that_of_the_per_image_differences():
    differences = np.array([1] * 85 + [-1] * 68 + [0] * 1847)
    expected = differences.std() / np.sqrt(len(differences))
    assert paired_standard_error(85, 68, 2000) == pytest.approx(expected)


def test_the_reference_guard_refuses_a_candidate_that_forgets_the_original_domain(pretrained,
                                                                                  tmp_path):
    home = _copy(pretrained, tmp_path)
    # The original domain, held out as `init --replay` holds it out: server images.
    x, y = datasets.synthetic(200, "server", seed=78)
    np.savez(home.reference_file(), x=x, y=y)
    # A recipe that wrecks the model, and a validation gate that lets anything through: only the
    # reference guard stands between the candidate and the device.
    _policy(home, acceptance="  reference_tolerance: 5.0\n",
            **{"optimizer: sgd": "optimizer: adam", "learning_rate: 0.01": "learning_rate: 5.0",
               "tolerance: 1.0": "tolerance: 100.0"})
    store = home.open_store()
    repo = ModelRepo(home.models, "tinycnn")
    current = repo.current()
    session = _day(home, store, tmp_path, 930)
    details = session["details"]
    assert details["reference_paired"]["samples"] == 200
    assert details["reference_accuracy_after"] < details["reference_accuracy_before"] - 0.05
    assert session["outcome"] == "rolled_back"
    assert session["reason"].startswith("reference (original domain) accuracy")
    assert repo.current() == current
    store.close()


def test_progress_names_the_accuracy_of_each_evaluation_set():
    from odtd.session.runner import _accuracies

    assert _accuracies({"accuracy": 0.69, "by_group": {"0": 0.712, "1": 0.64, "2": 0.5}}) == (
        "71.2% on validation, 64.0% on the device hold-out, 50.0% on the reference")
    assert _accuracies({"accuracy": 0.703, "by_group": {}}) == "70.3%"


def _overflowing_model(path: Path) -> Path:
    """tests/fixtures/keras/k3/arithmetic.keras with its ``x * 2.0`` made ``x * inf``.

    The outputs and the first step's loss are not finite on every CPU. (With ``x * 1e30`` they
    were on an AMD EPYC, but an Intel Xeon's softmax saturated to one-hot and the loss stayed
    finite, at the clipping floor's.)
    """
    source = REPO / "tests" / "fixtures" / "keras" / "k3" / "arithmetic.keras"
    with zipfile.ZipFile(source) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(members["config.json"])
    doubled = [layer for layer in config["config"]["layers"] if layer["class_name"] == "Multiply"
               and 2.0 in layer["inbound_nodes"][0]["args"]]
    assert len(doubled) == 1
    doubled[0]["inbound_nodes"][0]["args"][1] = float("inf")
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


@pytest.mark.trains
def test_a_diverged_candidate_is_refused_even_by_a_guard_that_lets_anything_through(tmp_path):
    # A NaN model predicts the first class for every image, so a validation gate of 100 points
    # would promote it; the worker stops at the first non-finite loss and writes no
    # candidate, and the session keeps the served model.
    home = tmp_path / "home"
    odtctl("init", "--model-file", str(_overflowing_model(tmp_path / "overflow.keras")),
           "--classes", "a,b,c,d", home=home)
    write_images(tmp_path / "day", per_class=8, classes=["a", "b", "c", "d"])
    odtctl("ingest", str(tmp_path / "day"), home=home)
    text = (REPO / "policies" / "tinycnn-test.yaml").read_text()
    (home / "policy.yaml").write_text(text.replace("tolerance: 1.0", "tolerance: 100.0"))
    session = odtctl_json("train-now", "--foreground", home=home)
    assert session["outcome"] == "rolled_back", session["reason"]
    # At every rate the policy lets it retry at (the default two retries), then refused.
    assert session["reason"].startswith("training diverged at every learning rate tried (0.01, "
                                        "0.001, 0.0001) (at step 0 the loss was not finite")
    assert session["steps"] <= 3 and session["accuracy_after"] is None
    assert session["model_version_after"] == 0
    assert odtctl_json("status", home=home)["model"]["version"] == 0


def test_the_first_models_reference_results_are_kept_and_paired_with_later_candidates(
        pretrained, tmp_path):
    # A fresh home serves version 0, as `init --model-file` does (a simulation's pre-trained
    # base is version 1).
    home = Home(worker_home(tmp_path / "fresh"))
    init_home(home, InitRequest("tinycnn", list(datasets.CLASSES),
                                validation_arrays=datasets.synthetic(200, "server", seed=77)))
    x, y = datasets.synthetic(200, "server", seed=78)
    np.savez(home.reference_file(), x=x, y=y)
    # Validation lets every candidate through, so each is scored on the reference set too.
    _policy(home, acceptance="  reference_tolerance: 5.0\n", **{"tolerance: 1.0": "tolerance: 100.0"})
    store = home.open_store()
    repo = ModelRepo(home.models, "tinycnn")
    assert repo.current() == 0
    first = _day(home, store, tmp_path, 940)
    # The first session served version 0: its per-image results are kept, and only then.
    assert first["model_version_before"] == 0 and first["details"].get("reference_paired_origin") is None
    assert repo.origin_eval_cache_path.exists()
    kept = repo.origin_eval_cache_path.stat().st_mtime_ns
    second = _day(home, store, tmp_path, 941)
    details = second["details"]
    origin = details["reference_paired_origin"]
    assert origin["samples"] == 200
    # Paired counts add up to the two accuracies: the first model's (the first session's
    # reference_accuracy_before) and the candidate's.
    assert first["details"]["reference_accuracy_before"] + (origin["gained"] - origin["lost"]) / 200 \
        == pytest.approx(details["reference_accuracy_after"])
    if second["model_version_before"] == 0:  # the first was refused: the served model is the first
        assert origin == details["reference_paired"]
    assert repo.origin_eval_cache_path.stat().st_mtime_ns == kept  # kept once, never replaced
    store.close()


@pytest.mark.parametrize("lost_points, z, tolerance, refused", [
    (0.5, 0.0, 1.0, False),  # within the tolerance
    (2.0, 0.0, 1.0, True),   # beyond it, as measured
    (1.8, 2.0, 1.0, False),  # beyond it, but not by 2 standard errors (about 0.5 points here)
    (4.0, 2.0, 1.0, True),   # beyond it by more than 2 standard errors
])
def test_reference_refusal_rule(lost_points, z, tolerance, refused):
    from odtd.session.acceptance import reference_refusal

    samples, changed = 2000, 100  # 100 images change verdict between the two models
    lost = int((changed + lost_points / 100 * samples) / 2)
    paired = {"gained": changed - lost, "lost": lost, "samples": samples}
    before = 0.8
    after = before - (2 * lost - changed) / samples
    assert (reference_refusal(before, after, tolerance / 100, z, paired) is not None) == refused


@pytest.mark.parametrize("origin, refused", [
    (None, False),  # against the served model alone: 0.5 points lost, within 1
    (0.79, False),  # the first model scored lower than the current one: no stricter
    (0.804, False),  # 0.9 points below the first model
    (0.806, True),  # 1.1 points below it: the losses of two promotions add up
])
def test_reference_refusal_holds_the_first_models_accuracy_too(origin, refused):
    from odtd.session.acceptance import reference_refusal

    paired = {"gained": 40, "lost": 50, "samples": 2000}
    reason = reference_refusal(0.8, 0.795, 0.01, 1.5, paired, origin)
    assert (reason is not None) == refused
    assert reason is None or "the first model's 80.60%" in reason


@pytest.mark.parametrize("origin_lost, refused", [
    (4, False),   # 3 points below the first model, but 3 - 1.5 x 1.7 < 1: noise on 100 images
    (12, True),   # 11 points below it, 11 - 1.5 x 3.3 > 1: a real loss, paired or not
])
def test_the_first_models_check_allows_its_paired_standard_error(origin_lost, refused):
    from odtd.session.acceptance import reference_refusal

    served = {"gained": 1, "lost": 1, "samples": 100}  # the served model's own check passes
    origin_paired = {"gained": 1, "lost": origin_lost, "samples": 100}
    after = 0.91 - (origin_lost - 1) / 100
    reason = reference_refusal(after, after, 0.01, 1.5, served, 0.91, origin_paired)
    assert (reason is not None) == refused
    assert reason is None or "(standard error) points below it" in reason
    # Without the first model's results, the measured difference decides, as before.
    assert reference_refusal(after, after, 0.01, 1.5, served, 0.91) is not None


def test_the_choosers_judge_the_reference_as_the_guard_does():
    # A try of `auto` is held to the guard's rule, standard errors allowed: on 100 reference
    # images a 3-point loss is noise at z 1.5, and the measured rule would throw it away.
    from odtd.trainer.learning.evaluation import reference_check

    groups = np.array([0] * 50 + [2] * 100)
    served = np.ones(150, dtype=bool)
    served[50:59] = False  # 91% on the reference
    lose = served.copy()
    lose[59:62] = False  # 3 points lost
    evaluation = {"correct": lose}

    def spared(z, origin_correct=None, origin_accuracy=None):
        return reference_check(served, groups, "2", 0.01, z, origin_correct,
                               origin_accuracy)(evaluation)

    assert spared(1.5) and not spared(0.0)
    assert not spared(1.5, origin_accuracy=0.91)  # no per-image results: as measured
    origin = served[50:].copy()
    assert spared(1.5, origin, 0.91)  # paired with the first model: noise again
    origin[0:9] = True  # the first model got 100%: 12 points lost against it
    assert not spared(1.5, origin, 1.0)


def test_the_worker_holds_auto_to_the_higher_of_before_and_origin():
    from odtd.trainer.learning.judging import reference_held

    assert reference_held({"0": 0.5, "2": 0.7}, None) == 0.7
    assert reference_held({"0": 0.5, "2": 0.7}, 0.75) == 0.75
    assert reference_held({"0": 0.5, "2": 0.7}, 0.6) == 0.7
    assert reference_held({"0": 0.5}, 0.75) is None  # no reference group: nothing to hold
    assert reference_held(None, 0.75) is None
