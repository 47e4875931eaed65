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
import time

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
    """keras.applications.MobileNetV2 at its smallest (32x32, width 0.35), 5 classes, built
    offline (weights=None): the application's whole graph, at a fraction of its arithmetic."""
    return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                          classes=5)


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


def exploding():
    """Pixels scaled to 0..10, averaged, a Dense layer (zeros: it starts at exp(0)) and an
    exponential: at a learning rate of 10 the first step's update overflows the exponential
    (the loss 1.09 -> 257,555), at 0.01 it trains. 16x16 RGB, 3 classes, logits."""
    inp = keras.Input((16, 16, 3), name="image")
    x = L.Rescaling(1.0 / 25.5, name="rescale")(inp)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    x = L.Dense(8, kernel_initializer="zeros", name="hidden")(x)
    x = L.Activation("exponential", name="exp")(x)
    return keras.Model(inp, L.Dense(3, name="logits")(x), name="exploding")


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


# --- the zoo: models as users write them, trained briefly with Adam on a toy task -------------
# ``--zoo SIZE`` (after OUTDIR) builds them at SIZExSIZE and trains them on the built-in synthetic
# server images (odtd.sim.datasets, the first ZOO_CLASSES classes) scaled to that size: the
# server a user trained on before the device's camera saw anything. ``--width`` scales the
# tutorial's and the Sequential model's channels (1.0: as the tutorials write them).
ZOO_CLASSES = 5


def _width(channels, width):
    return max(4, int(round(channels * width)))


