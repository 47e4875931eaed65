"""BatchNormalization trained with TensorFlow's fused kernel under Keras 3.

tf.keras 2 runs a channels-last BatchNormalization in training mode as one fused op
(``FusedBatchNormV3``, a oneDNN kernel on x86 CPUs): one kernel for the batch's statistics and
the normalisation, one for the whole gradient. Keras 3 composes it from ``tf.nn.moments`` and
``tf.nn.batch_normalization`` in float32: several full-size elementwise passes each way, and
their tensors alive in the backward pass. On DenseNet40 (39 BatchNorm layers) that is a large
part of a step: fused, a mixed_bfloat16 step ran 1.16x, 1.22x and 1.28x the samples/s at batch
16, 32 and 64 and peaked lower (docs/memory.md, "Fused BatchNorm under Keras 3").

``fuse(tf, model)`` makes every Keras 3 BatchNormalization of ``model`` (nested ones too) that
normalises a 4-D channels-last input in float32, float16 or bfloat16 run the fused op when it
trains.

In float32 the fused op meets Grappler's remapper, which merges a training FusedBatchNorm with
the ReLU after it into one oneDNN primitive (batch normalization with a fused ReLU); that
primitive keeps more for the backward pass: DenseNet40's recipe at batch 64 peaked at 2,285 MB
against 1,992 MB without the merge, and ran no faster (docs/memory.md, "Fused BatchNorm in
float32"). ``keep_relu_apart`` turns the remapper off for the process (a worker runs one job, so it is
that job's setting) when a float32 layer trains fused on a CPU: Keras 3's once fused, and
tf.keras 2's, which fuse by themselves (on TensorFlow 2.15 the same recipe peaked 17-21% lower
at batch 64 without the merge). Under mixed precision the cast between the two ops keeps them
apart already. With both, DenseNet40 trained in float32 1.22-1.24x the samples/s of Keras 3's
own layer at batch 16-64 (an Intel Xeon, by hand), at the same peak. Before, float32 layers
kept Keras's code (the merged kernel peaked 12-14% higher at batch 64).

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

from odtd.trainer.models.imported import batchnorm_layers, keras_major

MIN_EPSILON = 1.001e-5  # below it the fused kernel would normalise by another epsilon
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")  # the kernel computes in float32: not float64


def fusable(layer: Any) -> bool:
    """Whether a Keras 3 BatchNormalization's training mode is the fused kernel's computation."""
    return (getattr(layer, "_reduction_axes", None) == [0, 1, 2]
            and str(layer.compute_dtype) in COMPUTE_DTYPES
            and not getattr(layer, "renorm", False)
            and not getattr(layer, "synchronized", False)
            and layer.epsilon >= MIN_EPSILON)


def fuse(tf: Any, model: Any) -> int:
    """Train ``model``'s fusable BatchNormalization layers with the fused kernel.

    Call it once the model is built (the layers know their input's rank). A layer already fused
    is left as it is.

    Returns:
        How many layers run fused when they train (0 under tf.keras 2).
    """
    if keras_major(tf) < 3:
        return 0
    count = 0
    for layer in batchnorm_layers(tf, model):
        if not fusable(layer):
            continue
        if not getattr(layer.call, "fused_batchnorm", False):
            layer.call = _fused_call(tf, layer, layer.call)
        count += 1
    return count


def keep_relu_apart(tf: Any, model: Any) -> bool:
    """On a CPU, stop Grappler merging a float32 fused BatchNorm that trains with its ReLU.

    Applies when a trainable BatchNormalization of ``model`` trains with the fused kernel in
    float32 (Keras 3's once ``fuse`` ran, tf.keras 2's own) and no GPU is visible: then the
    remapper is turned off for the process, a worker's one job. Call it after ``fuse`` and the
    trainable scope are set, before the training step is traced. Turning the remapper off also
    leaves its other fusions undone (a convolution with its bias and activation, for one) in
    the functions traced from then on. On a GPU the remapper merges the two in float16 only,
    and its convolution fusions are worth more there: nothing is changed.

    Returns:
        Whether the remapper was turned off.
    """
    if tf.config.list_logical_devices("GPU"):
        return False
    keras3 = keras_major(tf) >= 3
    for layer in batchnorm_layers(tf, model):
        fused = (getattr(layer.call, "fused_batchnorm", False) if keras3
                 else getattr(layer, "fused", False))  # tf.keras 2's own choice, made at build
        if fused and layer.trainable and str(layer.compute_dtype) == "float32":
            tf.config.optimizer.set_experimental_options({"remapping": False})
            return True
    return False


def train_normalise(tf: Any, layer: Any, x: Any, gamma: Any, beta: Any) -> Any:
    """``x`` (float32, channels last) normalised as ``layer`` trains: ``(y, mean, variance)``.

    The fused kernel over the batch's statistics with the layer's epsilon; its variance is the
    unbiased one. ``gamma`` and ``beta`` may be a slice of the layer's channels
    (``dense_chunks``).
    """
    return tf.compat.v1.nn.fused_batch_norm(
        x, gamma, beta, epsilon=layer.epsilon, data_format="NHWC", is_training=True)


def _fused_call(tf: Any, layer: Any, own: Callable[..., Any]) -> Callable[..., Any]:
    def call(inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if mask is not None or not training or not layer.trainable:
            return own(inputs, training=training, mask=mask)
        x = tf.cast(inputs, tf.float32)
        channels = int(x.shape[-1])
        gamma = tf.cast(layer.gamma, tf.float32) if layer.scale else tf.ones([channels])
        beta = tf.cast(layer.beta, tf.float32) if layer.center else tf.zeros([channels])
        y, mean, variance = train_normalise(tf, layer, x, gamma, beta)
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
