"""The rest of the paper's CNN suite: five keras.applications networks and two written here.

Imports TensorFlow: only the worker, through ``odtd.trainer.models.networks`` (which registers these
builders in ``BUILDERS``), and the benchmarks import this module.

ResNet50, VGG16, Xception, MobileNetV2 (width 1.0) and DenseNet121 come from keras.applications
with ``include_top=False, weights=None``, built on the model's own input tensor: their layers are
the model's layers, not one nested model, so gradient checkpointing (``graph.valid_cuts``)
finds cuts inside them. Their layers are Keras's as they are (VGG16's convolutions have biases;
Keras's default initialisers); no ImageNet weights are loaded, so ImageNet's input preprocessing
does not apply and they take ``0-1`` pixels like the other built-in networks. VGG16's two
4096-unit fully connected layers are not built: every network here ends like DenseNet-40, in
global average pooling and one Dense layer.

SqueezeNet 1.1 and GoogLeNet (Inception v1) are written with plain Keras layers from the shape
constants in ``odtd.trainer.protocol.catalog``, which counts their weights without TensorFlow.

All follow the built-in conventions of ``odtd.trainer.models.networks``: ``0-1`` input, float32 logits
from a Dense layer named ``logits`` (even under mixed precision), explicit layer names where
this module names them. None has dropout: gradient checkpointing recomputes a segment's forward
pass, and a dropout layer there would draw a different mask the second time.
"""

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import tensorflow as tf

from odtd.trainer.protocol import catalog

layers = tf.keras.layers


def _logits_head(x: tf.Tensor, num_classes: int) -> tf.Tensor:
    # The same head as networks' DenseNet-40: float32 logits, so the loss never runs in float16.
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    return layers.Dense(num_classes, dtype="float32", name="logits")(x)


def _input(name: str, input_shape: Optional[Sequence[int]]) -> Tuple[Tuple[int, ...], Any]:
    shape = tuple(catalog.get(name).input_shape if input_shape is None else input_shape)
    return shape, tf.keras.Input(shape=shape, name="image")


def _application(name: str) -> Callable[..., tf.keras.Model]:
    application = catalog.APPLICATIONS[name]

    def build(num_classes: int, input_shape: Optional[Sequence[int]] = None) -> tf.keras.Model:
        shape, inputs = _input(name, input_shape)
        base = getattr(tf.keras.applications, application.function)(
            include_top=False, weights=None, input_tensor=inputs, input_shape=shape)
        return tf.keras.Model(inputs, _logits_head(base.output, num_classes), name=name)

    build.__name__ = name
    build.__doc__ = (
        "Build keras.applications' {} (include_top=False, weights=None) with a logits head.\n\n"
        "Args:\n    num_classes: Output size.\n    input_shape: (height, width, channels); height "
        "and width at least {}.\n\nReturns:\n    An uncompiled functional Keras model."
    ).format(application.function, application.min_input_size)
    return build


def _conv_relu(x: tf.Tensor, filters: int, kernel_size: int, name: str, strides: int = 1,
               padding: str = "same") -> tf.Tensor:
    # SqueezeNet as published: biased convolutions, no BatchNorm.
    return layers.Conv2D(filters, kernel_size, strides=strides, padding=padding,
                         activation="relu", kernel_initializer="he_normal", name=name)(x)


def squeezenet(num_classes: int, input_shape: Optional[Sequence[int]] = None) -> tf.keras.Model:
    """Build SqueezeNet 1.1: about 0.73 million weights for 10 classes.

    A 3x3/2 convolution (64 filters), then three stages of fire modules, each stage after a
    3x3/2 max pooling (``catalog.SQUEEZENET_STAGES``). A fire module squeezes with 1x1
    convolutions and concatenates 1x1 and 3x3 expansions. Convolutions have biases and ReLU and
    no BatchNorm, as published. The published classifier, a 1x1 convolution to the classes
    averaged over the image, is here global average pooling then a Dense layer: the same
    function and weights, both being linear, without the published final ReLU (the output is
    logits) and without its dropout.

    Args:
        num_classes: Output size.
        input_shape: (height, width, channels); height and width at least 32.

    Returns:
        An uncompiled functional Keras model.
    """
    _, inputs = _input("squeezenet", input_shape)
    x = _conv_relu(inputs, catalog.SQUEEZENET_STEM_FILTERS, 3, "conv1", strides=2, padding="valid")
    fire = 2
    for stage in catalog.SQUEEZENET_STAGES:
        x = layers.MaxPooling2D(3, strides=2, name="pool{}".format(fire - 1))(x)
        for squeeze, expand1, expand3 in stage:
            name = "fire{}".format(fire)
            squeezed = _conv_relu(x, squeeze, 1, name + "_squeeze1x1")
            x = layers.Concatenate(name=name + "_concat")([
                _conv_relu(squeezed, expand1, 1, name + "_expand1x1"),
                _conv_relu(squeezed, expand3, 3, name + "_expand3x3")])
            fire += 1
    return tf.keras.Model(inputs, _logits_head(x, num_classes), name="squeezenet")


