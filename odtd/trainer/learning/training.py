"""Training in the worker: one job's order of work around the steps, and its trainable scope.

``train_and_evaluate`` is one ``train`` or ``profile`` job's work, as named steps with typed
results: score the model the candidate must beat, train, recalibrate or adapt BatchNorm, average
with the served model, estimate the device's class priors (``priors``), score the candidate
(the scoring and its tests: ``judging``).
Every model is called through ``networks.forward``, so built-in and imported models are trained
alike.

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import gc
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from odtd.trainer.learning import priors, pseudo
from odtd.trainer.learning.averaging import AUTO_SHARES, ROUND_SHARES, average_with_served, mixes_served
from odtd.trainer.learning.batchnorm import (
    AUTO,
    AUTO_WEIGHT_BEFORE,
    adapt_batchnorm,
    batchnorm_layers,
    recalibrate_batchnorm,
)
from odtd.trainer.learning.distill import Teacher, teacher_targets
from odtd.trainer.learning.evaluation import Stopped, unless_stopped
from odtd.trainer.learning.judging import (
    Before,
    Validation,
    as_judged,
    reference_bar,
    round_start_test,
    score_after,
    score_before,
    serving,
    validation_set,
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
            weight, validation and validation.score, reference_bar(job, fields),
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
        reference_bar(job, fields), job["reference_tolerance"],
        before and before.refused, before and before.spared, shares, refused_at))
    fields[field] = averaged.share
    if averaged.tried:
        fields[field + "s_tried"] = averaged.tried
    return averaged.scores


