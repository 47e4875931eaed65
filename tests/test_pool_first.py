"""Pooling before a 1x1 convolution: which pairs swap in a model's graph, and the same step.

TensorFlow runs in one child process: it builds a functional model with a DenseNet transition,
a second pair with a 3x3 pooling of stride 2 and "same" padding (fewer pixels averaged at the
borders), a convolution with a ReLU (which does not commute with averaging) and a pair whose
input another branch also reads (no cut before it); then a Sequential model and a chain around a
nested model (an export's shape). It reports what ``PoolFirst`` swaps, the shapes the swapped
convolutions saw, one training step's loss, gradients and BatchNorm statistics with and without
it, and its output in inference.
"""

import pytest
from conftest import tensorflow_report
from test_dense_blocks import STEP

SCRIPT = r"""
import json
import numpy as np
import tensorflow as tf
from odtd.trainer.plans.pool_first import PoolFirst
from odtd.trainer.worker.process import seed_everything

L = tf.keras.layers


def functional():
    inputs = tf.keras.Input((12, 12, 3))
    x = L.Conv2D(6, 3, padding="same", name="stem")(inputs)
    x = L.BatchNormalization(name="t_bn")(x)
    x = L.Activation("relu", name="t_relu")(x)
    x = L.Conv2D(5, 1, name="t_conv")(x)  # with a bias: affine, not only linear
    x = L.AveragePooling2D(2, name="t_pool")(x)
    x = L.BatchNormalization(name="u_bn")(x)
    x = L.Activation("relu", name="u_relu")(x)
    x = L.Conv2D(7, 1, use_bias=False, name="u_conv")(x)
    x = L.AveragePooling2D(3, strides=2, padding="same", name="u_pool")(x)
    x = L.Conv2D(4, 1, activation="relu", name="v_conv")(x)
    x = L.AveragePooling2D(1, name="v_pool")(x)
    a = L.Conv2D(4, 1, name="w_conv")(x)
    a = L.AveragePooling2D(1, name="w_pool")(a)
    x = L.Add(name="w_add")([a, x])  # x is read beside the pair: no cut before w_conv
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return tf.keras.Model(inputs, L.Dense(3, name="logits")(x))


def seen_shapes(layer, shapes):
    # Record the shape of what the layer's call receives.
    call = layer.call

    def recording(tensor, *args, **kwargs):
        shapes.setdefault(layer.name, []).append([int(d) for d in tensor.shape[1:]])
        return call(tensor, *args, **kwargs)

    layer.call = recording


""" + STEP + r"""


def gap(first, second):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


seed_everything(tf, 0)  # tf.keras 2.6 has no set_random_seed
images = tf.random.uniform([6, 12, 12, 3], seed=2)
labels = tf.constant([0, 1, 2, 0, 1, 2], tf.int64)
report = {}
model = functional()
swapped = PoolFirst.of(tf, model)
report["swapped"] = swapped.swapped
shapes = {}
for name in ("t_conv", "u_conv", "v_conv"):
    seen_shapes(model.get_layer(name), shapes)
plain, pooled = step(model, model, images, labels), step(model, swapped, images, labels)
report["shapes"] = {name: list(seen) for name, seen in shapes.items()}
report["losses"] = [plain[0], pooled[0]]
report["gradient_gap"] = gap(plain[1], pooled[1])
report["gradient_scale"] = max(float(np.max(np.abs(a))) for a in plain[1])
report["statistics_gap"] = gap(plain[2], pooled[2])
report["statistics_moved"] = gap(plain[2], [v for v in model.weights if "moving" in v.name])
as_is = model(images, training=False)
shapes.clear()
report["inference_gap"] = float(np.max(np.abs(as_is - swapped(images, training=False))))
report["inference_shapes"] = {name: list(seen) for name, seen in shapes.items()}
sequential = tf.keras.Sequential([tf.keras.Input((8, 8, 3)), L.Conv2D(4, 1, name="s_conv"),
                                  L.AveragePooling2D(2, name="s_pool"), L.Flatten(),
                                  L.Dense(2, name="s_logits")])
report["sequential"] = PoolFirst.of(tf, sequential).swapped
inner_in = tf.keras.Input((8, 8, 3))
inner = tf.keras.Model(inner_in, L.AveragePooling2D(2, name="n_pool")(
    L.Conv2D(4, 1, name="n_conv")(L.Conv2D(4, 3, padding="same", name="n_stem")(inner_in))),
                       name="network")
outer_in = tf.keras.Input((8, 8, 3))
outer = tf.keras.Model(outer_in, L.Softmax(name="probs")(L.Dense(2, name="o_logits")(
    L.Flatten(name="o_flat")(inner(L.Rescaling(1 / 255.0, name="o_scale")(outer_in))))))
nested = PoolFirst.of(tf, outer)
report["nested"] = nested.swapped
probe = tf.random.uniform([2, 8, 8, 3], 0, 255, seed=3)
report["nested_gap"] = float(np.max(np.abs(outer(probe, training=True) - nested(probe))))
report["nothing"] = PoolFirst.of(tf, tf.keras.Sequential([
    tf.keras.Input((8, 8, 3)), L.Conv2D(4, 3), L.AveragePooling2D(2), L.Flatten(), L.Dense(2)]))
print(json.dumps(report))
"""


@pytest.mark.trains
def test_pooling_runs_before_a_pointwise_convolution_where_the_graph_allows_with_the_same_step():
    report = tensorflow_report(SCRIPT)
    # The transition and the "same"-padded pair swap; a convolution with a ReLU does not
    # commute with averaging, and a pair whose input another branch reads cannot run apart.
    assert report["swapped"] == ["t_conv", "u_conv"]
    # Each swapped convolution ran on the pooled image (12 -> 6, 6 -> 3), the others as before.
    assert report["shapes"]["t_conv"] == [[12, 12, 6], [6, 6, 6]]  # plain step, then pooled
    assert report["shapes"]["u_conv"] == [[6, 6, 5], [3, 3, 5]]
    assert report["shapes"]["v_conv"] == [[3, 3, 7], [3, 3, 7]]
    # The same step: loss, every gradient, and the BatchNorm statistics.
    assert report["losses"][0] == pytest.approx(report["losses"][1], rel=1e-6)
    assert report["gradient_gap"] < 1e-5 * max(1.0, report["gradient_scale"])
    assert report["statistics_moved"] > 1e-4  # the step did move them
    assert report["statistics_gap"] < 1e-6
    # Inference (scoring) pools first too, with the same output.
    assert report["inference_shapes"]["t_conv"] == [[6, 6, 6]]
    assert report["inference_shapes"]["u_conv"] == [[3, 3, 5]]
    assert report["inference_gap"] < 1e-5
    # A Sequential model, and a chain around a nested network (an exported model's shape).
    assert report["sequential"] == ["s_conv"]
    assert report["nested"] == ["n_conv"] and report["nested_gap"] < 1e-5
    assert report["nothing"] is None  # a 3x3 convolution: nothing to swap
