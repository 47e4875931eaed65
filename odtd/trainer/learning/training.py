"""Training in the worker: one job's order of work around the steps, and its trainable scope.

``train_and_evaluate`` is one ``train`` or ``profile`` job's work, as named steps with typed
results: score the model the candidate must beat, train, recalibrate or adapt BatchNorm, average
with the served model, estimate the device's class priors (``priors``), score the candidate.
Every model is called through ``networks.forward``, so built-in and imported models are trained
alike.

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import contextlib
import gc
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import numpy as np

from odtd.trainer.learning import evalcache, priors, pseudo
from odtd.trainer.learning.averaging import AUTO_SHARES, ROUND_SHARES, average_with_served, mixes_served
from odtd.trainer.learning.batchnorm import (
    AUTO,
    AUTO_WEIGHT_BEFORE,
    adapt_batchnorm,
    batchnorm_layers,
    recalibrate_batchnorm,
)
from odtd.trainer.learning.distill import Teacher, teacher_targets
from odtd.trainer.learning.evaluation import (
    REFERENCE_GROUP,
    OpenCache,
    Stopped,
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
from odtd.trainer.learning.scope import set_trainable_scope
from odtd.trainer.learning.step import (
    Emit,
    Trained,
    balanced_adjustment,
    iterate_batches,
    release_free_heap,
    train_steps,
)
from odtd.trainer.plans.fused_batchnorm import fuse, keep_relu_apart


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
    # without a guarded reference group (they then hold tries to ``_reference_bar``).
    spared: Optional[Callable[[Dict[str, Any]], bool]] = None
    # The home's first model's correctness on each reference image (``origin_eval_cache``),
    # read once: the choosers' check and the candidate's paired counts both use it.
    origin_correct: Optional[np.ndarray] = None
    losses: Optional[np.ndarray] = None  # each validation image's loss


def train_and_evaluate(tf: Any, job: Dict[str, Any], model: Any, precision: str,
                       data: Dict[str, Any], should_stop: Callable[[], bool], emit: Emit,
                       served_weights: Optional[List[np.ndarray]] = None,
                       scored_after: Optional[Dict[str, np.ndarray]] = None,
                       keep_trained: Optional[Callable[[List[np.ndarray]], None]] = None
                       ) -> Dict[str, Any]:
    """Evaluate before, train, evaluate after; return the result fields this produces.

    The steps, in order: ``prepare_model``, ``score_before``, ``refresh_priors``,
    ``pseudo.pseudo_label``, ``distillation_targets``, ``adapt_before``, ``train``,
    ``settle_batchnorm``, ``average``, ``priors.correct_priors``, ``score_after``. A stop
    requested during any of them ends the job ``interrupted`` with the fields so far.

    With ``served_weights`` (the job's ``served_weights`` arrays) the "before" figures are that
    model's (the one the candidate must beat), and so is distillation's teacher; training then
    starts from the weights as loaded.
    ``scored_after``, if given, receives the trained model's per-sample validation results
    (``keys``, ``correct``, ``losses``: ``evalcache.save``'s arguments).
    ``keep_trained``, if given, is handed the trained weights before ``average`` changes
    them (not called where nothing is averaged: the candidate is then the trained model).
    """
    fields = {"status": "interrupted"}  # type: Dict[str, Any]
    try:
        served = prepare_model(tf, job, model, served_weights, fields)
        validation = None if job["mode"] == "profile" else validation_set(
            tf, job, model, precision, data, should_stop)
        before = None
        if validation is not None:
            before = score_before(job, model, precision, validation, served_weights, emit, fields)
            refresh_priors(job, model, data, validation, before, served_weights, should_stop,
                           fields)
        if job["pseudo_labels"] is not None and job["mode"] == "train":
            with serving(model, served_weights):  # the model the candidate must beat labels them
                pseudo.pseudo_label(job, data, validation and validation.eval_step, should_stop, fields)
        teacher = distillation_targets(tf, job, model, data, served_weights, should_stop, fields)
        device_split = data.get("device_split") if job["bn_device_share"] is not None else None
        if device_split is not None:  # the steps see the device's statistics
            fields["adapt_seconds"] = adapt_before(tf, job, model, device_split, should_stop)
        trained = train(tf, job, model, precision, data["train_data"][0], data["train_data"][1],
                        teacher, should_stop, emit, fields)
        if trained.diverged_at_step is not None or should_stop():
            return fields  # no candidate: nothing more to score
        after = settle_batchnorm(tf, job, model, data, device_split, validation, before,
                                 should_stop, fields)
        if served is not None:  # the candidate: the trained weights averaged with the served
            if keep_trained is not None:
                keep_trained(model.get_weights())
            after = average(job, model, served, validation, before, fields)
            if mixes_served(job, served_weights, validation):
                after = average(job, model, served_weights, validation, before, fields,
                                AUTO, "served_share")
        if priors.correct_priors(job, data, validation, should_stop, fields):
            after = None  # any chooser's scores were without the candidate's offset
        if validation is not None:
            score_after(job, validation, as_judged(job, validation, before, fields), after, emit,
                        fields, scored_after)
        fields["status"] = "ok"
    except Stopped:
        pass
    return fields


def refresh_priors(job: Dict[str, Any], model: Any, data: Dict[str, Any],
                   validation: Validation, before: Before,
                   served_weights: Optional[List[np.ndarray]],
                   should_stop: Callable[[], bool], fields: Dict[str, Any]) -> None:
    """The served model with the device's priors estimated anew, before anything trains.

    ``priors.refresh_served`` on the served weights (``served_weights``, else the model as
    loaded). Only with ``prior_correction`` in a training job. The session serves it where it
    scores above both the served model and the trained candidate (``session.promotion``).
    Where it scores at least as high as the served version's own offset on the acceptance
    group, its offset is the one the choosers (``settle_batchnorm``, ``average``) then score
    their tries with, so a share or mixture is judged under the device's priors of today, not
    under an older offset (or none, before the first promotion): a try that learned the
    device's uneven mix from its labels is not counted twice over. Where it scores lower (an
    estimate on trained weights, calibrated on the reference images, can be worse than the
    one the version was promoted with) the tries keep the served version's.
    """
    if not job["prior_correction"] or job["mode"] != "train":
        return
    with serving(model, served_weights):
        offset = priors.refresh_served(job, data, validation, (before.correct, before.losses),
                                       should_stop, fields)
    if offset is not None and fields["prior_refresh"]["acceptance"]["refresh"] >= \
            fields["prior_refresh"]["acceptance"]["served"]:
        validation.offset["vector"] = offset


def prepare_model(tf: Any, job: Dict[str, Any], model: Any,
                  served_weights: Optional[List[np.ndarray]], fields: Dict[str, Any]
                  ) -> Optional[List[np.ndarray]]:
    """Set the trainable scope and BatchNorm's kernel; the weights to average with, if any."""
    fields["trainable_layers"] = set_trainable_scope(tf, model, job["trainable"])
    served = None  # the weights the trained ones are averaged with (trained_share)
    if job["trained_share"] != 1.0 and job["mode"] == "train":
        # A federated round averages with its start, the global model: the candidate is the
        # global model plus a share of the device's update (the server gets all of it:
        # ``trained_out``).
        served = served_weights if served_weights is not None and job["average_with"] == "served" \
            else model.get_weights()
    if job["freeze_bn"]:
        # A non-trainable BatchNormalization runs in inference mode in tf.keras 2 and Keras 3:
        # moving statistics, gamma and beta all stay as loaded.
        for layer in batchnorm_layers(tf, model):
            layer.trainable = False
    # Keras 3's BatchNormalization trains with the fused kernel, as tf.keras 2's always does
    # (docs/memory.md, "Fused BatchNorm under Keras 3"); before the train step is traced.
    fields["fused_batchnorm"] = fuse(tf, model)
    fields["batchnorm_relu_apart"] = keep_relu_apart(tf, model)
    return served


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


def distillation_targets(tf: Any, job: Dict[str, Any], model: Any, data: Dict[str, Any],
                         served_weights: Optional[List[np.ndarray]],
                         should_stop: Callable[[], bool],
                         fields: Dict[str, Any]) -> Teacher:
    """The served model's targets on the rehearsed images; all weight 0 with nothing to distil."""
    x_train, y_train = data["train_data"]
    if job["distill"] and data.get("rehearsed") is not None and job["mode"] != "profile":
        with serving(model, served_weights):  # before any adaptation
            teacher = unless_stopped(teacher_targets(tf, model, job, x_train, data["rehearsed"],
                                                      _forward_batch(job), should_stop))
        fields["distill_images"] = int(np.count_nonzero(teacher.weights))
        return teacher
    return Teacher(np.zeros((len(y_train), len(job["classes"])), np.float32),
                   np.zeros(len(y_train), np.float32))


def _forward_batch(job: Dict[str, Any]) -> int:
    """Images per forward pass outside a step: no more memory than a step's."""
    return job["micro_batch_size"] or job["batch_size"]


def adapt_before(tf: Any, job: Dict[str, Any], model: Any,
                 device_split: Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]],
                 should_stop: Callable[[], bool]) -> float:
    """BatchNorm's statistics set to the device's mixture before training; the seconds taken."""
    weight = job["bn_device_share"]
    adapted = unless_stopped(adapt_batchnorm(
        tf, model, job, device_split[0], device_split[1], _forward_batch(job), should_stop,
        AUTO_WEIGHT_BEFORE if weight == AUTO else weight, device_y=device_split[2]))
    return adapted.seconds


