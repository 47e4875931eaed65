"""BatchNorm's moving statistics in the worker: recalibration and adaptation to the device.

Two ways to set them, both by streaming batches through one compiled forward pass (no gradients
kept, so never more memory than a training step) and assigning once at the end:

- ``recalibrate_batchnorm`` ("precise BN"): after training, every trained BatchNorm layer's
  statistics become the average over the session's training images under the trained weights.
- ``adapt_batchnorm``: every BatchNorm layer's statistics (frozen ones too) become a mixture of
  the device's own images (weight ``w``) and the rehearsed images of the original domain
  (``1 - w``): label-free adaptation to the device's camera (AdaBN, Li et al. 2016, at ``w`` 1)
  that keeps part of the original domain's statistics. A session adapts before training (so
  the steps see the device's statistics) and again after it (under the trained weights).

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import time
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from odtd.trainer.imported import leaf_layers

Moments = List[Tuple[np.ndarray, np.ndarray]]


def batchnorm_layers(tf: Any, model: Any) -> List[Any]:
    """The model's BatchNormalization layers, in nested models too (freeze_bn, recalibrate_bn)."""
    return [layer for _, layer in leaf_layers(model)
            if isinstance(layer, tf.keras.layers.BatchNormalization)]


def batch_moments(tf: Any, model: Any, job: Any, layers: List[Any], x: np.ndarray,
                  batch_size: int, should_stop: Callable[[], bool]) -> Optional[Moments]:
    """Each layer's mean and variance over ``x`` (batch statistics weighted by batch size).

    The layers must be trainable (a frozen BatchNormalization normalises by its moving
    statistics even in training mode). Their moving statistics are left as they were.

    Returns:
        One ``(mean, variance)`` pair per layer (float64), or None if a stop was requested.
    """
    from odtd.trainer import networks

    kept = [(layer.moving_mean.numpy(), layer.moving_variance.numpy()) for layer in layers]
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.momentum = 0.0  # after a forward pass, the moving statistics are that batch's

    @tf.function(input_signature=[tf.TensorSpec([None] + list(job["input_shape"]), tf.uint8)])
    def batch_statistics(images: Any) -> Any:
        networks.forward(model, images, job["input_scale"], job["output"], training=True)
        return [(tf.identity(tf.convert_to_tensor(layer.moving_mean)),
                 tf.identity(tf.convert_to_tensor(layer.moving_variance))) for layer in layers]

    sums = [[np.zeros_like(mean, dtype=np.float64), np.zeros_like(var, dtype=np.float64)]
            for mean, var in kept]
    try:
        for begin in range(0, len(x), batch_size):
            if should_stop():
                return None
            part = x[begin:begin + batch_size]
            for total, (mean, variance) in zip(sums, batch_statistics(tf.constant(part))):
                total[0] += len(part) * mean.numpy()
                total[1] += len(part) * variance.numpy()
    finally:
        for layer, momentum, (mean, variance) in zip(layers, momenta, kept):
            layer.momentum = momentum
            layer.moving_mean.assign(mean)
            layer.moving_variance.assign(variance)
    return [(mean_sum / len(x), variance_sum / len(x)) for mean_sum, variance_sum in sums]


def assign_moments(layers: List[Any], moments: Moments) -> None:
    """Set each layer's moving statistics, in the layer's own dtype."""
    for layer, (mean, variance) in zip(layers, moments):
        layer.moving_mean.assign(mean.astype(layer.moving_mean.numpy().dtype))
        layer.moving_variance.assign(variance.astype(layer.moving_variance.numpy().dtype))


def recalibrate_batchnorm(tf: Any, model: Any, job: Any, x: np.ndarray, batch_size: int,
                          should_stop: Callable[[], bool]) -> Optional[float]:
    """Recompute every trained BatchNormalization layer's moving statistics over ``x``.

    A short fine-tuning leaves moving averages that mix the statistics of the weights before and
    during it. Here each layer's moving mean and variance become the average of its batch
    statistics over ``x`` (not augmented; each batch weighted by its size) under the trained
    weights; nothing else changes.

    Returns:
        The seconds it took, or None if a stop was requested meanwhile (statistics unchanged).
    """
    layers = [layer for layer in batchnorm_layers(tf, model) if layer.trainable]
    if not layers:
        return 0.0
    started = time.monotonic()
    moments = batch_moments(tf, model, job, layers, x, batch_size, should_stop)
    if moments is None:
        return None
    assign_moments(layers, moments)
    return time.monotonic() - started


def mix_moments(device: Moments, rehearsal: Optional[Moments], weight: float) -> Moments:
    """The moments of a mixture: ``weight`` of the device's distribution, the rest rehearsal's.

    Mean ``w m_d + (1 - w) m_r``; variance ``w v_d + (1 - w) v_r + w (1 - w) (m_d - m_r)^2``.
    """
    if rehearsal is None or weight >= 1.0:
        return device
    mixed = []
    for (mean_d, var_d), (mean_r, var_r) in zip(device, rehearsal):
        mean = weight * mean_d + (1.0 - weight) * mean_r
        variance = (weight * var_d + (1.0 - weight) * var_r
                    + weight * (1.0 - weight) * np.square(mean_d - mean_r))
        mixed.append((mean, variance))
    return mixed


def adapt_batchnorm(tf: Any, model: Any, job: Any, device_x: np.ndarray,
                    rehearsal_x: Optional[np.ndarray], batch_size: int,
                    should_stop: Callable[[], bool]) -> Optional[float]:
    """Set every BatchNormalization layer's statistics to the device / rehearsal mixture.

    Every layer, frozen or not: frozen layers (``freeze_bn``, a ``trainable`` scope) are made
    trainable for the forward passes only, so they measure batch statistics, and then frozen
    again. Gamma and beta never change here. The mixture's weight is the job's
    ``bn_device_weight``; without rehearsal images the device's statistics are used alone.

    Returns:
        The seconds it took, or None if a stop was requested meanwhile (statistics unchanged).
    """
    layers = batchnorm_layers(tf, model)
    if not layers or len(device_x) == 0:
        return 0.0
    started = time.monotonic()
    frozen = [layer for layer in layers if not layer.trainable]
    for layer in frozen:
        layer.trainable = True
    try:
        device = batch_moments(tf, model, job, layers, device_x, batch_size, should_stop)
        rehearsal = None
        if device is not None and rehearsal_x is not None and len(rehearsal_x) \
                and job["bn_device_weight"] < 1.0:
            rehearsal = batch_moments(tf, model, job, layers, rehearsal_x, batch_size, should_stop)
            if rehearsal is None:
                device = None
    finally:
        for layer in frozen:
            layer.trainable = False
    if device is None:
        return None
    assign_moments(layers, mix_moments(device, rehearsal, job["bn_device_weight"]))
    return time.monotonic() - started
