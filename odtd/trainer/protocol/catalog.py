"""The model registry, without TensorFlow.

The daemon and ``odtctl`` use this module to validate model names and input sizes and to know a
model's size before any worker runs. Parameter counts equal Keras's ``model.count_params()``:
every weight, including BatchNorm moving statistics. They are computed analytically from the
architectures that ``odtd.trainer.models.networks`` and ``odtd.trainer.models.suite`` build
(the shape constants below are shared with them); for the keras.applications networks, from
the weights of the base network at three input channels, recorded here and checked against
Keras by tests/test_suite.py.
"""

from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple

DEFAULT_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
"""The ten CIFAR-10 class names, in CIFAR-10 label order."""

DEFAULT_INPUT_SHAPE = (32, 32, 3)

# DenseNet-40 (Huang et al. 2017, https://arxiv.org/abs/1608.06993): depth 40 = 3 blocks x 12
# layers + stem + 2 transitions + classifier; no bottleneck, no compression.
DENSENET40_STEM_FILTERS = 16
DENSENET40_BLOCKS = 3
DENSENET40_LAYERS_PER_BLOCK = 12
DENSENET40_GROWTH = 12

TINYCNN_FILTERS = (16, 32)

# SqueezeNet 1.1 (Iandola et al. 2016, https://arxiv.org/abs/1602.07360, and the v1.1 variant of
# github.com/forresti/SqueezeNet): a 3x3/2 stem convolution, then three stages of fire modules
# (squeeze 1x1, expand 1x1, expand 3x3 filters), each stage after a 3x3/2 max pooling.
SQUEEZENET_STEM_FILTERS = 64
SQUEEZENET_STAGES = (
    ((16, 64, 64), (16, 64, 64)),
    ((32, 128, 128), (32, 128, 128)),
    ((48, 192, 192), (48, 192, 192), (64, 256, 256), (64, 256, 256)),
)