def tutorial_residual(size, classes, width):
    """Keras's "image classification from scratch": augmentation, Rescaling(1/255), a strided
    Conv2D, residual blocks of SeparableConv2D + BatchNormalization + MaxPooling2D with a 1x1
    strided Conv2D shortcut, GlobalAveragePooling2D, Dropout, a Dense layer giving logits."""
    augment = keras.Sequential([L.RandomFlip("horizontal"), L.RandomRotation(0.1)],
                               name="data_augmentation")
    inputs = keras.Input((size, size, 3))
    x = L.Rescaling(1.0 / 255)(augment(inputs))
    x = L.Conv2D(_width(128, width), 3, strides=2, padding="same")(x)
    x = L.BatchNormalization()(x)
    x = L.Activation("relu")(x)
    previous = x
    for channels in (256, 512, 728):
        channels = _width(channels, width)
        x = L.Activation("relu")(x)
        x = L.SeparableConv2D(channels, 3, padding="same")(x)
        x = L.BatchNormalization()(x)
        x = L.Activation("relu")(x)
        x = L.SeparableConv2D(channels, 3, padding="same")(x)
        x = L.BatchNormalization()(x)
        x = L.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = L.Conv2D(channels, 1, strides=2, padding="same")(previous)
        x = L.add([x, residual])
        previous = x
    x = L.SeparableConv2D(_width(1024, width), 3, padding="same")(x)
    x = L.BatchNormalization()(x)
    x = L.Activation("relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    x = L.Dropout(0.25)(x)
    return keras.Model(inputs, L.Dense(classes, activation=None)(x), name="tutorial_residual")


def sequential_dropout(size, classes, width):
    """TensorFlow's "image classification" tutorial: a Sequential CNN with Rescaling, three
    Conv2D + MaxPooling2D, Dropout, Flatten, Dense and a softmax output; no BatchNormalization.
    As the tutorial writes it at any ``width`` (it is small)."""
    return keras.Sequential([
        keras.Input((size, size, 3)),
        L.Rescaling(1.0 / 255),
        L.Conv2D(16, 3, padding="same", activation="relu"),
        L.MaxPooling2D(),
        L.Conv2D(32, 3, padding="same", activation="relu"),
        L.MaxPooling2D(),
        L.Conv2D(64, 3, padding="same", activation="relu"),
        L.MaxPooling2D(),
        L.Dropout(0.2),
        L.Flatten(),
        L.Dense(128, activation="relu"),
        L.Dense(classes, activation="softmax"),
    ], name="sequential_dropout")


def mobilenet_v3_small(size, classes, width):
    """keras.applications.MobileNetV3Small with its own preprocessing (include_preprocessing;
    its BatchNormalization momentum is 0.999), built offline (weights=None)."""
    return keras.applications.MobileNetV3Small(
        input_shape=(size, size, 3), weights=None, classes=classes, include_preprocessing=True)


def efficientnet_b0(size, classes, width):
    """keras.applications.EfficientNetB0 (its own Rescaling and Normalization in front), offline."""
    return keras.applications.EfficientNetB0(input_shape=(size, size, 3), weights=None,
                                             classes=classes)


def transfer_base(size, width):
    """A small convolutional base for ``transfer_frozen_base``: three Conv2D-BN-ReLU-pool blocks."""
    base_in = keras.Input((size, size, 3))
    x = base_in
    for index, channels in enumerate((_width(64, width), _width(128, width), _width(256, width))):
        x = L.Conv2D(channels, 3, padding="same", use_bias=False, name=f"conv{index}")(x)
        x = L.BatchNormalization(name=f"bn{index}")(x)
        x = L.ReLU(name=f"relu{index}")(x)
        x = L.MaxPooling2D(name=f"pool{index}")(x)
    return keras.Model(base_in, x, name="base")


def transfer_frozen_base(size, classes, width, base=None):
    """Transfer learning as Keras's guide writes it: a base trained first (as on ImageNet; here
    on the toy task, ``train_zoo_model``), frozen (``trainable = False``) and called with
    ``training=False`` under a new head (pooling, Dropout, Dense) that trains alone."""
    base = base or transfer_base(size, width)
    inputs = keras.Input((size, size, 3))
    x = L.Rescaling(1.0 / 127.5, offset=-1.0)(inputs)
    x = L.GlobalAveragePooling2D()(base(x, training=False))
    x = L.Dropout(0.2)(x)
    return keras.Model(inputs, L.Dense(classes, activation="softmax", name="head")(x),
                       name="transfer_frozen_base")


ZOO = {"tutorial_residual": tutorial_residual, "sequential_dropout": sequential_dropout,
       "mobilenet_v3_small": mobilenet_v3_small, "efficientnet_b0": efficientnet_b0,
       "transfer_frozen_base": transfer_frozen_base}


def server_images(size, count, seed):
    """The toy task's server images: synthetic shapes of the first ZOO_CLASSES classes, resized."""
    from odtd.sim.datasets import synthetic

    x, y = synthetic(count * 10 // ZOO_CLASSES + 10, "server", seed)
    keep = y < ZOO_CLASSES
    x, y = x[keep][:count], y[keep][:count]
    if size != x.shape[1]:
        x = tf.image.resize(x, (size, size)).numpy().round().clip(0, 255).astype("uint8")
    return x, y


def settle_batchnorm(model, x, batches=30, batch_size=32):
    """BatchNorm's moving statistics as a long training leaves them: the mean of the last batches'.

    A user's model trains for thousands of steps; a brief training leaves the moving statistics
    near their initial values (a variance of 0.47 where the batches' is 0.01, after 76 steps at
    Keras's momentum 0.99; MobileNetV3's is 0.999), and no user's model scores at chance in
    inference mode as such a model does. Forward passes in training mode at momentum 0.7
    meanwhile (0.7 ** 30: nothing of the initial values is left), no weight changes.
    """
    layers = [layer for layer in _leaves(model) if isinstance(layer, L.BatchNormalization)]
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.momentum = 0.7
    order = np.concatenate([rng.permutation(len(x)) for _ in range(batches * batch_size // len(x) + 1)])
    for begin in range(0, batches * batch_size, batch_size):
        model(tf.constant(x[order[begin:begin + batch_size]], tf.float32), training=True)
    for layer, momentum in zip(layers, momenta):
        layer.momentum = momentum


def _leaves(model):
    for layer in model.layers:
        if hasattr(layer, "layers"):
            yield from _leaves(layer)
        else:
            yield layer


def train_zoo_model(name, size, images, epochs, width):
    """Build a zoo model and train it as its user did: Adam, a few epochs, the toy task.

    Returns the model and its accuracy on the training images in inference mode."""
    x, y = server_images(size, images, seed=1)
    logits = name == "tutorial_residual"
    if name == "transfer_frozen_base":  # the base learns first (as on ImageNet), then the head
        base = transfer_base(size, width)
        inputs = keras.Input((size, size, 3))
        pretrained = keras.Model(inputs, L.Dense(ZOO_CLASSES, activation="softmax")(
            L.GlobalAveragePooling2D()(base(L.Rescaling(1.0 / 127.5, offset=-1.0)(inputs)))))
        pretrained.compile(keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
        pretrained.fit(x, y, epochs=epochs, batch_size=32, verbose=0)
        settle_batchnorm(pretrained, x)
        base.trainable = False
        model = transfer_frozen_base(size, ZOO_CLASSES, width, base)
    else:
        model = ZOO[name](size, ZOO_CLASSES, width)
    model.compile(keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=logits))
    model.fit(x, y, epochs=epochs, batch_size=32, verbose=0)
    settle_batchnorm(model, x)
    predicted = model.predict(x, batch_size=64, verbose=0).argmax(-1)
    return model, float((predicted == y).mean())


if len(sys.argv) > 3 and sys.argv[2] == "--zoo":
    # python make_keras_models.py OUTDIR --zoo SIZE [IMAGES EPOCHS WIDTH [NAME..]]
    size = int(sys.argv[3])
    images, epochs, width = (int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])) \
        if len(sys.argv) > 6 else (1000, 4, 1.0)
    written = {}
    for name in sys.argv[7:] or list(ZOO):
        started = time.time()
        model, accuracy = train_zoo_model(name, size, images, epochs, width)
        model.save(os.path.join(OUT, name + ".keras"))
        written[name] = {"input_shape": list(model.input_shape[1:]), "classes": ZOO_CLASSES,
                         "train_accuracy": accuracy, "params": int(model.count_params()),
                         "train_seconds": round(time.time() - started, 1)}
    print(json.dumps(written))
    sys.exit(0)


TRAINABLE = {"cnn_softmax": cnn_softmax, "gray_logits": gray_logits, "mobilenet": mobilenet,
             "frozen_augmented": frozen_augmented, "arithmetic": arithmetic,
             "slash_names": slash_names, "slash_nested": slash_nested,
             "dialect_details": dialect_details, "exploding": exploding}
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
            from_logits=name in ("gray_logits", "exploding")))
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
