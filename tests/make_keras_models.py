"""Write the Keras model files the bring-your-own-model tests import: ``python THIS OUTDIR [NAME..]``.

Runs under Keras 3 and tf.keras 2 alike (it is the "server" that trained the user's model), in a
subprocess of its own, so the test process never imports TensorFlow. For each model it writes
``NAME.keras`` and ``NAME.h5`` and ``NAME.ref.npz`` (probe images and the model's outputs on
them), then prints a JSON line of what it wrote. tests/fixtures/keras/k2 and k3 hold the small
ones as tf.keras 2.15 and Keras 3.15 wrote them, so each stack's tests import the other's files
(``slash_names`` and ``slash_nested``: tf.keras 2's only).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras
L = keras.layers
OUT = sys.argv[1]
rng = np.random.default_rng(0)
if hasattr(keras.utils, "set_random_seed"):
    keras.utils.set_random_seed(0)
else:  # tf.keras 2.6 (make test-tx2's Python 3.6 stack) seeds each generator itself
    import random

    random.seed(0)
    np.random.seed(0)
    tf.random.set_seed(0)


def cnn_softmax():
    """A small CNN that scales its own pixels (Rescaling) and ends in softmax: 48x64 RGB, 4 classes."""
    inp = keras.Input((48, 64, 3), name="image")
    x = L.Rescaling(1.0 / 255, name="rescale")(inp)
    x = L.Conv2D(8, 3, name="conv1")(x)
    x = L.BatchNormalization(name="bn1")(x)
    x = L.ReLU(name="relu1")(x)
    x = L.MaxPooling2D(2, name="pool1")(x)
    x = L.Conv2D(8, 3, name="conv2")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    out = L.Dense(4, activation="softmax", name="probs")(x)
    return keras.Model(inp, out, name="cnn_softmax")


def gray_logits():
    """A model ending in logits (Dense without activation), grayscale 32x32, 3 classes; a
    BatchNorm inside a nested Sequential block."""
    block = keras.Sequential([L.Conv2D(6, 3, name="block_conv"), L.BatchNormalization(name="block_bn"),
                              L.ReLU(name="block_relu")], name="block")
    inp = keras.Input((32, 32, 1), name="image")
    x = L.Rescaling(1.0 / 127.5, offset=-1.0, name="rescale")(inp)
    x = block(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    out = L.Dense(3, name="logits")(x)
    return keras.Model(inp, out, name="gray_logits")


def mobilenet():
    """keras.applications.MobileNetV2 at 64x64, 5 classes, built offline (weights=None)."""
    return keras.applications.MobileNetV2(input_shape=(64, 64, 3), weights=None, classes=5)


def frozen_augmented():
    """The tutorial's model: random augmentation layers in a nested Sequential, then Rescaling;
    saved with ``trainable = False`` (as after transfer learning), 3 classes, 32x32 RGB."""
    augment = keras.Sequential([L.RandomFlip("horizontal", name="flip"),
                                L.RandomRotation(0.1, name="rotate"),
                                L.RandomZoom(0.1, name="zoom")], name="augmentation")
    inp = keras.Input((32, 32, 3), name="image")
    x = L.Rescaling(1.0 / 255, name="rescale")(augment(inp))
    x = L.Conv2D(8, 3, name="conv1")(x)
    x = L.BatchNormalization(name="bn1")(x)
    x = L.ReLU(name="relu1")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    out = L.Dense(3, activation="softmax", name="probs")(x)
    return keras.Model(inp, out, name="frozen_augmented")


def arithmetic():
    """Tensor arithmetic outside layers, as Keras's MobileNetV3 writes it.

    Pixels scaled by ``inputs / 255.0``, a hard sigmoid ``relu6(x + 3) * (1 / 6)`` gating a
    block, ``1 - x``, ``x * y``, ``x - y``, ``-x``, ``2 * x``; a convolutional head (1x1
    Conv2D, Flatten, softmax) and no Dense layer. 32x32 RGB, 4 classes.
    """
    inp = keras.Input((32, 32, 3), name="image")
    x = inp / 255.0
    x = L.Conv2D(8, 3, name="conv1")(x)
    x = L.BatchNormalization(name="bn1")(x)
    gate = L.ReLU(6.0, name="relu6")(x + 3.0) * (1.0 / 6.0)
    x = L.Multiply(name="gated")([x, gate])
    inverse = 1.0 - x
    x = (x * inverse - x) + (-x) * 2.0
    x = L.GlobalAveragePooling2D(keepdims=True, name="gap")(x)
    x = L.Conv2D(4, 1, name="logits")(x)
    out = L.Activation("softmax", name="probs")(L.Flatten(name="flat")(x))
    return keras.Model(inp, out, name="arithmetic")


def slash_names():
    """Layer names holding "/", as tf.keras 2's MobileNetV3 has them ("Conv/BatchNorm").

    Keras 3 allows none, so only tf.keras 2 writes this one. 16x16 RGB, 3 classes.
    """
    inp = keras.Input((16, 16, 3), name="image")
    x = L.Rescaling(1.0 / 255, name="pre/scale")(inp)
    x = L.Conv2D(4, 3, name="Conv/conv")(x)
    x = L.BatchNormalization(name="Conv/BatchNorm")(x)
    x = L.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inp, L.Dense(3, activation="softmax", name="Logits/dense")(x),
                       name="slash_names")


def slash_nested():
    """A base whose layer names hold "/" inside the user's model, as a transfer-learning head on
    tf.keras 2's MobileNetV3Small is built. 16x16 RGB, 3 classes; tf.keras 2's only."""
    base_in = keras.Input((16, 16, 3), name="base_in")
    x = L.Conv2D(4, 3, name="Conv/conv")(base_in)
    x = L.BatchNormalization(name="Conv/BatchNorm")(x)
    x = L.ReLU(name="Conv/relu")(x)
    y = L.Conv2D(4, 1, name="block/expand")(x)
    x = L.Add(name="block/Add")([x, y])
    base = keras.Model(base_in, x, name="MobilenetV3small")
    inp = keras.Input((16, 16, 3), name="image")
    x = L.Rescaling(1.0 / 255, name="rescale")(inp)
    x = L.GlobalAveragePooling2D(name="pool")(base(x))
    return keras.Model(inp, L.Dense(3, activation="softmax", name="head")(x), name="slash_nested")


def dialect_details():
    """Layers each Keras writes in its own way, and activations named alike that differ.

    A SeparableConv2D (tf.keras 2 writes its Conv base's unused kernel_* settings, which Keras 3
    refuses), an ``Activation("hard_sigmoid")`` (clip(0.2 x + 0.5) in tf.keras 2, clip(x / 6 +
    0.5) in Keras 3), a LeakyReLU layer (``alpha`` against ``negative_slope``) and, as each
    writes it: tf.keras 2 a bias initializer of TensorFlow's own (``tf.constant_initializer``,
    as its EfficientNetV2 has), Keras 3 the activations tf.keras 2 lacks (``hard_silu``,
    ``relu6``, ``leaky_relu``, ``silu``). Pixels scaled to -2..2, where the two hard sigmoids
    part. 16x16 RGB, 3 classes.
    """
    keras3 = int(tf.__version__.split(".")[1]) >= 16  # tf.keras is Keras 3 from TF 2.16
    inp = keras.Input((16, 16, 3), name="image")
    x = L.Rescaling(1.0 / 64, offset=-2.0, name="rescale")(inp)
    x = L.SeparableConv2D(6, 3, name="sep", **({} if keras3 else {"kernel_initializer": "he_normal"}))(x)
    x = L.Activation("hard_sigmoid", name="gate")(x)
    x = L.Conv2D(6, 1, name="mix")(x)
    x = L.LeakyReLU(name="leaky")(x)
    if keras3:
        for act in ("hard_silu", "relu6", "leaky_relu", "silu"):
            x = L.Activation(act, name=act + "_act")(L.Conv2D(6, 1, name=act + "_conv")(x))
    x = L.GlobalAveragePooling2D(name="pool")(x)
    bias = "zeros" if keras3 else tf.constant_initializer(0.1)
    out = L.Dense(3, activation="softmax", bias_initializer=bias, name="probs")(x)
    return keras.Model(inp, out, name="dialect_details")


def with_lambda():
    inp = keras.Input((16, 16, 3), name="image")
    x = L.Lambda(lambda t: t * 2.0, name="doubler")(inp)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inp, L.Dense(3, activation="softmax", name="probs")(x), name="lam")


@keras.utils.register_keras_serializable(package="userpkg")
class Tripler(L.Layer):
    def call(self, x):
        return x * 3.0


def with_custom_layer():
    inp = keras.Input((16, 16, 3), name="image")
    x = Tripler(name="tripler")(inp)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inp, L.Dense(3, activation="softmax", name="probs")(x), name="custom")


def vector_input():
    inp = keras.Input((20,), name="features")
    return keras.Model(inp, L.Dense(3, activation="softmax", name="probs")(inp), name="vector")


def four_channels():
    inp = keras.Input((16, 16, 4), name="image")
    x = L.GlobalAveragePooling2D(name="gap")(inp)
    return keras.Model(inp, L.Dense(3, activation="softmax", name="probs")(x), name="rgba")


TRAINABLE = {"cnn_softmax": cnn_softmax, "gray_logits": gray_logits, "mobilenet": mobilenet,
             "frozen_augmented": frozen_augmented, "arithmetic": arithmetic,
             "slash_names": slash_names, "slash_nested": slash_nested,
             "dialect_details": dialect_details}
REFUSED = {"lambda": with_lambda, "custom_layer": with_custom_layer, "vector_input": vector_input,
           "four_channels": four_channels}
KERAS2_ONLY = {"slash_names", "slash_nested"}  # Keras 3 allows no "/" in a layer's name
wanted = sys.argv[2:] or [name for name in list(TRAINABLE) + list(REFUSED)
                          if name not in KERAS2_ONLY or keras.__version__.startswith("2.")]
written = {}
for name in wanted:
    model = {**TRAINABLE, **REFUSED}[name]()
    if name in TRAINABLE:
        # A few steps of training, so the weights are not the initial ones.
        shape = model.input_shape[1:]
        x = rng.integers(0, 256, (32,) + tuple(shape)).astype("float32")
        y = rng.integers(0, model.output_shape[-1], 32)
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
            from_logits=name == "gray_logits"))
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        probe = x[:2]
        np.savez(os.path.join(OUT, name + ".ref.npz"), x=probe.astype(np.uint8),
                 y=model.predict(probe, verbose=0))
        if name == "frozen_augmented":
            model.trainable = False
    for suffix in (".keras", ".h5"):
        model.save(os.path.join(OUT, name + suffix))
    written[name] = {"input_shape": list(model.input_shape[1:]),
                     "classes": int(model.output_shape[-1])}
print(json.dumps(written))
