"""Training in the worker: one job's order of work around the steps, and its trainable scope.

``train_and_evaluate`` is one ``train`` or ``profile`` job's work: score the model the candidate
must beat, train, recalibrate BatchNorm, average with the served model, score the candidate.
Every model is called through ``networks.forward``, so built-in and imported models are trained
alike.

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import contextlib
import ctypes
import gc
import math
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import numpy as np

from odtd.trainer.learning import evalcache
from odtd.trainer.learning.averaging import average_with_served
from odtd.trainer.learning.batchnorm import (
    AUTO,
    AUTO_WEIGHT_BEFORE,
    REFERENCE_GROUP,
    adapt_batchnorm,
    batchnorm_layers,
    recalibrate_batchnorm,
)
from odtd.trainer.learning.distill import teacher_targets
from odtd.trainer.learning.evaluation import (
    evaluate,
    make_eval_step,
    open_eval_cache,
    paired_counts,
    refusal_check,
    score_candidate,
)
from odtd.trainer.learning.step import (
    iterate_batches,
    make_forward,
    make_optimizer,
    make_rate,
    make_train_step,
)
from odtd.trainer.models.imported import leaf_layers
from odtd.trainer.plans.fused_batchnorm import fuse, keep_relu_apart

Emit = Callable[..., None]


@contextlib.contextmanager
def serving(model: Any, baseline: Optional[List[np.ndarray]]) -> Iterator[None]:
    """Within, the model holds ``baseline``'s weights (the served model's), if given."""
    if baseline is None:
        yield
        return
    start_weights = model.get_weights()
    model.set_weights(baseline)
    try:
        yield
    finally:
        model.set_weights(start_weights)


def release_free_heap() -> bool:
    """Give the free pages inside malloc's heap back to the system (glibc's ``malloc_trim``).

    The first train step traces its graph and optimises it; what that leaves freed in the heap
    (about 40 MB for DenseNet40) would stay resident under every later step's tensors, and the
    step's graph, once freed after the last step, under the passes after training. Returns
    False where the C library has no ``malloc_trim`` or nothing was returned.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))


