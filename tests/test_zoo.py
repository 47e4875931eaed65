"""Users' models, as users write them, learn on odtd's defaults from the first night.

The zoo (tests/make_keras_models.py ``--zoo``): the Keras tutorial's residual SeparableConv model
(logits), a Sequential CNN with Dropout and softmax, MobileNetV3Small with its own preprocessing,
EfficientNetB0, and a transfer-learning model with a frozen base, each trained with Adam on the
synthetic shapes (the "server") at 32x32, saved as ``.keras``. Each is imported as a user would
(``init --model-file --validation --replay``, the defaults: no policy given), then sessions run
on 64 images a day of a dusk camera: the first promotion must come by session 2 and the served
model must gain on the device's validation set. scripts/bench_zoo.py runs the same at the full
sizes, beside hand-picked recipes (docs/own-model.md), for all five.

MobileNetV3Small and EfficientNetB0 are left to the benchmark: at this test's scale they reach
27-30% (chance is 20%), a gain on 400 validation images is within its noise, and the two took
170 s of the suite's five minutes (a MobileNet's import, session and export is in test_byom.py).
"""

import json

import numpy as np
import pytest
from conftest import REPO, built_once, odtctl, odtctl_json, plain_python

from odtd.sim.datasets import synthetic, write_image_folder
from odtd.sim.shifts import get_shift

ZOO = ("tutorial_residual", "sequential_dropout", "transfer_frozen_base")
CLASSES = ["c0", "c1", "c2", "c3", "c4"]
SIZE, IMAGES, EPOCHS, WIDTH = 32, 480, 3, 0.25  # the server's training, scaled down


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """The replay seed (the server's images), validation and two days of a dusk camera."""
    def build(out):
        x, y = synthetic(1800, "server", seed=5)
        keep = y < len(CLASSES)
        x, y = x[keep], y[keep]
        write_image_folder(x[:200], y[:200], CLASSES, out / "replay")
        camera, y = get_shift("dusk")(x[200:], seed=0), y[200:]
        write_image_folder(camera[:400], y[:400], CLASSES, out / "validation")
        for day in (1, 2):
            begin = 400 + (day - 1) * 64
            write_image_folder(camera[begin:begin + 64], y[begin:begin + 64], CLASSES,
                               out / f"day{day}")

    return built_once(tmp_path_factory, "zoo-images", build)


def model_file(tmp_path_factory, name):
    """The zoo model's ``.keras`` file, trained once per test run (one build per model, so the
    pytest workers build them side by side)."""
    def build(out):
        proc = plain_python(str(REPO / "tests" / "make_keras_models.py"), str(out), "--zoo",
                            str(SIZE), str(IMAGES), str(EPOCHS), str(WIDTH), name, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    return built_once(tmp_path_factory, f"zoo-{name}", build) / f"{name}.keras"


@pytest.mark.trains
@pytest.mark.parametrize("name", ZOO)
def test_a_users_model_learns_on_the_defaults_by_the_second_night(images, tmp_path_factory,
                                                                  tmp_path, name):
    home = tmp_path / "home"
    summary = json.loads(odtctl(
        "init", "--model-file", str(model_file(tmp_path_factory, name)), "--classes",
        ",".join(CLASSES), "--validation", str(images / "validation"), "--replay",
        str(images / "replay"), "--no-check", "--json", home=home).stdout)
    # The Sequential CNN has no BatchNormalization: the recipe that trains its weights longer.
    assert summary["policy"]["recipe"] == (
        "new-camera-no-batchnorm.yaml" if name == "sequential_dropout" else "new-camera.yaml")
    sessions = []
    for day in (1, 2):
        odtctl("ingest", str(images / f"day{day}"), home=home)
        sessions.append(odtctl_json("train-now", "--foreground", "--force", home=home))
        if sessions[-1]["outcome"] == "promoted":
            break
    assert all(not s["reason"].startswith("training diverged") for s in sessions), sessions
    promoted = [s for s in sessions if s["outcome"] == "promoted"]
    assert promoted, [(s["outcome"], s["reason"]) for s in sessions]
    day0 = sessions[0]["accuracy_before"]
    assert promoted[0]["accuracy_after"] > day0, (day0, promoted[0]["accuracy_after"])
    assert np.isfinite(promoted[0]["accuracy_after"])
