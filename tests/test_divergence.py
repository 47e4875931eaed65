"""A model a user brings learns on the defaults: gradient clipping, a session that diverges and
trains again at a lower rate (remembered for the model), the policy check before the first
night, and the recipe ``init --model-file`` installs.

The model that diverges is tests/make_keras_models.py's ``exploding``: at a learning rate of 10
its first update overflows an exponential (the loss 1.09 -> 257,555); at 0.01 it trains.
"""

import pytest
from conftest import REPO, built_once, odtctl, odtctl_json, plain_python, write_images

from odtd.policy import recipe_for
from odtd.session.check import loss_trend

CLASSES = ["a", "b", "c"]
DIVERGES = "batch: {size: 8}\ntraining: {epochs: 2, optimizer: sgd, learning_rate: 10.0, " \
           "momentum: 0.9, clip_norm: null, %s}\n"


@pytest.fixture(scope="session")
def exploding(tmp_path_factory):
    def build(out):
        proc = plain_python(str(REPO / "tests" / "make_keras_models.py"), str(out), "exploding")
        assert proc.returncode == 0, proc.stderr[-3000:]

    return built_once(tmp_path_factory, "exploding-model", build) / "exploding.keras"


def _home(tmp_path, model, policy, *extra):
    """A home of ``model`` with ``policy`` installed by ``init --policy`` and a day of images."""
    (tmp_path / "policy.yaml").write_text(policy)
    home = tmp_path / "home"
    odtctl("init", "--model-file", str(model), "--classes", ",".join(CLASSES), "--no-check",
           "--policy", str(tmp_path / "policy.yaml"), *extra, home=home)
    write_images(tmp_path / "day1", per_class=8, classes=CLASSES, size=16)
    odtctl("ingest", str(tmp_path / "day1"), home=home)
    return home


