"""Scoring a model on validation data in the trainer worker.

Per-sample results, accuracy per class and per group, the paired counts the acceptance test
needs, and the cache of the "before" model's results (``evalcache``).

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import time
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np

from odtd.trainer.learning import evalcache
from odtd.trainer.protocol.digest import file_sha256
from odtd.trainer.protocol.paired import acceptance_margin, loss_margin

REFERENCE_GROUP = "2"  # the evaluation set's groups: docs/worker-protocol.md, validation_data


class Stopped(Exception):
    """A stop was requested during one of a job's steps: the job ends ``interrupted``."""


def unless_stopped(value: Any) -> Any:
    """``value``; ``Stopped`` where a step said None (a stop was requested meanwhile)."""
    if value is None:
        raise Stopped()
    return value


def make_eval_step(tf: Any, model: Any, job: Dict[str, Any]) -> Callable[[Any, Any], Any]:
    """Return a compiled ``(images, labels) -> (per-sample losses, logits)``.

    The model runs pooling first where it can (``pool_first.pooling_first``).
    """
    from odtd.trainer.models import networks
    from odtd.trainer.plans.pool_first import pooling_first

    input_scale, output = job["input_scale"], job["output"]
    forward_model = pooling_first(tf, model)

    @networks.compiled([networks.images_spec(job), tf.TensorSpec([None], tf.int64)])
    def eval_step(images: Any, labels: Any) -> Any:
        logits = networks.forward(forward_model, images, input_scale, output, training=False)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return losses, logits

    return eval_step


def evaluate(eval_step: Callable[[Any, Any], Any], x: np.ndarray, y: np.ndarray,
             num_classes: int, batch_size: int, should_stop: Callable[[], bool],
             groups: Optional[np.ndarray] = None,
             cached: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None,
             offset: Optional[Tuple[np.ndarray, np.ndarray]] = None
             ) -> Optional[Dict[str, Any]]:
    """Evaluate in batches of ``batch_size``; None if a stop was requested meanwhile.

    With ``cached`` (``(known, correct, losses)`` per sample, from ``evalcache.lookup``) the
    known samples' results are taken from it and only the others run through the model.
    With ``offset`` (``(vector, rows)``: the model's logit offset, ``priors``, and the samples
    it applies to) those samples are scored on their logits plus the vector.

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
        batch_losses, logits = eval_step(x[batch], y[batch])
        batch_losses, logits = batch_losses.numpy(), logits.numpy()
        if offset is not None:
            batch_losses = _with_offset(batch_losses, logits, y[batch], offset[0], offset[1][batch])
        losses[batch] = batch_losses
        correct[batch] = np.argmax(logits, axis=-1) == y[batch]
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


def offset_rows(groups: Optional[np.ndarray], rows: Optional[np.ndarray], count: int
                ) -> np.ndarray:
    """The samples a model's logit offset applies to.

    ``rows`` (a validation file's ``offset``) if given, else every group but the reference
    (the device's images, not the original domain's), else all.
    """
    if rows is not None:
        return rows
    if groups is None:
        return np.ones(count, dtype=bool)
    return groups.astype(str) != REFERENCE_GROUP


def _with_offset(losses: np.ndarray, logits: np.ndarray, labels: np.ndarray, vector: np.ndarray,
                 rows: np.ndarray) -> np.ndarray:
    """``logits`` plus ``vector`` on ``rows`` (in place); the losses, those rows' recomputed."""
    if not rows.any():
        return losses
    logits[rows] += vector
    shifted = logits[rows] - logits[rows].max(axis=1, keepdims=True)
    losses = np.array(losses, np.float64)
    losses[rows] = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(shifted)),
                                                                  labels[rows]]
    return losses


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


def acceptance_group(groups: Optional[np.ndarray]) -> Optional[str]:
    """The evaluation set's group the acceptance test reads.

    The validation set ("0") if it has one, else the device's held-out images ("1"); None
    without groups.
    """
    names = [] if groups is None else [str(g) for g in np.unique(groups)]
    return next((g for g in ("0", "1") if g in names), None)


def acceptance_rows(groups: Optional[np.ndarray], count: int) -> np.ndarray:
    """Which of ``count`` evaluation images the acceptance test reads.

    ``acceptance_group``'s; every one without such a group.
    """
    group = acceptance_group(groups)
    return np.ones(count, dtype=bool) if group is None else groups.astype(str) == group


def score_group(score: Callable[..., Optional[Dict[str, Any]]], groups: np.ndarray, group: str
                ) -> Optional[Dict[str, Any]]:
    """``score`` (``evaluate`` with ``cached`` passed on) on one group of the evaluation set.

    Every other image counts as known, so only the group's run through the model. The result
    describes the group alone (``accuracy``, ``by_group``, ``samples``; ``per_class`` None);
    ``correct`` and ``losses`` are valid on it only. None on a stop.
    """
    inside = groups.astype(str) == group
    evaluation = score((~inside, np.zeros(len(groups), dtype=bool), np.zeros(len(groups))))
    if evaluation is not None:
        accuracy = evaluation["by_group"][group]
        evaluation.update(accuracy=accuracy, by_group={group: accuracy}, per_class=None,
                          samples=int(np.sum(inside)), cached=0,
                          loss=float(np.mean(evaluation["losses"][inside])))
    return evaluation


