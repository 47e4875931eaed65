"""The model registry, without TensorFlow.

The daemon and ``odtctl`` use this module to validate model names and to know a model's size
before any worker runs. Parameter counts are computed analytically from the architectures that
``odtd.trainer.networks`` builds (the shape constants below are shared with it), and equal Keras's
``model.count_params()``: every weight, including BatchNorm moving statistics.
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

# A BatchNormalization layer holds gamma, beta, moving mean and moving variance per channel.
_BN_WEIGHTS_PER_CHANNEL = 4


class ModelInfo(NamedTuple):
    """One registered model.

    Attributes:
        name: Registry name, as used in job files and policies.
        description: One line for people.
        input_shape: Default input (height, width, channels).
        param_count: ``param_count(num_classes, input_channels=3)`` -> the exact number of
            weights (trainable and not) of the built model.
    """

    name: str
    description: str
    input_shape: Tuple[int, int, int]
    param_count: Callable[..., int]


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


MODELS: Dict[str, ModelInfo] = {
    "densenet40": ModelInfo(
        name="densenet40",
        description="DenseNet-40 (growth 12, 3 dense blocks of 12 layers), ~1.0 M parameters",
        input_shape=DEFAULT_INPUT_SHAPE,
        param_count=_densenet40_param_count,
    ),
    "tinycnn": ModelInfo(
        name="tinycnn",
        description="Two conv-BN-ReLU-maxpool stages and a dense layer; for tests and smoke runs",
        input_shape=DEFAULT_INPUT_SHAPE,
        param_count=_tinycnn_param_count,
    ),
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
            count matters: both models end in global average pooling.

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
