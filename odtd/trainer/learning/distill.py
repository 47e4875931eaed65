"""Distillation from the served model on the rehearsed images (``training.distill``).

A session that learns the device's camera may forget the original domain. Besides the labels,
each rehearsed image of the original domain (the replay seed's, not the device's) carries the
served model's own soft prediction for it, and the candidate is pulled toward it (Learning
without Forgetting, Li and Hoiem 2016; Hinton et al. 2015): the loss of such an image is

    cross-entropy(label) + distill * T^2 * KL(softmax(teacher / T) || softmax(student / T))

with ``T`` = ``TEMPERATURE``. The teacher's logits are computed once, before training and
before BatchNorm adapts to the device: the served model as it runs today. No second model is
kept: one forward pass over the rehearsed images, then an array of their logits.

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

from typing import Any, Callable, Dict, NamedTuple, Optional

import numpy as np

TEMPERATURE = 2.0


class Teacher(NamedTuple):
    """Distillation's targets for every training image."""

    logits: np.ndarray  # float32 (N, classes): the served model's, zeros where not rehearsed
    weights: np.ndarray  # float32 (N,): ``job["distill"]`` where rehearsed, else 0


def teacher_targets(tf: Any, model: Any, job: Dict[str, Any], x: np.ndarray,
                    rehearsed: np.ndarray, batch_size: int,
                    should_stop: Callable[[], bool]) -> Optional[Teacher]:
    """The served model's logits and each image's distillation weight, for every training image.

    Args:
        tf: The TensorFlow module.
        model: The model as it serves now (its weights and BatchNorm statistics).
        job: The train job (``classes``, ``input_shape``, ``input_scale``, ``output``,
            ``distill``).
        x: The training images, uint8.
        rehearsed: One boolean per image: rehearsed from the original domain.
        batch_size: Images per forward pass (the training batch: no more memory than a step).
        should_stop: True once a stop is requested; checked between batches.

    Returns:
        ``(logits, weights)``: float32 ``(N, classes)`` (zeros where not rehearsed) and float32
        ``(N,)`` (``job["distill"]`` where rehearsed, else 0); None if a stop was requested.
    """
    from odtd.trainer.models import networks
    from odtd.trainer.plans.pool_first import pooling_first

    num_classes = len(job["classes"])
    forward_model = pooling_first(tf, model)

    @networks.compiled([networks.images_spec(job)])
    def logits_of(images: Any) -> Any:
        return networks.forward(forward_model, images, job["input_scale"], job["output"],
                                training=False)

    logits = np.zeros((len(x), num_classes), dtype=np.float32)
    chosen = np.flatnonzero(rehearsed)
    for begin in range(0, len(chosen), batch_size):
        if should_stop():
            return None
        part = chosen[begin:begin + batch_size]
        logits[part] = logits_of(tf.constant(x[part])).numpy()
    weights = np.where(rehearsed, np.float32(job["distill"]), np.float32(0.0)).astype(np.float32)
    return Teacher(logits, weights)


def distillation_loss(tf: Any, logits: Any, teacher: Any, weights: Any) -> Any:
    """Per-image ``weights * T^2 * KL(teacher || student)`` at temperature ``TEMPERATURE``."""
    targets = tf.nn.softmax(teacher / TEMPERATURE)
    log_student = tf.nn.log_softmax(logits / TEMPERATURE)
    log_targets = tf.nn.log_softmax(teacher / TEMPERATURE)
    divergence = tf.reduce_sum(targets * (log_targets - log_student), axis=-1)
    return weights * (TEMPERATURE ** 2) * divergence
