"""BatchNormalization trained with TensorFlow's fused kernel under Keras 3.

tf.keras 2 runs a channels-last BatchNormalization in training mode as one fused op
(``FusedBatchNormV3``, a oneDNN kernel on x86 CPUs): one kernel for the batch's statistics and
the normalisation, one for the whole gradient. Keras 3 composes it from ``tf.nn.moments`` and
``tf.nn.batch_normalization`` in float32: several full-size elementwise passes each way, and
their tensors alive in the backward pass. On DenseNet40 (39 BatchNorm layers) that is a large
part of a step: fused, a mixed_bfloat16 step ran 1.16x, 1.22x and 1.28x the samples/s at batch
16, 32 and 64 and peaked lower (docs/memory.md, "Fused BatchNorm under Keras 3").

``fuse(tf, model)`` makes every Keras 3 BatchNormalization of ``model`` (nested ones too) that
normalises a 4-D channels-last input under mixed precision (a float16 or bfloat16 compute
dtype) run the fused op when it trains. In float32 the worker keeps Keras's code: there the
fused kernel ran 1.05x the samples/s but peaked 12% higher at batch 64 (DenseNet40 on the
development CPU, `odtctl profile`: 2,265 MB fused against 2,023), and memory is what a board
runs out of first; but when the job recomputes (``recompute.Checkpointed``), where only one
layer's activations are alive at a time, the fused kernel is the leaner of the two (DenseNet40's
dense blocks at batch 64: 1,103-1,115 MB against 1,195-1,230 in a hand-written step, and faster)
and the worker fuses float32 layers too.

The fused computation is Keras 3's: the input normalised in float32 by the batch's mean and
biased variance, gamma and beta applied, the output in the layer's compute dtype, and the
moving statistics moved by the layer's momentum toward the batch's mean and biased variance
(the kernel reports the unbiased variance; it is scaled back).
Everything else runs the layer's own code: inference, a frozen layer, a mask, renorm,
synchronized statistics, another axis or rank, and an epsilon below the kernel's floor
(``tf.nn.fused_batch_norm`` raises it to 1.001e-5). tf.keras 2's layers are left as they are:
they fuse already.

TensorFlow is passed in. Python 3.6-compatible; tf.keras 2 and Keras 3 alike.
"""

from typing import Any, Callable

from odtd.trainer.batchnorm import batchnorm_layers
from odtd.trainer.imported import keras_major

MIN_EPSILON = 1.001e-5  # below it the fused kernel would normalise by another epsilon
REDUCED = ("float16", "bfloat16")  # the compute dtypes fused by default


def fusable(layer: Any, float32: bool = False) -> bool:
    """Whether a Keras 3 BatchNormalization's training mode is the fused kernel's computation.

    Only layers that compute in float16 or bfloat16, unless ``float32`` allows float32 too.
    """
    return (getattr(layer, "_reduction_axes", None) == [0, 1, 2]
            and (float32 or str(layer.compute_dtype) in REDUCED)
            and not getattr(layer, "renorm", False)
            and not getattr(layer, "synchronized", False)
            and layer.epsilon >= MIN_EPSILON)


def fuse(tf: Any, model: Any, float32: bool = False) -> int:
    """Train ``model``'s fusable BatchNormalization layers with the fused kernel.

    Call it once the model is built (the layers know their input's rank). A layer already fused
    is left as it is. ``float32`` fuses float32 layers too (the tests compare the two
    computations there, where rounding does not hide a difference).

    Returns:
        How many layers run fused when they train (0 under tf.keras 2).
    """
    if keras_major(tf) < 3:
        return 0
    count = 0
    for layer in batchnorm_layers(tf, model):
        if not fusable(layer, float32):
            continue
        if not getattr(layer.call, "fused_batchnorm", False):
            layer.call = _fused_call(tf, layer, layer.call)
        count += 1
    return count


def _fused_call(tf: Any, layer: Any, own: Callable[..., Any]) -> Callable[..., Any]:
    def call(inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if mask is not None or not training or not layer.trainable:
            return own(inputs, training=training, mask=mask)
        x = tf.cast(inputs, tf.float32)
        channels = int(x.shape[-1])
        gamma = tf.cast(layer.gamma, tf.float32) if layer.scale else tf.ones([channels])
        beta = tf.cast(layer.beta, tf.float32) if layer.center else tf.zeros([channels])
        y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
            x, gamma, beta, epsilon=layer.epsilon, data_format="NHWC", is_training=True)
        count = tf.cast(tf.size(x, out_type=tf.int64) // channels, tf.float32)
        variance = variance * tf.maximum(count - 1.0, 0.0) / tf.maximum(count, 1.0)
        momentum = layer.momentum
        layer.moving_mean.assign(
            tf.cast(layer.moving_mean, tf.float32) * momentum + mean * (1.0 - momentum))
        layer.moving_variance.assign(
            tf.cast(layer.moving_variance, tf.float32) * momentum + variance * (1.0 - momentum))
        return tf.cast(y, layer.compute_dtype)

    call.fused_batchnorm = True  # type: ignore[attr-defined]
    return call