def score_rest(score: Callable[..., Optional[Dict[str, Any]]], groups: np.ndarray, group: str,
               first: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Complete ``first`` (``score_group``'s on ``group``) with the other images.

    Returns the full evaluation, its ``seconds`` both passes'; None on a stop.
    """
    inside = groups.astype(str) == group
    evaluation = score((inside, first["correct"], first["losses"]))
    if evaluation is not None:
        evaluation.update(cached=0, seconds=evaluation["seconds"] + first["seconds"])
    return evaluation


def score_candidate(score: Callable[..., Optional[Dict[str, Any]]], groups: Optional[np.ndarray],
                    refused: Optional[Callable[[Dict[str, Any]], bool]]) -> Optional[Dict[str, Any]]:
    """Score a candidate, the acceptance group first.

    The other groups follow unless ``refused`` (of that evaluation) says the acceptance test
    already refuses the candidate. Without ``refused`` or other groups, everything in one pass.
    None on a stop.
    """
    group = acceptance_group(groups)
    if refused is None or groups is None or group is None or len(np.unique(groups)) < 2:
        return score(None)
    first = score_group(score, groups, group)
    if first is None or refused(first):
        return first
    return score_rest(score, groups, group, first)


def refusal_check(correct_before: np.ndarray, groups: np.ndarray, tolerance: float,
                  confidence_z: float) -> Callable[[Dict[str, Any]], bool]:
    """Whether a candidate's evaluation of the acceptance group already fails acceptance.

    The test is the session's (``odtd.session.acceptance.refusal_reason``: the gain less
    ``confidence_z`` standard errors below ``-tolerance``, fractions). A hair of slack keeps
    every candidate the session could accept scored in full.
    """
    inside = groups.astype(str) == acceptance_group(groups)

    def refused(evaluation: Dict[str, Any]) -> bool:
        counts = paired_counts(correct_before[inside], evaluation["correct"][inside], None)["all"]
        gain = (counts["gained"] - counts["lost"]) / float(counts["samples"])
        return acceptance_margin(gain, counts, confidence_z) < -tolerance - 1e-6

    return refused


def reference_check(correct_before: np.ndarray, groups: np.ndarray, reference_group: str,
                    tolerance: float, confidence_z: float, origin_correct: Optional[np.ndarray],
                    origin_accuracy: Optional[float]) -> Callable[[Dict[str, Any]], bool]:
    """Whether a try scored in full spares the reference group, as the session's guard judges.

    The guard's rule (``odtd.session.acceptance.reference_refusal``): a loss against the
    served model (``correct_before``) of more than ``tolerance`` plus ``confidence_z``
    standard errors refuses, and so does one against the home's first model: image by image
    where its results are known (``origin_correct``, the reference images' alone), else by
    ``origin_accuracy`` as measured. A hair of slack keeps every try the guard passes.
    """
    inside = groups.astype(str) == reference_group

    def spared(evaluation: Dict[str, Any]) -> bool:
        after = evaluation["correct"][inside]
        against = [correct_before[inside]]
        if origin_correct is not None:
            against.append(origin_correct)
        for correct in against:
            counts = paired_counts(correct, after, None)["all"]
            loss = (counts["lost"] - counts["gained"]) / float(counts["samples"])
            if loss_margin(loss, counts, confidence_z) > tolerance + 1e-6:
                return False
        return origin_correct is not None or origin_accuracy is None or \
            origin_accuracy - float(np.mean(after)) <= tolerance + 1e-6

    return spared


class OpenCache(NamedTuple):
    """The evaluation cache of the model to beat, as ``open_eval_cache`` found it."""

    weights_sha256: str  # what the cache is keyed by
    precision: str  # and the precision it was scored at
    keys: np.ndarray  # each validation sample's key (``evalcache.sample_keys``)
    cached: Any  # ``evalcache.lookup``'s result for those keys


def open_eval_cache(job: Dict[str, Any], precision: str,
                    validation: Tuple[np.ndarray, np.ndarray]) -> Optional[OpenCache]:
    """The weights' sha256, the sample keys and the cached results, for the "before" evaluation.

    None without ``eval_cache`` or without a weights file to key it by (a fresh init).
    """
    source = job["served_weights"] or job["weights_in"]
    if job["eval_cache"] is None or source is None:
        return None
    weights_sha256 = file_sha256(source)
    keys = evalcache.sample_keys(validation[0], validation[1])
    return OpenCache(weights_sha256, precision, keys,
                     evalcache.lookup(job["eval_cache"], weights_sha256, precision, keys))