# GoogLeNet / Inception v1 (Szegedy et al. 2014, https://arxiv.org/abs/1409.4842, table 1): the
# stem (7x7/2 64, max pool, 1x1 64, 3x3 192, max pool), then inception modules in three stages
# separated by 3x3/2 max pooling. Each module is (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5,
# pool projection) filters; its output concatenates the 1x1, 3x3, 5x5 and projection branches.
INCEPTIONV1_STEM = ((64, 7), (64, 1), (192, 3))
INCEPTIONV1_STAGES = (
    ((64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64)),
    ((192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
     (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128)),
    ((256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128)),
)


class Application(NamedTuple):
    """A keras.applications network as the suite builds it: ``include_top=False, weights=None``.

    Attributes:
        function: The ``keras.applications`` constructor, e.g. ``"ResNet50"``.
        base_weights: ``count_params()`` of the base network at three input channels.
        stem_weights_per_channel: Weights of its first convolution per input channel
            (kernel height x width x filters): the only part that depends on the channels.
        features: Channels of the base's last layer, the classifier's input.
        min_input_size: The smallest height and width keras.applications accepts.
    """

    function: str
    base_weights: int
    stem_weights_per_channel: int
    features: int
    min_input_size: int


APPLICATIONS = {
    "resnet50": Application("ResNet50", 23587712, 7 * 7 * 64, 2048, 32),
    "vgg16": Application("VGG16", 14714688, 3 * 3 * 64, 512, 32),
    "xception": Application("Xception", 20861480, 3 * 3 * 32, 2048, 71),
    "mobilenetv2": Application("MobileNetV2", 2257984, 3 * 3 * 32, 1280, 32),
    "densenet121": Application("DenseNet121", 7037504, 7 * 7 * 64, 1024, 32),
}

# A BatchNormalization layer holds gamma, beta, moving mean and moving variance per channel.
_BN_WEIGHTS_PER_CHANNEL = 4


class ModelInfo(NamedTuple):
    """One registered model.

    Attributes:
        name: Registry name, as used in job files and policies.
        description: One line for people.
        input_shape: Default input (height, width, channels).
        param_count: ``param_count(num_classes, input_channels=3)`` -> the exact number of
            weights (trainable and not) of the built model, whatever its height and width.
        min_input_size: The smallest height and width it takes, in pixels.
    """

    name: str
    description: str
    input_shape: Tuple[int, int, int]
    param_count: Callable[..., int]
    min_input_size: int


def _densenet40_param_count(num_classes: int, input_channels: int = 3) -> int:
    channels = DENSENET40_STEM_FILTERS
    total = 3 * 3 * input_channels * channels
    for block in range(DENSENET40_BLOCKS):
        for _ in range(DENSENET40_LAYERS_PER_BLOCK):
            # BN-ReLU-Conv3x3(growth), no bias; its output is concatenated to its input.
            total += _BN_WEIGHTS_PER_CHANNEL * channels + 3 * 3 * channels * DENSENET40_GROWTH
            channels += DENSENET40_GROWTH
        if block < DENSENET40_BLOCKS - 1:
            # Transition: BN-ReLU-Conv1x1 keeping the channel count, no bias.
            total += _BN_WEIGHTS_PER_CHANNEL * channels + channels * channels
    total += _BN_WEIGHTS_PER_CHANNEL * channels
    return total + channels * num_classes + num_classes


def _tinycnn_param_count(num_classes: int, input_channels: int = 3) -> int:
    total = 0
    channels = input_channels
    for filters in TINYCNN_FILTERS:
        total += 3 * 3 * channels * filters + _BN_WEIGHTS_PER_CHANNEL * filters
        channels = filters
    return total + channels * num_classes + num_classes


def _squeezenet_param_count(num_classes: int, input_channels: int = 3) -> int:
    # Convolutions with biases and no BatchNorm, as published.
    channels = SQUEEZENET_STEM_FILTERS
    total = 3 * 3 * input_channels * channels + channels
    for stage in SQUEEZENET_STAGES:
        for squeeze, expand1, expand3 in stage:
            total += channels * squeeze + squeeze
            total += squeeze * expand1 + expand1 + 3 * 3 * squeeze * expand3 + expand3
            channels = expand1 + expand3
    return total + channels * num_classes + num_classes


def _inceptionv1_param_count(num_classes: int, input_channels: int = 3) -> int:
    # Every convolution is Conv(no bias)-BatchNorm-ReLU.
    def conv(inputs: int, filters: int, kernel: int) -> int:
        return kernel * kernel * inputs * filters + _BN_WEIGHTS_PER_CHANNEL * filters

    total, channels = 0, input_channels
    for filters, kernel in INCEPTIONV1_STEM:
        total += conv(channels, filters, kernel)
        channels = filters
    for stage in INCEPTIONV1_STAGES:
        for one, reduce3, three, reduce5, five, projection in stage:
            total += conv(channels, one, 1) + conv(channels, reduce3, 1) + conv(reduce3, three, 3)
            total += conv(channels, reduce5, 1) + conv(reduce5, five, 5)
            total += conv(channels, projection, 1)
            channels = one + three + five + projection
    return total + channels * num_classes + num_classes


def _application_param_count(name: str) -> Callable[..., int]:
    application = APPLICATIONS[name]

    def count(num_classes: int, input_channels: int = 3) -> int:
        total = application.base_weights
        total += application.stem_weights_per_channel * (input_channels - 3)
        return total + application.features * num_classes + num_classes

    return count


def _application(name: str, description: str) -> ModelInfo:
    application = APPLICATIONS[name]
    size = max(DEFAULT_INPUT_SHAPE[0], application.min_input_size)
    return ModelInfo(
        name=name,
        description="{} (keras.applications, weights=None), {}; at least {}x{}".format(
            application.function, description, application.min_input_size,
            application.min_input_size),
        input_shape=(size, size, DEFAULT_INPUT_SHAPE[2]),
        param_count=_application_param_count(name),
        min_input_size=application.min_input_size,
    )


MODELS: Dict[str, ModelInfo] = {
    "densenet40": ModelInfo(
        name="densenet40",
        description="DenseNet-40 (growth 12, 3 dense blocks of 12 layers), ~1.0 M parameters",
        input_shape=DEFAULT_INPUT_SHAPE,
        param_count=_densenet40_param_count,
        min_input_size=4,
    ),
    "tinycnn": ModelInfo(
        name="tinycnn",
        description="Two conv-BN-ReLU-maxpool stages and a dense layer; for tests and smoke runs",
        input_shape=DEFAULT_INPUT_SHAPE,
        param_count=_tinycnn_param_count,
        min_input_size=4,
    ),
    "squeezenet": ModelInfo(
        name="squeezenet",
        description="SqueezeNet 1.1 (8 fire modules, biases, no BatchNorm), ~0.73 M parameters; "
                    "at least 32x32",
        input_shape=DEFAULT_INPUT_SHAPE,
        param_count=_squeezenet_param_count,
        min_input_size=32,
    ),
    "inceptionv1": ModelInfo(
        name="inceptionv1",
        description="GoogLeNet / Inception v1 (9 inception modules, BatchNorm, no auxiliary "
                    "classifiers), ~6.0 M parameters; at least 32x32",
        input_shape=DEFAULT_INPUT_SHAPE,
        param_count=_inceptionv1_param_count,
        min_input_size=32,
    ),
    "resnet50": _application("resnet50", "~23.6 M parameters"),
    "vgg16": _application("vgg16", "13 convolutions, ~14.7 M parameters"),
    "xception": _application("xception", "~20.9 M parameters"),
    "mobilenetv2": _application("mobilenetv2", "width 1.0, ~2.3 M parameters"),
    "densenet121": _application("densenet121", "~7.0 M parameters"),
}


def get(name: str) -> ModelInfo:
    """Return the registry entry for a model.

    Args:
        name: Registry name, e.g. ``"densenet40"``.

    Returns:
        The model's ``ModelInfo``.

    Raises:
        ValueError: The name is not registered; the message lists the known names.
    """
    try:
        return MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(
            "unknown model {!r}; known models: {}".format(name, ", ".join(sorted(MODELS)))
        ) from None


def param_count(name: str, num_classes: int, input_shape: Optional[Sequence[int]] = None) -> int:
    """Return the exact number of weights of a registered model.

    Args:
        name: Registry name.
        num_classes: Output size (number of class names), at least 1.
        input_shape: (height, width, channels); None means the model's default. Only the channel
            count matters: every model ends in global average pooling.

    Returns:
        The number of weights, trainable and not, as Keras's ``count_params()`` reports it.

    Raises:
        ValueError: Unknown model name or a non-positive class count.
    """
    info = get(name)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError("num_classes must be a positive integer, got {!r}".format(num_classes))
    shape = info.input_shape if input_shape is None else tuple(input_shape)
    return info.param_count(num_classes, shape[-1])


def sized_input_shape(name: str, height: int, width: int) -> Tuple[int, int, int]:
    """Return a registered model's input shape at another height and width.

    Args:
        name: Registry name.
        height: Input height in pixels.
        width: Input width in pixels.

    Returns:
        (height, width, channels), the channels being the model's default.

    Raises:
        ValueError: Unknown model name, or a size below the model's ``min_input_size``.
    """
    info = get(name)
    if min(height, width) < info.min_input_size:
        raise ValueError("{} takes inputs of at least {}x{}, got {}x{}".format(
            name, info.min_input_size, info.min_input_size, height, width))
    return (height, width, info.input_shape[2])
