"""The paper's CNN suite: catalogue counts, real Keras builds, and `init --input-size`.

TensorFlow runs in two child processes only: one builds every suite network, one is the worker
of a real `odtctl init`. The rest needs no TensorFlow.
"""

import json

import numpy as np
import pytest
from conftest import odtctl, tensorflow_report, write_images

from odtd.errors import ConfigError
from odtd.home.create import InitRequest, init_home
from odtd.home.paths import Home
from odtd.home.spec import builtin_input_shape, parse_input_size
from odtd.trainer.protocol import catalog

SUITE = ("squeezenet", "inceptionv1", "resnet50", "vgg16", "xception", "mobilenetv2",
         "densenet121")

# Each network in one process: (name, input shape, classes); every suite network once, at a
# non-square size just above its minimum, and two again at one channel (the stem's share).
BUILD_SCRIPT = """
import json
import tensorflow as tf
from odtd.trainer.protocol import catalog
from odtd.trainer.models import graph
from odtd.trainer.plans import dense_blocks, recompute
from odtd.trainer.models import networks

cases = [(name, [info.min_input_size, info.min_input_size + 8, 3], 7)
         for name, info in ((n, catalog.get(n)) for n in {suite!r})]
cases += [("squeezenet", [48, 40, 1], 3), ("vgg16", [40, 32, 1], 3)]
report = []
for name, shape, classes in cases:
    model = networks.build(name, classes, shape)
    images = tf.random.uniform([2] + shape, 0, 256, tf.int32, seed=1)
    logits = networks.forward(model, tf.cast(images, tf.uint8), "0-1", "logits", training=False)
    cuts = graph.valid_cuts(model)
    chosen = recompute.choose_cuts(cuts, len(model.layers))
    row = dict(name=name, shape=shape, classes=classes, params=int(model.count_params()),
               logits_shape=list(logits.shape), logits_dtype=logits.dtype.name,
               last_layer=model.layers[-1].name, finite=bool(tf.reduce_all(tf.math.is_finite(logits))),
               cuts=len(cuts), chosen=[model.layers[k].name for k in chosen],
               dense_blocks=[len(b.units) for b in dense_blocks.find_blocks(tf, model)])
    if name == "squeezenet" and shape[2] == 3:
        # No BatchNorm, no dropout: recomputed segments give the very gradients of the plain model.
        labels = tf.constant([1, 5], tf.int64)
        grads = []
        half = recompute.Checkpointed(tf, model, share=0.5)
        row["half_cuts"] = half.cuts
        row["all_cuts"] = recompute.Checkpointed(tf, model).cuts
        row["layers"] = len(model.layers)
        for forward in (model, recompute.Checkpointed(tf, model), half):
            with tf.GradientTape() as tape:
                out = networks.forward(forward, tf.cast(images, tf.uint8), "0-1", "logits", True)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, out))
            grads.append(tape.gradient(loss, model.trainable_variables))
        row["checkpointed_gradient_gap"] = max(
            float(tf.reduce_max(tf.abs(a - b))) for other in grads[1:]
            for a, b in zip(grads[0], other))
    report.append(row)
print(json.dumps(report))
"""


@pytest.mark.trains
def test_every_suite_network_builds_to_its_catalogue_count_with_logits_and_cuts():
    report = tensorflow_report(BUILD_SCRIPT.format(suite=SUITE))
    assert sorted({row["name"] for row in report}) == sorted(SUITE)
    for row in report:
        where = "{name} at {shape}".format(**row)
        assert row["params"] == catalog.param_count(row["name"], row["classes"], row["shape"]), where
        assert row["logits_shape"] == [2, row["classes"]], where
        assert row["logits_dtype"] == "float32" and row["last_layer"] == "logits", where
        assert row["finite"], where
        assert row["cuts"] > 0 and row["chosen"], where
        # keras.applications' DenseNet-121: four dense blocks of 6, 12, 24 and 16 bottleneck
        # layers; the others have none (Inception's and SqueezeNet's concatenations join
        # parallel branches, not a growing stack).
        assert row["dense_blocks"] == ([6, 12, 24, 16] if row["name"] == "densenet121" else []), where
    squeezenet = next(row for row in report if row.get("checkpointed_gradient_gap") is not None)
    assert squeezenet["checkpointed_gradient_gap"] < 1e-5
    assert "fire2_concat" in squeezenet["chosen"]
    # Half the network recomputed: the cuts in its first half only, the rest one plain segment.
    half, every = squeezenet["half_cuts"], squeezenet["all_cuts"]
    assert half == [k for k in every if k <= squeezenet["layers"] / 2] and 0 < len(half) < len(every)


