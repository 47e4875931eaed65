"""The models the worker trains, built-in or imported, and how both are fed and read.

Imports TensorFlow: only the worker (and the benchmarks) import this module.

Samples are stored as uint8 pixels. ``forward`` is the one way every model is called, in
training, evaluation, recalibration and the benchmarks: the pixels become float32 in the
model's input convention (``INPUT_SCALES``: ``0-255`` as keras.utils.image_dataset_from_directory
gives them, the default of an imported model that holds its own Rescaling; ``0-1``; ``-1-1``),
and the output becomes float32 logits (a softmax model's probabilities become their logs, which
the same cross-entropy then reads exactly).

The built-in networks (``BUILDERS``: DenseNet-40 and tinycnn here, the rest of the paper's CNN
suite in ``odtd.trainer.models.suite``) take ``0-1`` input and end in logits:

- Output: logits (no softmax in the model). The last Dense layer is float32 even under a mixed
  precision policy, so the loss is computed in float32.
- Here, convolutions have no bias and ``he_normal`` initialisation; no weight decay is built in.
- Layers carry explicit names, so weight names (the worker's ``weight_names``) are stable across
  processes and TensorFlow versions.

Only ``tf.keras`` APIs common to tf.keras 2 (TF <= 2.15) and Keras 3 are used. The architectures'
shape constants live in ``odtd.trainer.protocol.catalog``, which computes parameter counts without
TensorFlow.
"""

import json
from typing import Optional, Sequence

import tensorflow as tf

from odtd.trainer.models import suite
from odtd.trainer.protocol import catalog

layers = tf.keras.layers


INPUT_SCALES = ("0-255", "0-1", "-1-1")
OUTPUTS = ("logits", "softmax")
BUILTIN_INPUT_SCALE, BUILTIN_OUTPUT = "0-1", "logits"
_SOFTMAX_FLOOR = 1e-7  # probabilities below this are clipped before their log


def scale_pixels(images: tf.Tensor, input_scale: str) -> tf.Tensor:
    """Convert stored uint8 images to float32 model input in ``input_scale`` (``INPUT_SCALES``)."""
    images = tf.cast(images, tf.float32)
    if input_scale == "0-1":
        return images * (1.0 / 255.0)
    if input_scale == "-1-1":
        return images * (1.0 / 127.5) - 1.0
    return images


def compiled(input_signature: Optional[list] = None):
    """``tf.function`` as the worker compiles every graph it runs, without AutoGraph.

    None of the worker's compiled functions branches or loops on a tensor's value in Python, so
    AutoGraph has nothing to convert; converting cost every worker start about 0.3 s of CPU (5%
    of a tinycnn profile run on the development machine) and read the trainer's source files
    while a worker ran.
    """
    return tf.function(autograph=False, input_signature=input_signature)


def images_spec(job: dict) -> tf.TensorSpec:
    """A batch of the job's uint8 images, of any size (a short last batch does not retrace)."""
    return tf.TensorSpec([None] + list(job["input_shape"]), tf.uint8)


def forward(model: tf.keras.Model, images: tf.Tensor, input_scale: str, output: str,
            training: bool) -> tf.Tensor:
    """Run ``model`` on uint8 ``images``; return float32 logits (see the module's conventions)."""
    out = tf.cast(model(scale_pixels(images, input_scale), training=training), tf.float32)
    if output == "softmax":
        out = tf.math.log(tf.clip_by_value(out, _SOFTMAX_FLOOR, 1.0))
    return out


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
BUILDERS.update(suite.BUILDERS)


def build_model(job: dict) -> tf.keras.Model:
    """The job's model with fresh or file weights: the user's architecture, or a built-in one.

    With ``architecture`` (an imported model's screened configuration, written by ``import``),
    the configuration is built in this Keras (``imported.build_from_config``); its weights are
    whatever ``weights_in`` then sets. Otherwise the built-in network ``model`` is built and
    initialised from the job's seed.
    """
    if job["architecture"] is not None:
        from odtd.trainer.models import imported

        with open(job["architecture"]) as handle:
            config = json.load(handle)["config"]
        return imported.build_from_config(tf, config)
    return build(job["model"], len(job["classes"]), job["input_shape"])


def build(
    name: str, num_classes: int, input_shape: Optional[Sequence[int]] = None
) -> tf.keras.Model:
    """Build a registered model with freshly initialised weights.

    Set the mixed precision policy and the random seed before calling this.

    Args:
        name: Registry name (see ``odtd.trainer.protocol.catalog.MODELS``).
        num_classes: Output size.
        input_shape: (height, width, channels); None means the catalog's default.

    Returns:
        An uncompiled functional Keras model.

    Raises:
        ValueError: Unknown model name.
    """
    info = catalog.get(name)
    return BUILDERS[name](num_classes, info.input_shape if input_shape is None else input_shape)