def train(tf: Any, job: Dict[str, Any], model: Any, precision: str, x_train: np.ndarray,
          y_train: np.ndarray, teacher: Teacher, should_stop: Callable[[], bool], emit: Emit,
          fields: Dict[str, Any]) -> Trained:
    """Run the job's steps (``train_steps``); then free the step's graph and heap."""
    profiling = job["mode"] == "profile"
    inputs = (tf.constant(x_train), tf.constant(y_train), tf.constant(teacher.logits),
              tf.constant(teacher.weights))
    # Finite either way (profile mode requires max_steps); the count sizes the schedule.
    batches = list(iterate_batches(len(y_train), job["batch_size"],
                                   None if profiling else job["epochs"], job["max_steps"],
                                   np.random.RandomState(job["seed"])))
    adjustment = None
    if job["balanced_loss"] and not profiling and job["objective"] != "entropy":
        adjustment = balanced_adjustment(y_train, len(job["classes"]))
        fields["balanced_loss"] = [round(float(v), 4) for v in adjustment]
    trained = train_steps(tf, job, model, precision, inputs, batches, should_stop, emit,
                          adjustment)
    fields.update(steps=trained.steps, samples=trained.samples, train_seconds=trained.seconds,
                  pool_first=trained.pool_first, heap_released=trained.heap_released,
                  learning_rate=trained.learning_rate, clip_norm=job["clip_norm"])
    if trained.diverged:
        fields["lr_attempts"] = trained.diverged
    if trained.diverged_at_step is not None:
        # No candidate, nothing more to score. (A float16 step that overflowed and was
        # skipped by loss scaling leaves the weights finite: training goes on.)
        fields.update(status="diverged", diverged_at_step=trained.diverged_at_step)
    # The step's graph is not run again: freed, and the heap it held given back, before the
    # passes after training trace theirs (a session's peak could otherwise come after its steps).
    gc.collect()
    release_free_heap()
    return trained