def test_catalogue_counts_match_the_published_figures_at_1000_classes():
    # The ImageNet models' published sizes (keras.applications' table; SqueezeNet 1.1's from
    # torchvision): the same head, so the same count, with no TensorFlow involved.
    published = {"resnet50": 25_636_712, "xception": 22_910_480, "mobilenetv2": 3_538_984,
                 "densenet121": 8_062_504, "squeezenet": 1_235_496}
    for name, count in published.items():
        assert catalog.param_count(name, 1000) == count, name
    # VGG16 without its two 4096-unit layers: the 14,714,688 of include_top=False, plus the head.
    assert catalog.param_count("vgg16", 10) == 14_714_688 + 512 * 10 + 10
    assert 5_900_000 < catalog.param_count("inceptionv1", 10) < 6_100_000
    assert set(SUITE) | {"densenet40", "tinycnn"} == set(catalog.MODELS)
    assert catalog.get("xception").input_shape == (71, 71, 3)
    assert catalog.get("resnet50").input_shape == catalog.DEFAULT_INPUT_SHAPE


def test_input_size_parses_and_refuses_sizes_below_the_network_minimum(tmp_path):
    assert parse_input_size(None) is None
    assert parse_input_size("64") == (64, 64)
    assert parse_input_size("64x48") == (64, 48)
    assert parse_input_size("96X128") == (96, 128)
    for bad in ("0", "64x", "x64", "64x48x3", "-32", "big"):
        with pytest.raises(ConfigError, match=r"--input-size '.*': give HEIGHTxWIDTH"):
            parse_input_size(bad)
    assert builtin_input_shape("xception", None) == [71, 71, 3]
    assert builtin_input_shape("xception", (71, 100)) == [71, 100, 3]
    assert builtin_input_shape("tinycnn", (4, 4)) == [4, 4, 3]
    with pytest.raises(ConfigError, match=r"^--input-size: xception takes inputs of at least "
                                          r"71x71, got 64x80; give at least 71x71"):
        builtin_input_shape("xception", (64, 80))
    with pytest.raises(ConfigError, match=r"resnet50 takes inputs of at least 32x32, got 32x31"):
        builtin_input_shape("resnet50", (32, 31))

    # Refused before any worker runs: nothing is written.
    home = Home(tmp_path / "home")
    with pytest.raises(ConfigError, match="squeezenet takes inputs of at least 32x32, got 16x16"):
        init_home(home, InitRequest("squeezenet", ["a", "b"], input_size=(16, 16)))
    assert not home.is_initialised()
    # With --model-file it sizes a model whose input has none (tests/test_byom.py).

    proc = odtctl("init", "--model", "xception", "--input-size", "64", home=tmp_path / "cli",
                  check=False)
    assert proc.returncode != 0
    assert proc.stderr.splitlines() == [
        "Error: --input-size: xception takes inputs of at least 71x71, got 64x64; give at least "
        "71x71, or leave --input-size out for the default"]


@pytest.mark.trains
def test_init_input_size_is_the_homes_input_shape_for_workers_and_ingest(tmp_path):
    home = tmp_path / "home"
    summary = json.loads(odtctl("init", "--model", "squeezenet", "--input-size", "40x48",
                                "--classes", "cat,dog", "--json", home=home).stdout)
    assert summary["input_shape"] == [40, 48, 3]
    assert summary["param_count"] == catalog.param_count("squeezenet", 2)
    store = Home(home).open_store()
    try:
        assert store.meta("input_shape") == [40, 48, 3]
    finally:
        store.close()
    write_images(tmp_path / "in", per_class=1, classes=["cat", "dog"], size=32)
    odtctl("ingest", str(tmp_path / "in"), home=home)
    samples = sorted((home / "samples").rglob("*.npy"))
    assert samples and all(np.load(path).shape == (40, 48, 3) for path in samples)
