"""Dense blocks trained with their lean gradient: found in any DenseNet's graph, the same step.

TensorFlow runs in one child process: it builds small DenseNet-like models (a plain block and a
bottleneck block, as keras.applications' DenseNets have), the built-in DenseNet-40, and one
model with dropout inside a block; it reports what ``find_blocks`` finds and one training step's
gradients and BatchNorm statistics with and without ``recompute.Checkpointed``.
"""


import pytest
from conftest import bfloat16_refused, tensorflow_report

STEP = r"""
def step(model, forward, images, labels):
    # One SGD step's gradients as the worker takes them: a graph, statistics put back.
    statistics = [v for v in model.weights if "moving" in v.name]
    start = [np.array(v) for v in statistics]

    @tf.function(autograph=False)
    def gradients():
        with tf.GradientTape() as tape:
            logits = forward(images, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        saved = forward.save_statistics() if hasattr(forward, "save_statistics") else None
        grads = tape.gradient(loss, model.trainable_variables)
        if saved is not None:
            forward.restore_statistics(saved)
        return loss, grads

    loss, grads = gradients()
    moved = [np.array(v) for v in statistics]
    for variable, value in zip(statistics, start):
        variable.assign(value)
    return float(loss), [np.array(g) for g in grads], moved
"""

SCRIPT = r"""
import json
import numpy as np
import tensorflow as tf
from odtd.trainer.plans import dense_blocks, dense_chunks, recompute
from odtd.trainer.models import networks
from odtd.trainer.plans.fused_batchnorm import fuse
from odtd.trainer.models.imported import keras_major
from odtd.trainer.plans.pool_first import pool_first
from odtd.trainer.plans.precision import bfloat16_error
from odtd.trainer.worker.process import seed_everything

L = tf.keras.layers


def small(dropout=False, name="small", flip=()):
    # flip: the layers whose concatenation puts the new features first, as concat([f(x), x])
    inputs = tf.keras.Input((8, 8, 3))
    x = L.Conv2D(6, 3, padding="same", name="stem")(inputs)
    for i in range(3):  # BatchNorm, ReLU, 3x3 convolution; growth 4
        y = L.BatchNormalization(name="a%d_bn" % i)(x)
        y = L.Activation("relu", name="a%d_relu" % i)(y)
        if dropout and i == 1:
            y = L.Dropout(0.2, name="a%d_drop" % i)(y)
        y = L.Conv2D(4, 3, padding="same", name="a%d_conv" % i)(y)
        x = L.Concatenate(name="a%d_cat" % i)([y, x] if "a%d" % i in flip else [x, y])
    x = L.BatchNormalization(name="t_bn")(x)
    x = L.Activation("relu", name="t_relu")(x)
    x = L.Conv2D(9, 1, name="t_conv")(x)
    x = L.AveragePooling2D(2, name="t_pool")(x)
    for i in range(2):  # the bottleneck layer of DenseNet-121
        y = L.BatchNormalization(name="b%d_bn1" % i)(x)
        y = L.Activation("relu", name="b%d_relu1" % i)(y)
        y = L.Conv2D(8, 1, name="b%d_conv1" % i)(y)
        y = L.BatchNormalization(name="b%d_bn2" % i)(y)
        y = L.Activation("relu", name="b%d_relu2" % i)(y)
        y = L.Conv2D(4, 3, padding="same", name="b%d_conv2" % i)(y)
        x = L.Concatenate(name="b%d_cat" % i)([y, x] if "b%d" % i in flip else [x, y])
    x = L.BatchNormalization(name="f_bn")(x)
    x = L.Activation("relu", name="f_relu")(x)
    x = L.GlobalAveragePooling2D(name="f_pool")(x)
    return tf.keras.Model(inputs, L.Dense(3, name="logits")(x), name=name)


""" + STEP + r"""


def describe(blocks):
    return [dict(start=b.start._keras_history[0].name, units=[[l.name for l in u] for u in b.units],
                 tail=[l.name for l in b.tail], end=b.end._keras_history[0].name) for b in blocks]


seed_everything(tf, 0)  # tf.keras 2.6 has no set_random_seed
images = tf.random.uniform([6, 8, 8, 3], seed=2)
labels = tf.constant([0, 1, 2, 0, 1, 2], tf.int64)
report = {}
model = small()
report["small"] = describe(dense_blocks.find_blocks(tf, model))
report["pool_first"] = [[layer.name for layer in pool_first(block.tail)]
                        for block in dense_blocks.find_blocks(tf, model)]
checkpointed = recompute.Checkpointed(tf, model)
report["dense_blocks"] = checkpointed.dense_blocks
report["batchnorm"] = sorted(layer.name for layer in checkpointed.batchnorm)
plain = step(model, model, images, labels)
lean = step(model, checkpointed, images, labels)
report["losses"] = [plain[0], lean[0]]
report["gradient_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[1], lean[1]))
report["gradient_scale"] = max(float(np.max(np.abs(a))) for a in plain[1])
report["statistics_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[2], lean[2]))
report["statistics_moved"] = max(
    float(np.max(np.abs(a - np.array(v)))) for a, v in
    zip(plain[2], [v for v in model.weights if "moving" in v.name]))
# The same with Keras 3's BatchNormalization on the fused kernel, as the worker trains it
# (tf.keras 2 fuses by itself: nothing to patch there).
report["fused"] = fuse(tf, model)
report["keras"] = keras_major(tf)
plain, lean = step(model, model, images, labels), step(model, checkpointed, images, labels)
report["fused_gradient_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[1], lean[1]))
report["fused_statistics_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[2], lean[2]))
# A frozen first block (a head-only scope): nothing in it trains, the rest does as before.
for layer in model.layers:
    if layer.name.startswith(("a", "stem")):
        layer.trainable = False
frozen = recompute.Checkpointed(tf, model)
plain, lean = step(model, model, images, labels), step(model, frozen, images, labels)
report["frozen_gradients"] = len(plain[1])
report["frozen_gradient_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[1], lean[1]))
for layer in model.layers:
    layer.trainable = True
# Every BatchNorm frozen (the worker's freeze_bn): they normalise by their moving statistics, so
# the convolutions' biases, which a training BatchNorm after them cancels, get a gradient.
for layer in model.layers:
    layer.trainable = not isinstance(layer, L.BatchNormalization)
plain, lean = step(model, model, images, labels), step(model, checkpointed, images, labels)
report["frozen_bn_gradient_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[1], lean[1]))
report["frozen_bn_bias_gradient"] = min(float(np.max(np.abs(g))) for g, v in
                                        zip(plain[1], model.trainable_variables) if "bias" in v.name)
for layer in model.layers:
    layer.trainable = True
# A block without BatchNorm, frozen: it reads no variable the tape watches.
inputs = tf.keras.Input((8, 8, 3))
x = L.Conv2D(6, 3, padding="same", name="stem", trainable=False)(inputs)
for i in range(3):
    y = L.Activation("relu")(x)
    x = L.Concatenate()([x, L.Conv2D(4, 3, padding="same", trainable=False)(y)])
bare = tf.keras.Model(inputs, L.Dense(3)(L.GlobalAveragePooling2D()(x)))
plain, lean = step(bare, bare, images, labels), step(bare, recompute.Checkpointed(tf, bare), images, labels)
report["bare_gradient_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[1], lean[1]))
report["bare_blocks"] = recompute.Checkpointed(tf, bare).dense_blocks
# Only the first block within half the layers: the second runs plainly.
report["half_blocks"] = recompute.Checkpointed(tf, model, share=0.5).dense_blocks
report["dropout"] = describe(dense_blocks.find_blocks(tf, small(dropout=True, name="drop")))
# The new features first in some concatenations: the same blocks, the same step.
flipped = small(name="flipped", flip=("a1", "b0", "b1"))
flipped.set_weights(model.get_weights())
report["flipped"] = describe(dense_blocks.find_blocks(tf, flipped))
report["flipped_first"] = [b.first for b in dense_blocks.find_blocks(tf, flipped)]
plain = step(flipped, flipped, images, labels)
lean = step(flipped, recompute.Checkpointed(tf, flipped), images, labels)
report["flipped_losses"] = [plain[0], lean[0]]
report["flipped_gradient_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[1], lean[1]))
# Which layers (the tail last) can take their gradient a chunk of channels at a time, and how
# large their inputs are: the worker chunks those with at least half the largest input.
report["chunked"] = [[dense_chunks.split_head(layers) is not None
                      for layers in b.units + [pool_first(b.tail)]]
                     for b in dense_blocks.find_blocks(tf, model)]
report["input_sizes"] = [dense_blocks.input_sizes(b) for b in dense_blocks.find_blocks(tf, model)]
# Every layer chunked (the bottleneck's rest included), against the plain model.
default_share, recompute.CHUNKED_SHARE = recompute.CHUNKED_SHARE, 0.0
plain = step(model, model, images, labels)
lean = step(model, recompute.Checkpointed(tf, model), images, labels)
report["all_chunked_gradient_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[1], lean[1]))
report["all_chunked_statistics_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[2], lean[2]))
# LayerNormalization normalises across the channels: such layers take their gradient whole.
inputs = tf.keras.Input((8, 8, 3))
x = L.Conv2D(6, 3, padding="same")(inputs)
for i in range(3):
    y = L.LayerNormalization()(x) if i != 1 else L.BatchNormalization()(x)
    y = L.Conv2D(4, 3, padding="same")(L.Activation("relu")(y))
    x = L.Concatenate()([x, y])
normed = tf.keras.Model(inputs, L.Dense(3)(L.GlobalAveragePooling2D()(x)))
report["normed_chunked"] = [dense_chunks.split_head(layers) is not None
                            for layers in dense_blocks.find_blocks(tf, normed)[0].units]
plain = step(normed, normed, images, labels)
lean = step(normed, recompute.Checkpointed(tf, normed), images, labels)
report["normed_gradient_gap"] = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[1], lean[1]))
# In mixed_bfloat16 (what precision auto trains in on a CPU with bfloat16), every layer chunked
# (CHUNKED_SHARE is still 0) against every layer whole, relative to the largest gradient.
# (Against the plain model, recomputation in bfloat16 rounds differently wherever it runs: up
# to a quarter of a BatchNorm's gradient.)
report["tensorflow"], report["bfloat16_error"] = tf.__version__, bfloat16_error(tf)
if report["bfloat16_error"] is None:
    tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    half = small(name="half")
    half.set_weights(model.get_weights())
    fuse(tf, half)
    chunked = step(half, recompute.Checkpointed(tf, half), images, labels)
    split_head = dense_blocks.split_head
    dense_blocks.split_head = lambda layers: None
    whole = step(half, recompute.Checkpointed(tf, half), images, labels)
    dense_blocks.split_head = split_head
    report["bfloat16_gradient_gap"] = (
        max(float(np.max(np.abs(a - b))) for a, b in zip(chunked[1], whole[1]))
        / max(float(np.max(np.abs(a))) for a in whole[1]))
    tf.keras.mixed_precision.set_global_policy("float32")
recompute.CHUNKED_SHARE = default_share
report["densenet40"] = [len(b.units) for b in dense_blocks.find_blocks(
    tf, networks.build("densenet40", 10, [16, 16, 3]))]
print(json.dumps(report))
"""