def _conv_bn_relu(x: tf.Tensor, filters: int, kernel_size: int, name: str,
                  strides: int = 1) -> tf.Tensor:
    x = layers.Conv2D(filters, kernel_size, strides=strides, padding="same", use_bias=False,
                      kernel_initializer="he_normal", name=name)(x)
    x = layers.BatchNormalization(name=name + "_bn")(x)
    return layers.Activation("relu", name=name + "_relu")(x)


def _max_pool(x: tf.Tensor, name: str, strides: int = 2) -> tf.Tensor:
    return layers.MaxPooling2D(3, strides=strides, padding="same", name=name)(x)


def _inception(x: tf.Tensor, filters: Sequence[int], name: str) -> tf.Tensor:
    one, reduce3, three, reduce5, five, projection = filters
    branch3 = _conv_bn_relu(x, reduce3, 1, name + "_3x3_reduce")
    branch5 = _conv_bn_relu(x, reduce5, 1, name + "_5x5_reduce")
    pooled = _max_pool(x, name + "_pool", strides=1)
    return layers.Concatenate(name=name + "_concat")([
        _conv_bn_relu(x, one, 1, name + "_1x1"),
        _conv_bn_relu(branch3, three, 3, name + "_3x3"),
        _conv_bn_relu(branch5, five, 5, name + "_5x5"),
        _conv_bn_relu(pooled, projection, 1, name + "_pool_proj")])


def inceptionv1(num_classes: int, input_shape: Optional[Sequence[int]] = None) -> tf.keras.Model:
    """Build GoogLeNet (Inception v1): about 6.0 million weights for 10 classes.

    The stem (7x7/2 convolution, 3x3/2 max pooling, 1x1 and 3x3 convolutions), then nine
    inception modules in three stages, each stage after a 3x3/2 max pooling
    (``catalog.INCEPTIONV1_STAGES``, the paper's table 1, 5x5 branches included). Every
    convolution is Conv-BatchNorm-ReLU without bias, BatchNorm standing in for the paper's local
    response normalisation as in later reimplementations. No auxiliary classifiers and no
    dropout: global average pooling and a Dense layer give the logits.

    Args:
        num_classes: Output size.
        input_shape: (height, width, channels); height and width at least 32 (five halvings
            leave a 1x1 map).

    Returns:
        An uncompiled functional Keras model.
    """
    _, inputs = _input("inceptionv1", input_shape)
    (stem1, kernel1), (stem2, kernel2), (stem3, kernel3) = catalog.INCEPTIONV1_STEM
    x = _conv_bn_relu(inputs, stem1, kernel1, "conv1", strides=2)
    x = _max_pool(x, "pool1")
    x = _conv_bn_relu(x, stem2, kernel2, "conv2_reduce")
    x = _conv_bn_relu(x, stem3, kernel3, "conv2")
    for stage, modules in enumerate(catalog.INCEPTIONV1_STAGES, start=3):
        x = _max_pool(x, "pool{}".format(stage - 1))
        for index, filters in enumerate(modules):
            x = _inception(x, filters, "inception{}{}".format(stage, "abcde"[index]))
    return tf.keras.Model(inputs, _logits_head(x, num_classes), name="inceptionv1")


BUILDERS: Dict[str, Callable[..., tf.keras.Model]] = {
    "squeezenet": squeezenet,
    "inceptionv1": inceptionv1,
}
BUILDERS.update((name, _application(name)) for name in catalog.APPLICATIONS)