def train_and_evaluate(tf: Any, job: Dict[str, Any], model: Any, precision: str,
                       data: Dict[str, Tuple[np.ndarray, np.ndarray]],
                       should_stop: Callable[[], bool], emit: Emit,
                       baseline: Optional[List[np.ndarray]] = None,
                       scored_after: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, Any]:
    """Evaluate before, train, evaluate after; return the result fields this produces.

    With ``baseline`` (the ``baseline_weights`` arrays) the "before" figures are that model's
    (the one the candidate must beat), and so is distillation's teacher; training then starts
    from the weights as loaded.
    ``scored_after``, if given, receives the trained model's per-sample validation results
    (``keys``, ``correct``, ``losses``: ``evalcache.save``'s arguments).
    """
    fields = {"status": "interrupted",
              "trainable_layers": set_trainable_scope(tf, model, job["trainable"])}  # type: Dict[str, Any]
    served = None  # the weights the trained ones are averaged with (trained_share)
    if job["trained_share"] != 1.0 and job["mode"] == "train":
        served = baseline if baseline is not None else model.get_weights()
    if job["freeze_bn"]:
        # A non-trainable BatchNormalization runs in inference mode in tf.keras 2 and Keras 3:
        # moving statistics, gamma and beta all stay as loaded.
        for layer in batchnorm_layers(tf, model):
            layer.trainable = False
    # Keras 3's BatchNormalization trains with the fused kernel, as tf.keras 2's always does
    # (docs/memory.md, "Fused BatchNorm under Keras 3"); before the train step is traced.
    fields["fused_batchnorm"] = fuse(tf, model)
    fields["batchnorm_relu_apart"] = keep_relu_apart(tf, model)
    profiling = job["mode"] == "profile"
    num_classes = len(job["classes"])
    batch_size = job["batch_size"]
    validation = None if profiling else data.get("validation_data")
    # Evaluating at the training batch size (the default) keeps the session's memory within
    # what the profile measured for that size.
    eval_batch_size = job["eval_batch_size"] or batch_size
    groups = score = refused = None  # type: Any
    if validation is not None:
        groups = data.get("validation_groups")
        eval_step = make_eval_step(tf, model, job)
        cache = open_eval_cache(job, precision, validation)
        with serving(model, baseline):
            before = evaluate(eval_step, validation[0], validation[1], num_classes,
                              eval_batch_size, should_stop, groups, cache and cache[2])
        if before is None:
            return fields
        correct_before = before.pop("correct")
        losses_before = before.pop("losses")
        if cache is not None:
            evalcache.save(job["eval_cache"], cache[0], precision, cache[1], correct_before,
                           losses_before)
        emit("eval", phase="before", **before)
        fields["accuracy_before"] = before["accuracy"]
        fields["per_class_before"] = before["per_class"]
        fields["by_group_before"] = before["by_group"]

        def score(cached: Any = None) -> Optional[Dict[str, Any]]:
            return evaluate(eval_step, validation[0], validation[1], num_classes,
                            eval_batch_size, should_stop, groups, cached)

        if job["acceptance_tolerance"] is not None and groups is not None:
            # A candidate refused on the acceptance group is not scored on the rest.
            refused = refusal_check(correct_before, groups, job["acceptance_tolerance"],
                                    job["confidence_z"])

    x_train, y_train = data["train_data"]
    adapt_batch_size = job["micro_batch_size"] or batch_size  # forward passes: a step's memory
    teacher = None  # the served model's view of the rehearsed images, before any adaptation
    if job["distill"] and data.get("rehearsed") is not None and not profiling:
        with serving(model, baseline):
            teacher = teacher_targets(tf, model, job, x_train, data["rehearsed"],
                                      adapt_batch_size, should_stop)
        if teacher is None:
            return fields
        fields["distill_images"] = int(np.count_nonzero(teacher[1]))
    if teacher is None:  # nothing to distil: the step's teacher inputs, all weight 0
        teacher = (np.zeros((len(y_train), num_classes), np.float32),
                   np.zeros(len(y_train), np.float32))
    device_split = data.get("device_split") if job["bn_device_weight"] is not None else None
    weight = job["bn_device_weight"]
    if device_split is not None:  # the steps see the device's statistics
        adapted = adapt_batchnorm(tf, model, job, device_split[0], device_split[1],
                                  adapt_batch_size, should_stop,
                                  AUTO_WEIGHT_BEFORE if weight == AUTO else weight)
        if adapted is None:
            return fields
        fields["adapt_seconds"] = adapted[0]
    inputs = (tf.constant(x_train), tf.constant(y_train), tf.constant(teacher[0]),
              tf.constant(teacher[1]))
    # Finite either way (profile mode requires max_steps); the count sizes the schedule.
    batches = list(iterate_batches(len(y_train), batch_size, None if profiling else job["epochs"],
                                   job["max_steps"], np.random.RandomState(job["seed"])))
    trained = train_steps(tf, job, model, precision, inputs, batches, should_stop, emit)
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
    if should_stop() or fields["status"] == "diverged":
        return fields
    after = None
    # What a try the choosers (``auto``) keep must not lose more than the tolerance against on
    # the reference group: the before model's accuracy there, or the first model's where that
    # is higher. As measured; the session's guard allows the before model's a margin of
    # standard errors (acceptance.reference_refusal), so a try that clears this bar passes there.
    reference_bar = reference_held(fields.get("by_group_before"), job["reference_origin"])
    if device_split is not None:  # again, under the trained weights; it replaces recalibration
        if validation is None and weight == AUTO:
            weight = AUTO_WEIGHT_BEFORE  # nothing to choose by
        adapted = adapt_batchnorm(tf, model, job, device_split[0], device_split[1],
                                  adapt_batch_size, should_stop, weight, score, reference_bar,
                                  groups, refused)
        if adapted is None:
            return fields
        fields["adapt_seconds"] += adapted[0]
        if adapted[3]:  # auto: the mixture kept, already scored
            fields["bn_device_weight"], after, fields["bn_weights_tried"] = adapted[1:]
    elif job["recalibrate_bn"] and not job["freeze_bn"]:  # in profile mode too: its memory counts
        fields["recalibrate_seconds"] = recalibrate_batchnorm(
            tf, model, job, x_train, adapt_batch_size, should_stop)
        if fields["recalibrate_seconds"] is None:
            return fields
    if served is not None:  # the candidate: the trained weights averaged with the served ones
        averaged = average_with_served(
            model, served, job["trained_share"], score, groups, reference_bar,
            job["reference_tolerance"], refused)
        if averaged is None:
            return fields
        fields["trained_share"], after, tried = averaged  # a mixture's score is stale now
        if tried:
            fields["trained_shares_tried"] = tried
    if validation is not None:
        if after is None:
            after = score_candidate(score, groups, refused)
        if after is None:
            return fields
        correct_after, losses_after = after.pop("correct"), after.pop("losses")
        # A refused candidate's evaluation may hold the acceptance group alone.
        fields["paired_by_group"] = {
            name: counts for name, counts in paired_counts(correct_before, correct_after, groups).items()
            if groups is None or name in after["by_group"]}
        complete = groups is None or len(after["by_group"]) == len(np.unique(groups))
        if scored_after is not None and complete:
            keys = cache[1] if cache is not None else evalcache.sample_keys(*validation)
            scored_after.update(keys=keys, correct=correct_after, losses=losses_after)
        emit("eval", phase="after", **after)
        fields["accuracy_after"] = after["accuracy"]
        fields["per_class_after"] = after["per_class"]
        fields["by_group_after"] = after["by_group"]
    fields["status"] = "ok"
    return fields


BLOWN_UP = 100.0  # a loss this many times the attempt's first (or chance's) has diverged


