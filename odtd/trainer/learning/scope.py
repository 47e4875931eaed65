"""Which of a model's layers a session trains (``training.trainable``).

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

from typing import Any

from odtd.trainer.learning.batchnorm import batchnorm_layers
from odtd.trainer.models.imported import leaf_layers


def set_trainable_scope(tf: Any, model: Any, scope: Any) -> int:
    """Train only part of the model; every other leaf layer is frozen.

    ``scope`` is ``all``, ``head`` (the last layer that holds weights), ``batchnorm`` (the
    BatchNormalization layers' scale and offset alone: every convolution and dense layer stays
    as loaded) or N (the last N layers that hold weights).

    A frozen BatchNormalization runs in inference mode (tf.keras 2 and Keras 3): its moving
    statistics stay as loaded, so recalibration leaves them alone too. Layers a model file was
    saved frozen with (``trainable = False``, a transfer-learning base) train like the rest:
    the scope is the policy's alone.

    Returns:
        How many weight-holding layers train.
    """
    model.trainable = True  # the policy decides, not the flags a model file was saved with
    layers = [layer for _, layer in leaf_layers(model) if layer.weights]
    if scope == "all":
        return len(layers)
    if scope == "batchnorm":
        kept = set(id(layer) for layer in batchnorm_layers(tf, model))
        if not kept:
            raise ValueError("nothing to train: training.trainable is batchnorm and the model "
                             "has no BatchNormalization layer")
        for layer in layers:
            if id(layer) not in kept:
                layer.trainable = False
        return len(kept)
    keep = 1 if scope == "head" else int(scope)
    for layer in layers[:max(0, len(layers) - keep)]:
        layer.trainable = False
    return min(keep, len(layers))