def _steps(session):
    """The steps of a session's epochs over its samples (nothing diverged)."""
    samples = session["samples_new"] + session["samples_replay"]
    return session["epochs"] * -(-samples // session["batch_size"])


@pytest.mark.trains
@pytest.mark.parametrize("clip_norm, diverges", [(None, True), (0.01, False)])
def test_clipping_keeps_a_rate_that_diverges_without_it_training(exploding, tmp_path, clip_norm,
                                                                 diverges):
    policy = DIVERGES % "diverged_retries: 0"
    if clip_norm is not None:
        policy = policy.replace("clip_norm: null", f"clip_norm: {clip_norm}")
    session = odtctl_json("train-now", "--foreground", home=_home(tmp_path, exploding, policy))
    if diverges:
        assert session["outcome"] == "rolled_back"
        assert session["reason"].startswith(
            "training diverged at learning rate 10 (at step 1 the loss was not finite, or 100 "
            "times the first step's); lower training.learning_rate below 10 or set "
            "training.clip_norm (1.0 clips each step's gradient to norm 1) in the policy")
        assert session["steps"] == 2 and session["model_version_after"] == 0
    else:
        assert session["outcome"] == "promoted" and session["steps"] == _steps(session)
        assert "lr_attempts" not in session["details"]


@pytest.mark.trains
def test_a_diverged_session_trains_again_at_a_lower_rate_and_later_sessions_start_there(
        exploding, tmp_path):
    home = _home(tmp_path, exploding, DIVERGES % "diverged_retries: 2, diverged_lr_factor: 0.001")
    first = odtctl_json("train-now", "--foreground", home=home)
    assert first["outcome"] == "promoted"
    assert first["details"]["lr_attempts"] == [{"learning_rate": 10.0, "diverged_at_step": 1}]
    assert first["details"]["learning_rate"] == pytest.approx(0.01)
    assert first["steps"] == 2 + _steps(first)  # the diverged attempt's two, then all
    status = odtctl_json("status", home=home)["model"]["learning_rate"]
    assert status == {"rate": pytest.approx(0.01), "policy_rate": 10.0, "found_by": "session 1"}
    assert "learning rate 0.01: the policy's 10 diverged on this model (session 1)" in \
        odtctl("status", home=home).stdout
    assert "learning rate 0.01 (the policy's 10 diverged on this model; found by session 1)" in \
        odtctl("policy", "explain", home=home).stdout
    write_images(tmp_path / "day2", per_class=8, classes=CLASSES, size=16, seed=1)
    odtctl("ingest", str(tmp_path / "day2"), home=home)
    second = odtctl_json("train-now", "--foreground", home=home)
    assert second["details"]["learning_rate"] == pytest.approx(0.01)
    assert "lr_attempts" not in second["details"] and second["steps"] == _steps(second)
    # A new rate in the policy is the person's choice: sessions start there again.
    policy = home / "policy.yaml"
    policy.write_text(policy.read_text().replace("learning_rate: 10.0", "learning_rate: 0.02"))
    assert odtctl_json("status", home=home)["model"]["learning_rate"]["found_by"] is None


@pytest.mark.trains
def test_the_policy_check_reports_a_divergence_and_remembers_a_rate_that_trained(
        exploding, tmp_path):
    write_images(tmp_path / "seed", per_class=12, classes=CLASSES, size=16, seed=7)
    home = _home(tmp_path, exploding, DIVERGES % "diverged_retries: 0", "--replay",
                 str(tmp_path / "seed"))
    proc = odtctl("policy", "check", home=home, check=False)
    assert proc.returncode == 1
    assert proc.stdout.startswith("policy check: training diverged at learning rate 10 ")
    (tmp_path / "retry.yaml").write_text(DIVERGES % "diverged_retries: 1, diverged_lr_factor: 0.001")
    found = odtctl_json("policy", "check", str(tmp_path / "retry.yaml"), home=home)
    assert found["verdict"] == "warning" and found["learning_rate"] == pytest.approx(0.01)
    assert found["message"].startswith("policy check: training diverged at learning rate 10 and "
                                       "trained at 0.01 (loss ")
    assert found["source"] == "replay seed" and found["steps"] >= 16
    # Remembered only for the policy it was checked with: the home's (retries 0) is unchanged.
    assert odtctl_json("status", home=home)["model"]["learning_rate"]["found_by"] is None
    (home / "policy.yaml").write_text((tmp_path / "retry.yaml").read_text())
    odtctl("policy", "check", home=home)
    assert odtctl_json("status", home=home)["model"]["learning_rate"]["found_by"] == "policy check"
    session = odtctl_json("train-now", "--foreground", home=home)
    assert session["details"]["learning_rate"] == pytest.approx(0.01)
    assert "lr_attempts" not in session["details"]  # the first night starts at the rate found


@pytest.mark.trains
def test_init_installs_the_recipe_for_an_imported_model_and_checks_it(exploding, tmp_path):
    write_images(tmp_path / "seed", per_class=12, classes=CLASSES, size=16, seed=7)
    home = tmp_path / "home"
    proc = odtctl("init", "--model-file", str(exploding), "--classes", ",".join(CLASSES),
                  "--replay", str(tmp_path / "seed"), home=home)
    lines = proc.stdout.splitlines()
    # The model has no BatchNormalization layer: the recipe for such a model.
    assert lines[1] == (f"policy {home / 'policy.yaml'}: new-camera-no-batchnorm.yaml, the recipe "
                        "for a model without BatchNormalization that now sees through the "
                        "device's camera (imported with --model-file); --policy FILE installs "
                        "another")
    assert lines[2].startswith("policy check: ok, loss ") and " at learning rate 0.005" in lines[2]
    assert (home / "policy.yaml").read_text() == (
        REPO / "policies" / "new-camera-no-batchnorm.yaml").read_text()


def test_a_bad_policy_for_init_is_refused_before_anything_is_made(tmp_path):
    (tmp_path / "bad.yaml").write_text("training:\n  clip_norm: -1\n")
    home = tmp_path / "home"
    proc = odtctl("init", "--model", "tinycnn", "--policy", str(tmp_path / "bad.yaml"), home=home,
                  check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"Error: {tmp_path / 'bad.yaml'}: training.clip_norm=-1")
    assert not home.exists() or not any(home.iterdir())


def test_the_imported_models_recipe_is_policies_new_camera():
    assert recipe_for(imported=True).text == (REPO / "policies" / "new-camera.yaml").read_text()
    assert recipe_for(imported=True, batchnorm=False).text == (
        REPO / "policies" / "new-camera-no-batchnorm.yaml").read_text()
    assert recipe_for("densenet40").text == (REPO / "policies" / "densenet40.yaml").read_text()
    assert recipe_for("tinycnn").text == (REPO / "policies" / "default.yaml").read_text()


@pytest.mark.parametrize("losses, classes, expected", [
    ([1.0, 1.2, 0.9, 0.8, 0.6, 0.5], 3, (1.1, 0.55, False)),  # falling
    ([0.4, 0.5, 0.9, 1.2, 1.6, 1.6], 3, (0.45, 1.6, True)),    # rising: 1.6 > 1.2 x 0.45, > ln 3
    ([1.6, 1.6, 1.6, 1.6, 1.6, 1.6], 3, (1.6, 1.6, False)),    # flat
    # A model that fits its images, knocked from its minimum by the first steps: 0.87 is more
    # than 1.2 x 0.37 but well below a guess among 5 classes (ln 5 = 1.61). (The zoo's
    # Sequential CNN measured so, and gained 4 points on the camera in two sessions.)
    ([0.37, 0.37, 0.6, 0.8, 0.87, 0.87], 5, (0.37, 0.87, False)),
    ([], 3, (None, None, False)),
])
def test_the_check_calls_a_loss_rising_against_its_first_steps(losses, classes, expected):
    first, last, rising = loss_trend(losses, classes)
    assert (first, last, rising) == (pytest.approx(expected[0]) if expected[0] else None,
                                     pytest.approx(expected[1]) if expected[1] else None,
                                     expected[2])