def diverging(loss: float, first_loss: float, num_classes: int, model: Any) -> bool:
    """Whether a step's loss says training diverged.

    A loss that is not finite, with weights no longer finite (a float16 step that overflowed
    and was skipped by loss scaling leaves the weights finite: training goes on), or a finite
    loss ``BLOWN_UP`` times the attempt's first step's, or chance's (log of the classes), if
    that is higher: a probability of e**-160 for the right class among five, where an
    exponential overflowed (seen: 458 -> 3e30 -> 15 on a model that then served nonsense).
    """
    if not np.isfinite(loss):
        return not all(np.isfinite(array).all() for array in model.get_weights())
    return loss > BLOWN_UP * max(first_loss if np.isfinite(first_loss) else 0.0,
                                 math.log(max(num_classes, 2)))


class Trained(NamedTuple):
    """What ``train_steps`` did: its steps (every attempt's), and each attempt that diverged."""

    steps: int
    samples: int
    seconds: float
    learning_rate: float  # the last attempt's peak rate
    diverged: List[Dict[str, Any]]  # {"learning_rate", "diverged_at_step"} per attempt
    diverged_at_step: Optional[int]  # the last attempt's step, None where it trained
    pool_first: List[str]
    heap_released: Optional[bool]


def train_steps(tf: Any, job: Dict[str, Any], model: Any, precision: str, inputs: Tuple[Any, ...],
                batches: List[Tuple[int, np.ndarray]], should_stop: Callable[[], bool],
                emit: Emit) -> Trained:
    """Run the job's steps over ``batches``; after a divergence, again at a lower rate.

    A train job's step that ``diverging`` finds ends the attempt. While ``diverged_retries``
    allows, the model is set back to its weights before the first step (its BatchNorm
    statistics too), a new optimizer takes ``diverged_lr_factor`` times the rate and the steps
    run again from the first batch. A profile job never retries.

    Args:
        tf: TensorFlow.
        job: the job (``learning_rate``, ``clip_norm``, ``diverged_retries``, ...).
        model: the model, as the steps start from it.
        precision: the resolved precision (the optimizer's loss scaling).
        inputs: the training images, labels, distillation targets and their weights (tensors).
        batches: ``(epoch, indices)`` per step, from ``step.iterate_batches``.
        should_stop: true once a stop was asked for (at the next step boundary).
        emit: prints a worker event (``step``, ``retry``).
    """
    profiling = job["mode"] == "profile"
    retries = 0 if profiling else job["diverged_retries"]
    start_weights = model.get_weights() if retries else None
    images, labels, soft, soft_weights = inputs
    rate_peak, diverged = job["learning_rate"], []  # type: float, List[Dict[str, Any]]
    steps = samples = 0
    pool_first, heap_released = [], None  # type: List[str], Optional[bool]
    started = time.monotonic()
    while True:
        rate = make_rate(tf, job, None if profiling else len(batches), rate_peak)
        forward = make_forward(tf, model, job)
        pool_first = list(getattr(forward, "swapped", []))
        train_step = make_train_step(tf, model, forward, make_optimizer(tf, job, precision, rate),
                                     job)
        diverged_at, first_loss = None, float("nan")
        for index, (epoch, indices) in enumerate(batches):
            if should_stop():
                break
            start = time.monotonic()
            batch = tf.constant(indices)
            loss = float(train_step(tf.gather(images, batch), tf.gather(labels, batch),
                                    tf.gather(soft, batch), tf.gather(soft_weights, batch)))
            end = time.monotonic()
            emit("step", index=steps, epoch=epoch, batch_size=len(indices), loss=loss,
                 lr=float(rate(index)) if callable(rate) else rate, start=start, end=end,
                 attempt=len(diverged))
            steps += 1
            samples += len(indices)
            if steps == 1:
                heap_released = release_free_heap()
            first_loss = loss if index == 0 else first_loss
            if not profiling and diverging(loss, first_loss, len(job["classes"]), model):
                diverged_at = index
                break
        del train_step, forward
        if diverged_at is None or len(diverged) >= retries or should_stop():
            break
        diverged.append({"learning_rate": rate_peak, "diverged_at_step": diverged_at})
        emit("retry", reason="diverged", learning_rate=rate_peak, diverged_at_step=diverged_at,
             next_learning_rate=rate_peak * job["diverged_lr_factor"])
        model.set_weights(start_weights)
        rate_peak *= job["diverged_lr_factor"]
    if diverged_at is not None:
        diverged.append({"learning_rate": rate_peak, "diverged_at_step": diverged_at})
    return Trained(steps, samples, time.monotonic() - started, rate_peak, diverged, diverged_at,
                   pool_first, heap_released)


def reference_held(by_group_before: Optional[Dict[str, float]], origin: Optional[float]
                   ) -> Optional[float]:
    """The reference accuracy a candidate is held to (less the tolerance), or None.

    The before model's, or ``origin`` (the job's ``reference_origin``) where that is higher;
    None without a reference group.
    """
    before = (by_group_before or {}).get(REFERENCE_GROUP)
    if before is None or origin is None:
        return before
    return max(before, origin)


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