@pytest.mark.trains
def test_dense_blocks_are_found_and_train_with_the_same_gradients_and_statistics():
    report = tensorflow_report(SCRIPT)
    first, second = report["small"]
    assert first == {"start": "stem", "end": "t_pool",
                     "units": [[f"a{i}_bn", f"a{i}_relu", f"a{i}_conv"] for i in range(3)],
                     "tail": ["t_bn", "t_relu", "t_conv", "t_pool"]}
    assert second["start"] == "t_pool" and second["end"] == "logits"
    assert second["units"][1] == ["b1_bn1", "b1_relu1", "b1_conv1", "b1_bn2", "b1_relu2",
                                  "b1_conv2"]
    assert second["tail"] == ["f_bn", "f_relu", "f_pool", "logits"]
    assert report["dense_blocks"] == 2 and report["half_blocks"] == 1
    # The transition's 1x1 convolution runs on the pooled image (the gradients below match the
    # plain model's, which convolves first); a tail without one stays as it is.
    assert report["pool_first"] == [["t_bn", "t_relu", "t_pool", "t_conv"],
                                    ["f_bn", "f_relu", "f_pool", "logits"]]
    assert len(report["batchnorm"]) == 3 + 1 + 4 + 1  # every BatchNorm is in a block or a tail
    # The same step: loss, every gradient, and the moving statistics moved once.
    assert report["losses"][0] == pytest.approx(report["losses"][1], rel=1e-6)
    assert report["gradient_gap"] < 1e-5 * max(1.0, report["gradient_scale"])
    assert report["statistics_moved"] > 1e-4  # the step did move them
    assert report["statistics_gap"] < 1e-6
    assert report["fused"] == (9 if report["keras"] >= 3 else 0)  # tf.keras 2 fuses by itself
    assert report["fused_gradient_gap"] < 1e-5 * max(1.0, report["gradient_scale"])
    assert report["fused_statistics_gap"] < 1e-6
    assert report["frozen_gradients"] == 4 + 2 * 8 + 4 and report["frozen_gradient_gap"] < 1e-5
    assert report["frozen_bn_bias_gradient"] > 1e-4 and report["frozen_bn_gradient_gap"] < 1e-5
    assert report["bare_blocks"] == 1 and report["bare_gradient_gap"] < 1e-6
    # Dropout inside the first block: a recomputation would draw another mask, so only the
    # second block is taken.
    assert [block["start"] for block in report["dropout"]] == ["t_pool"]
    assert report["densenet40"] == [12, 12, 12]
    # concat([f(x), x]) is a dense layer too, in any mix with concat([x, f(x)]).
    assert report["flipped"] == report["small"]
    assert report["flipped_first"] == [[False, True, False], [True, True]]
    assert report["flipped_losses"][0] == pytest.approx(report["flipped_losses"][1], rel=1e-6)
    assert report["flipped_gradient_gap"] < 1e-5 * max(1.0, report["gradient_scale"])
    # Every layer of the two blocks starts per channel, then a convolution or a Dense: each takes
    # its gradient a chunk of channels at a time (the gaps above are that gradient's).
    assert report["chunked"] == [[True] * 4, [True] * 3]
    assert report["input_sizes"] == [[8 * 8 * 6, 8 * 8 * 10, 8 * 8 * 14, 8 * 8 * 18],
                                     [4 * 4 * 9, 4 * 4 * 13, 4 * 4 * 17]]
    # At half the largest input (the default share) block 1's last two layers and its tail are
    # chunked, the rest taken whole: the gaps above. Every layer chunked, the same step:
    assert report["all_chunked_gradient_gap"] < 1e-5 * max(1.0, report["gradient_scale"])
    assert report["all_chunked_statistics_gap"] < 1e-6
    # LayerNormalization mixes the channels: its layers take the whole input, the same step.
    assert report["normed_chunked"] == [False, True, False]
    assert report["normed_gradient_gap"] < 1e-5 * max(1.0, report["gradient_scale"])
    # bfloat16 keeps 8 bits of mantissa (0.4%): the chunks sum a bottleneck's 1x1 convolution
    # in float32 from bfloat16 parts, so its recomputation rounds a little differently.
    if not bfloat16_refused(report):
        assert report["bfloat16_gradient_gap"] < 0.03


def test_chunk_spans_cover_the_parts_in_order_in_about_equal_widths():
    from odtd.trainer.plans.dense_chunks import chunk_spans

    # DenseNet40's widest layer input: 16 channels, then twelve layers' 12 each (160 in all).
    widths = [16] + [12] * 12
    spans = chunk_spans(widths)
    assert [p for span in spans for p in span] == list(range(13))  # every part once, in order
    assert len(spans) == 4
    # Each within one part's width of a quarter of the 160 channels.
    assert all(abs(sum(widths[p] for p in span) - 40) <= 12 for span in spans)
    assert chunk_spans([8]) == [[0]]  # one part: one chunk
    assert chunk_spans([100, 1, 1]) == [[0], [1], [2]]  # at most one chunk per part
    assert chunk_spans([3, 3], chunks=1) == [[0, 1]]
