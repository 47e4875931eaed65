"""Judging in the worker: the model to beat and the candidate, scored on the validation set.

``validation_set`` is the job's validation images and how to score them (``Validation``);
``score_before`` scores the model the candidate must beat and builds the acceptance test's early
refusal and the reference guard (``Before``), as the session's guard judges
(``odtd.session.acceptance``); ``round_start_test`` is a federated round's test for its start as
it came (``round_confidence_z``), and ``as_judged`` the test the candidate kept is scored by;
``score_after`` scores the candidate and its paired counts. ``training.train_and_evaluate``
runs them in order.

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import contextlib
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

import numpy as np

from odtd.trainer.learning import evalcache
from odtd.trainer.learning.evaluation import (
    REFERENCE_GROUP,
    OpenCache,
    evaluate,
    make_eval_step,
    offset_rows,
    open_eval_cache,
    paired_counts,
    reference_check,
    refusal_check,
    score_candidate,
    unless_stopped,
)
from odtd.trainer.learning.step import Emit
from odtd.trainer.protocol.paired import round_model_as_sent


@contextlib.contextmanager
def serving(model: Any, served_weights: Optional[List[np.ndarray]]) -> Iterator[None]:
    """Within, the model holds ``served_weights`` (the served model's), if given."""
    if served_weights is None:
        yield
        return
    start_weights = model.get_weights()
    model.set_weights(served_weights)
    try:
        yield
    finally:
        model.set_weights(start_weights)


class Validation(NamedTuple):
    """The validation set as one job scores it."""

    x: np.ndarray
    y: np.ndarray
    groups: Optional[np.ndarray]  # each image's group (acceptance, reference), if any
    score: Callable[..., Optional[Dict[str, Any]]]  # ``evaluate(cached)`` over it; None: stopped
    cache: Optional[OpenCache]  # the model to beat's cached results, with ``eval_cache``
    # The logit offset (``priors``) ``score`` applies to the device's images (every group but
    # the reference): ``offset["vector"]``, None for none. The served model's, then the
    # candidate's once ``priors.correct_priors`` has estimated it.
    offset: Dict[str, Optional[np.ndarray]]
    eval_step: Callable[[Any, Any], Any]  # ``make_eval_step``'s: (losses, logits) of a batch


class Before(NamedTuple):
    """The model to beat, scored."""

    correct: np.ndarray  # each validation image's correctness
    refused: Optional[Callable[[Dict[str, Any]], bool]]  # the acceptance test's early refusal
    # Whether a try of the choosers (``auto``) spares the reference, as the guard judges; None
    # without a guarded reference group (they then hold tries to ``reference_bar``).
    spared: Optional[Callable[[Dict[str, Any]], bool]] = None
    # The home's first model's correctness on each reference image (``origin_eval_cache``),
    # read once: the choosers' check and the candidate's paired counts both use it.
    origin_correct: Optional[np.ndarray] = None
    losses: Optional[np.ndarray] = None  # each validation image's loss


def validation_set(tf: Any, job: Dict[str, Any], model: Any, precision: str,
                   data: Dict[str, Any], should_stop: Callable[[], bool]
                   ) -> Optional[Validation]:
    """The job's validation set and how to score it, None without one."""
    if data.get("validation_data") is None:
        return None
    x, y = data["validation_data"]
    groups = data.get("validation_groups")
    eval_step = make_eval_step(tf, model, job)
    # Evaluating at the training batch size (the default) keeps the session's memory within
    # what the profile measured for that size.
    eval_batch_size = job["eval_batch_size"] or job["batch_size"]
    offset = {"vector": None if job["logit_offset"] is None
              else np.asarray(job["logit_offset"], np.float32)}
    device_rows = offset_rows(groups, data.get("validation_offset_rows"), len(y))

    def score(cached: Any = None) -> Optional[Dict[str, Any]]:
        vector = offset["vector"]
        return evaluate(eval_step, x, y, len(job["classes"]), eval_batch_size, should_stop,
                        groups, cached, None if vector is None else (vector, device_rows))

    return Validation(x, y, groups, score, open_eval_cache(job, precision, (x, y)), offset,
                      eval_step)


def score_before(job: Dict[str, Any], model: Any, precision: str, validation: Validation,
                 served_weights: Optional[List[np.ndarray]], emit: Emit, fields: Dict[str, Any]
                 ) -> Before:
    """Score the model to beat (kept in the eval cache); its figures go to ``fields``."""
    cache = validation.cache
    with serving(model, served_weights):
        before = unless_stopped(validation.score(cache and cache.cached))
    correct, losses = before.pop("correct"), before.pop("losses")
    if cache is not None:
        evalcache.save(job["eval_cache"], cache.weights_sha256, precision, cache.keys, correct,
                       losses)
    emit("eval", phase="before", **before)
    fields["accuracy_before"] = before["accuracy"]
    fields["per_class_before"] = before["per_class"]
    fields["by_group_before"] = before["by_group"]
    refused = spared = None
    if job["acceptance_tolerance"] is not None and validation.groups is not None:
        # A candidate refused on the acceptance group is not scored on the rest.
        refused = refusal_check(correct, validation.groups, job["acceptance_tolerance"],
                                job["confidence_z"])
    origin = _origin_correct(job, validation)
    if job["reference_tolerance"] is not None and REFERENCE_GROUP in before["by_group"]:
        spared = reference_check(correct, validation.groups, REFERENCE_GROUP,
                                 job["reference_tolerance"], job["confidence_z"], origin,
                                 job["reference_origin"])
    return Before(correct, refused, spared, origin, losses)


def reference_bar(job: Dict[str, Any], fields: Dict[str, Any]) -> Optional[float]:
    """What a try the choosers (``auto``) keep must not lose more than the tolerance against.

    On the reference group, where there is no guard's check (``Before.spared``): the served
    model's accuracy there, or the first model's where that is higher, as measured.
    """
    return reference_held(fields.get("by_group_before"), job["reference_origin"])


def round_start_test(job: Dict[str, Any], validation: Optional[Validation],
                     before: Optional[Before]) -> Optional[Callable[[Dict[str, Any]], bool]]:
    """The acceptance test of a federated round's start as it came, where the job sets one.

    ``round_confidence_z`` standard errors instead of ``confidence_z`` (``refusal_check``);
    None where the job has no acceptance test or no round margin, or is no federated round.
    """
    if job["round_confidence_z"] is None or job["average_with"] == "served" or before is None \
            or before.refused is None or validation is None:
        return None
    return refusal_check(before.correct, validation.groups, job["acceptance_tolerance"],
                         job["round_confidence_z"])


def as_judged(job: Dict[str, Any], validation: Optional[Validation], before: Optional[Before],
              fields: Dict[str, Any]) -> Optional[Before]:
    """``before`` with the test the session's guard applies to the candidate kept.

    A federated round that kept its start as it came (``trained_share`` 0, not averaged with
    the served model after) is judged by ``round_confidence_z``: the candidate's scoring then
    reads that test, so a candidate the guard passes is scored on every group.
    """
    test = round_start_test(job, validation, before) if round_model_as_sent(
        fields.get("trained_share"), fields.get("served_share")) else None
    return before if test is None else before._replace(refused=test)


def score_after(job: Dict[str, Any], validation: Validation, before: Before,
                after: Optional[Dict[str, Any]], emit: Emit, fields: Dict[str, Any],
                scored_after: Optional[Dict[str, np.ndarray]]) -> np.ndarray:
    """Score the candidate (unless a chooser did); its figures and paired counts to ``fields``.

    Returns:
        Each validation image's correctness under the candidate.
    """
    groups = validation.groups
    if after is None:
        after = unless_stopped(score_candidate(validation.score, groups, before.refused))
    correct_after, losses_after = after.pop("correct"), after.pop("losses")
    # A refused candidate's evaluation may hold the acceptance group alone.
    fields["paired_by_group"] = {
        name: counts for name, counts in paired_counts(before.correct, correct_after, groups).items()
        if groups is None or name in after["by_group"]}
    complete = groups is None or len(after["by_group"]) == len(np.unique(groups))
    if scored_after is not None and complete:
        keys = validation.cache.keys if validation.cache is not None else evalcache.sample_keys(
            validation.x, validation.y)
        scored_after.update(keys=keys, correct=correct_after, losses=losses_after)
    if before.origin_correct is not None and REFERENCE_GROUP in after["by_group"]:
        mask = validation.groups.astype(str) == REFERENCE_GROUP
        fields["reference_paired_origin"] = paired_counts(
            before.origin_correct, correct_after[mask], None)["all"]
    emit("eval", phase="after", **after)
    fields["accuracy_after"] = after["accuracy"]
    fields["per_class_after"] = after["per_class"]
    fields["by_group_after"] = after["by_group"]
    return correct_after


def _origin_correct(job: Dict[str, Any], validation: Validation) -> Optional[np.ndarray]:
    # The home's first model's correctness on each reference image (job key
    # ``origin_eval_cache``), or None where its results do not cover every one.
    cache = validation.cache
    if job["origin_eval_cache"] is None or cache is None or validation.groups is None:
        return None
    mask = validation.groups.astype(str) == REFERENCE_GROUP
    origin = evalcache.lookup(job["origin_eval_cache"], None, cache.precision, cache.keys[mask])
    if origin is None or not origin[0].all():
        return None
    return origin[1]


def reference_held(by_group_before: Optional[Dict[str, float]], origin: Optional[float]
                   ) -> Optional[float]:
    """The reference accuracy a candidate is held to (less the tolerance), or None.

    The served model's, or ``origin`` (the job's ``reference_origin``) where that is higher;
    None without a reference group.
    """
    before = (by_group_before or {}).get(REFERENCE_GROUP)
    if before is None or origin is None:
        return before
    return max(before, origin)
