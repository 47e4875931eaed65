"""Scoring a model on validation data in the trainer worker.

Per-sample results, accuracy per class and per group, the paired counts the acceptance test
needs, and the cache of the "before" model's results (``evalcache``).

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import time
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from odtd.trainer import evalcache


def make_eval_step(tf: Any, model: Any, job: Dict[str, Any]) -> Callable[[Any, Any], Any]:
    """Return a compiled ``(images, labels) -> (per-sample losses, predicted classes)``."""
    from odtd.trainer import networks

    input_scale, output = job["input_scale"], job["output"]

    @tf.function(input_signature=[tf.TensorSpec([None] + list(job["input_shape"]), tf.uint8),
                                  tf.TensorSpec([None], tf.int64)])
    def eval_step(images: Any, labels: Any) -> Any:
        logits = networks.forward(model, images, input_scale, output, training=False)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return losses, tf.argmax(logits, axis=-1)

    return eval_step


def evaluate(eval_step: Callable[[Any, Any], Any], x: np.ndarray, y: np.ndarray,
             num_classes: int, batch_size: int, should_stop: Callable[[], bool],
             groups: Optional[np.ndarray] = None,
             cached: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None
             ) -> Optional[Dict[str, Any]]:
    """Evaluate in batches of ``batch_size``; None if a stop was requested meanwhile.

    With ``cached`` (``(known, correct, losses)`` per sample, from ``evalcache.lookup``) the
    known samples' results are taken from it and only the others run through the model.

    Returns:
        ``accuracy``, ``loss`` (mean), ``per_class`` (accuracy per class, None for a class
        without samples), ``by_group`` (accuracy per value of ``groups``, e.g. the base
        validation set and the device's held-out samples; empty without groups), ``samples``,
        ``cached`` (how many results came from ``cached``), ``seconds``, and per sample (not
        event fields) ``correct`` (for ``paired_counts``) and ``losses``.
    """
    started = time.monotonic()
    correct = np.zeros(len(y), dtype=bool)
    losses = np.zeros(len(y), dtype=np.float64)
    todo = np.arange(len(y))
    if cached is not None:
        known = cached[0]
        correct[known], losses[known] = cached[1][known], cached[2][known]
        todo = np.flatnonzero(~known)
    for begin in range(0, len(todo), batch_size):
        if should_stop():
            return None
        batch = todo[begin:begin + batch_size]
        batch_losses, predicted = eval_step(x[batch], y[batch])
        losses[batch] = batch_losses.numpy()
        correct[batch] = predicted.numpy() == y[batch]
    totals = np.bincount(y, minlength=num_classes)
    hits = np.bincount(y[correct], minlength=num_classes)
    return {
        "accuracy": float(np.mean(correct)),
        "loss": float(np.sum(losses)) / len(y),
        "per_class": [float(h) / t if t else None for h, t in zip(hits, totals)],
        "by_group": {} if groups is None else {
            str(g): float(np.mean(correct[groups == g])) for g in np.unique(groups)},
        "samples": int(len(y)),
        "cached": int(len(y) - len(todo)),
        "seconds": time.monotonic() - started,
        "correct": correct,
        "losses": losses,
    }


def paired_counts(before: np.ndarray, after: np.ndarray, groups: Optional[np.ndarray]
                  ) -> Dict[str, Dict[str, int]]:
    """Compare two models on the same samples: per group, how many only the new one gets right.

    Returns:
        group (``"all"`` without groups) -> ``gained`` (right after, wrong before), ``lost``
        (wrong after, right before) and ``samples``: what a paired (McNemar) test of the
        accuracy difference needs.
    """
    if groups is None:
        masks = {"all": np.ones(len(before), dtype=bool)}
    else:
        masks = {str(g): groups == g for g in np.unique(groups)}
    return {name: {"gained": int(np.sum(after[mask] & ~before[mask])),
                   "lost": int(np.sum(before[mask] & ~after[mask])),
                   "samples": int(np.sum(mask))}
            for name, mask in masks.items()}


def open_eval_cache(job: Dict[str, Any], precision: str,
                     validation: Tuple[np.ndarray, np.ndarray]
                     ) -> Optional[Tuple[str, np.ndarray, Any]]:
    """``(weights sha256, sample keys, evalcache.lookup result)`` for the "before" evaluation.

    None without ``eval_cache`` or without a weights file to key it by (a fresh init).
    """
    source = job["baseline_weights"] or job["weights_in"]
    if job["eval_cache"] is None or source is None:
        return None
    weights_sha256 = evalcache.file_sha256(source)
    keys = evalcache.sample_keys(validation[0], validation[1])
    return weights_sha256, keys, evalcache.lookup(job["eval_cache"], weights_sha256, precision, keys)
