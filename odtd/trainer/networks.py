"""Keras model builders for the trainer worker (imports TensorFlow; never import from the daemon).

Conventions shared by every model here, and relied on by the worker and the benchmarks:

- Input: float32 images of shape (height, width, channels) with values in [0, 1]. Samples are
  stored as uint8; ``preprocess`` (``x / 255``) is the one conversion, used for training,
  evaluation and benchmarks alike.
- Output: logits (no softmax in the model). The last Dense layer is float32 even under a mixed
  precision policy, so the loss is computed in float32.
- Convolutions have no bias and ``he_normal`` initialisation; no weight decay is built in.
- Layers carry explicit names, so weight names (the worker's ``weight_names``) are stable across
  processes and TensorFlow versions.

Only ``tf.keras`` APIs common to tf.keras 2 (TF <= 2.15) and Keras 3 are used. The architectures'
shape constants live in ``odtd.trainer.catalog``, which computes parameter counts without
TensorFlow.
"""

from typing import Optional, Sequence

import tensorflow as tf

from odtd.trainer import catalog

layers = tf.keras.layers


def preprocess(images: tf.Tensor) -> tf.Tensor:
    """Convert stored uint8 images to model input.

    Args:
        images: uint8 tensor (batch, height, width, channels).

    Returns:
        float32 tensor of the same shape with values in [0, 1].
    """
    return tf.cast(images, tf.float32) * (1.0 / 255.0)


def _conv(filters: int, kernel_size: int, name: str) -> layers.Layer:
    return layers.Conv2D(
        filters,
        kernel_size,
        padding="same",
        use_bias=False,
        kernel_initializer="he_normal",
        name=name,
    )


def _bn_relu(x: tf.Tensor, name: str) -> tf.Tensor:
    x = layers.BatchNormalization(name=name + "_bn")(x)
    return layers.Activation("relu", name=name + "_relu")(x)


def _classifier(x: tf.Tensor, num_classes: int) -> tf.Tensor:
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    # float32 logits under mixed precision: softmax cross-entropy in float16 overflows.
    return layers.Dense(num_classes, dtype="float32", name="logits")(x)


def densenet40(
    num_classes: int, input_shape: Sequence[int] = catalog.DEFAULT_INPUT_SHAPE
) -> tf.keras.Model:
    """Build DenseNet-40 (depth 40, growth 12, no bottleneck or compression), ~1.0 M weights.

    A 16-filter 3x3 stem convolution, three dense blocks of 12 BN-ReLU-Conv3x3 layers whose
    outputs are concatenated to their inputs, transitions BN-ReLU-Conv1x1 (channel count kept)
    with 2x2 average pooling between blocks, then BN-ReLU, global average pooling and a Dense
    layer giving logits.

    Args:
        num_classes: Output size.
        input_shape: (height, width, channels); height and width at least 4.

    Returns:
        An uncompiled functional Keras model.
    """
    inputs = tf.keras.Input(shape=tuple(input_shape), name="image")
    x = _conv(catalog.DENSENET40_STEM_FILTERS, 3, "stem_conv")(inputs)
    channels = catalog.DENSENET40_STEM_FILTERS
    for block in range(1, catalog.DENSENET40_BLOCKS + 1):
        for layer in range(1, catalog.DENSENET40_LAYERS_PER_BLOCK + 1):
            name = "block{}_layer{:02d}".format(block, layer)
            y = _bn_relu(x, name)
            y = _conv(catalog.DENSENET40_GROWTH, 3, name + "_conv")(y)
            x = layers.Concatenate(name=name + "_concat")([x, y])
            channels += catalog.DENSENET40_GROWTH
        if block < catalog.DENSENET40_BLOCKS:
            name = "transition{}".format(block)
            x = _bn_relu(x, name)
            x = _conv(channels, 1, name + "_conv")(x)
            x = layers.AveragePooling2D(2, name=name + "_pool")(x)
    x = _bn_relu(x, "final")
    return tf.keras.Model(inputs, _classifier(x, num_classes), name="densenet40")


def tinycnn(
    num_classes: int, input_shape: Sequence[int] = catalog.DEFAULT_INPUT_SHAPE
) -> tf.keras.Model:
    """Build a small, fast CNN (about 5.6 thousand weights for 10 classes) for tests.

    Two Conv3x3-BN-ReLU-MaxPool stages, global average pooling and a Dense layer giving logits.

    Args:
        num_classes: Output size.
        input_shape: (height, width, channels); height and width at least 4.

    Returns:
        An uncompiled functional Keras model.
    """
    inputs = tf.keras.Input(shape=tuple(input_shape), name="image")
    x = inputs
    for stage, filters in enumerate(catalog.TINYCNN_FILTERS, start=1):
        name = "stage{}".format(stage)
        x = _conv(filters, 3, name + "_conv")(x)
        x = _bn_relu(x, name)
        x = layers.MaxPooling2D(2, name=name + "_pool")(x)
    return tf.keras.Model(inputs, _classifier(x, num_classes), name="tinycnn")


BUILDERS = {"densenet40": densenet40, "tinycnn": tinycnn}


def build(
    name: str, num_classes: int, input_shape: Optional[Sequence[int]] = None
) -> tf.keras.Model:
    """Build a registered model with freshly initialised weights.

    Set the mixed precision policy and the random seed before calling this.

    Args:
        name: Registry name (see ``odtd.trainer.catalog.MODELS``).
        num_classes: Output size.
        input_shape: (height, width, channels); None means the catalog's default.

    Returns:
        An uncompiled functional Keras model.

    Raises:
        ValueError: Unknown model name.
    """
    info = catalog.get(name)
    return BUILDERS[name](num_classes, info.input_shape if input_shape is None else input_shape)