def _reference_bar(job: Dict[str, Any], fields: Dict[str, Any]) -> Optional[float]:
    # What a try the choosers (``auto``) keep must not lose more than the tolerance against on
    # the reference group where there is no guard's check (``Before.spared``): the served
    # model's accuracy there, or the first model's where that is higher, as measured.
    return reference_held(fields.get("by_group_before"), job["reference_origin"])


def settle_batchnorm(tf: Any, job: Dict[str, Any], model: Any, data: Dict[str, Any],
                     device_split: Optional[Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]],
                     validation: Optional[Validation], before: Optional[Before],
                     should_stop: Callable[[], bool], fields: Dict[str, Any]
                     ) -> Optional[Dict[str, Any]]:
    """BatchNorm's statistics under the trained weights: adapted, or recalibrated.

    Returns:
        The candidate's evaluation where ``auto`` chose the mixture by scoring it, else None.
    """
    if device_split is not None:  # again, under the trained weights; it replaces recalibration
        weight = job["bn_device_share"]
        if validation is None and weight == AUTO:
            weight = AUTO_WEIGHT_BEFORE  # nothing to choose by
        adapted = unless_stopped(adapt_batchnorm(
            tf, model, job, device_split[0], device_split[1], _forward_batch(job), should_stop,
            weight, validation and validation.score, _reference_bar(job, fields),
            validation and validation.groups, before and before.refused,
            before and before.spared, device_y=device_split[2]))
        fields["adapt_seconds"] += adapted.seconds
        if adapted.tried:  # auto: the mixture kept, already scored
            fields["bn_device_share"], fields["bn_shares_tried"] = adapted.weight, adapted.tried
            return adapted.scores
    elif job["recalibrate_bn"] and not job["freeze_bn"]:  # in profile mode too: its memory counts
        fields["recalibrate_seconds"] = unless_stopped(recalibrate_batchnorm(
            tf, model, job, data["train_data"][0], _forward_batch(job), should_stop))
    return None


def average(job: Dict[str, Any], model: Any, partner: List[np.ndarray],
            validation: Optional[Validation], before: Optional[Before], fields: Dict[str, Any],
            share: Any = None, field: str = "trained_share") -> Optional[Dict[str, Any]]:
    """The candidate as the model's weights averaged with ``partner``.

    ``share`` is the model's (default: ``training.trained_share``); what was kept goes to
    ``fields[field]`` and, under ``auto``, the tries to ``fields[field + "s_tried"]``.

    Returns:
        The candidate's evaluation where ``auto`` chose the share by scoring it, else None (a
        mixture's earlier score is stale now).
    """
    # A federated round's first average is with its start: the start itself is one of the tries,
    # judged by the round's own acceptance test where the job sets one.
    round_start = field == "trained_share" and job["average_with"] != "served"
    shares = ROUND_SHARES if round_start else AUTO_SHARES
    start_test = round_start_test(job, validation, before) if round_start else None
    refused_at = None if start_test is None else {0.0: start_test}
    averaged = unless_stopped(average_with_served(
        model, partner, job["trained_share"] if share is None else share,
        validation and validation.score, validation and validation.groups,
        _reference_bar(job, fields), job["reference_tolerance"],
        before and before.refused, before and before.spared, shares, refused_at))
    fields[field] = averaged.share
    if averaged.tried:
        fields[field + "s_tried"] = averaged.tried
    return averaged.scores


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
    test = round_start_test(job, validation, before) \
        if fields.get("trained_share") == 0.0 and fields.get("served_share") in (None, 1.0) else None
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
