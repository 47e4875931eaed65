"""Training in the worker: batches, the optimizer and its rate, the compiled step, BatchNorm.

``train_and_evaluate`` is one ``train`` or ``profile`` job's work: score the model the candidate
must beat, train, recalibrate BatchNorm, average with the served model, score the candidate.
Every model is called through ``networks.forward``, so built-in and imported models are trained
alike.

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from odtd.trainer import evalcache
from odtd.trainer.averaging import average_with_served
from odtd.trainer.batchnorm import (
    AUTO,
    AUTO_WEIGHT_BEFORE,
    REFERENCE_GROUP,
    adapt_batchnorm,
    batchnorm_layers,
    recalibrate_batchnorm,
)
from odtd.trainer.data import load_groups
from odtd.trainer.distill import teacher_targets
from odtd.trainer.evaluation import (
    evaluate,
    make_eval_step,
    open_eval_cache,
    paired_counts,
    refusal_check,
    score_candidate,
)
from odtd.trainer.fused_batchnorm import fuse, keep_relu_apart
from odtd.trainer.imported import leaf_layers

Emit = Callable[..., None]


def iterate_batches(num_samples: int, batch_size: int, epochs: Optional[int],
                    max_steps: Optional[int], rng: np.random.RandomState
                    ) -> Iterator[Tuple[int, np.ndarray]]:
    """Yield ``(epoch, sample indices)`` per step, reshuffling every epoch.

    With ``epochs`` set, each epoch visits every sample once and its last batch may be short.
    With ``epochs`` None (profile mode), epochs run back to back and every batch is full, even
    when there are fewer samples than ``batch_size``, so a profile measures that batch size.
    ``max_steps`` caps the number of steps either way.
    """
    step = 0
    if epochs is not None:
        for epoch in range(epochs):
            order = rng.permutation(num_samples)
            for begin in range(0, num_samples, batch_size):
                if max_steps is not None and step >= max_steps:
                    return
                yield epoch, order[begin:begin + batch_size]
                step += 1
        return
    stream = np.empty(0, dtype=np.int64)
    consumed = 0
    while max_steps is None or step < max_steps:
        while len(stream) < batch_size:
            stream = np.concatenate([stream, rng.permutation(num_samples)])
        yield consumed // num_samples, stream[:batch_size]
        stream = stream[batch_size:]
        consumed += batch_size
        step += 1


def make_rate(tf: Any, job: Dict[str, Any], total_steps: Optional[int]) -> Any:
    """Return the job's learning rate: a number, or a Keras schedule called with the step.

    With ``lr_schedule`` cosine and ``total_steps`` known, the rate decays from
    ``learning_rate`` to 0 over the job's steps: a session ends annealed, wherever it started.
    """
    if job["lr_schedule"] == "cosine" and total_steps:
        return tf.keras.optimizers.schedules.CosineDecay(job["learning_rate"], total_steps)
    return job["learning_rate"]


def make_optimizer(tf: Any, job: Dict[str, Any], precision: str, rate: Any) -> Any:
    """Build the job's optimizer at ``rate`` (``make_rate``), in a LossScaleOptimizer for float16."""
    if job["optimizer"] == "sgd":
        optimizer = tf.keras.optimizers.SGD(learning_rate=rate, momentum=job["momentum"])
    else:
        optimizer = tf.keras.optimizers.Adam(learning_rate=rate)
    if precision == "mixed_float16":
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    return optimizer


def augment_pad_px(input_shape: List[int]) -> int:
    """The random crop's padding: an eighth of the smaller side (4 pixels at 32x32)."""
    return max(1, int(round(min(input_shape[0], input_shape[1]) / 8.0)))


def augment_batch(tf: Any, images: Any, pad: int) -> Any:
    """Flip each image horizontally at random and crop it from a ``pad``-pixel zero-padded copy.

    Vectorised per batch (one random offset per image), for use inside a ``tf.function``.
    """
    shape = tf.shape(images)
    count, height, width = shape[0], shape[1], shape[2]
    flip = tf.random.uniform([count]) < 0.5
    images = tf.where(flip[:, None, None, None], tf.reverse(images, axis=[2]), images)
    padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
    top = tf.random.uniform([count], 0, 2 * pad + 1, dtype=tf.int32)
    left = tf.random.uniform([count], 0, 2 * pad + 1, dtype=tf.int32)
    rows = top[:, None] + tf.range(height)[None, :]
    cols = left[:, None] + tf.range(width)[None, :]
    padded = tf.gather(padded, rows, axis=1, batch_dims=1)
    return tf.gather(padded, cols, axis=2, batch_dims=1)


def make_train_step(tf: Any, model: Any, optimizer: Any, job: Dict[str, Any]
                    ) -> Callable[[Any, Any, Any, Any], Any]:
    """Return a step ``(uint8 images, int64 labels, teacher, weights) -> mean loss``.

    One step updates the weights once. With the job's ``distill``, ``teacher`` (float32
    logits, one row per image) and ``weights`` (float32, one per image) add each image's
    distillation term (``distill.distillation_loss``); without it they are not used.

    The compiled parts' input signature has a free batch dimension, so a short last batch does
    not retrace. With the job's ``recompute`` the model runs checkpointed
    (``recompute.Checkpointed``). With ``micro_batch_size`` below the batch, the batch runs as
    micro-batches whose gradients are summed before one update: the same step as the whole
    batch at the memory of a micro-batch (a BatchNorm that trains normalises each micro-batch
    by its own statistics).
    """
    from odtd.trainer import networks
    from odtd.trainer.distill import distillation_loss

    variables = model.trainable_variables
    # tf.keras 2 and Keras 3 spell loss scaling differently; Keras 3 unscales in apply_gradients.
    legacy_scaling = hasattr(optimizer, "get_scaled_loss")
    keras3_scaling = not legacy_scaling and hasattr(optimizer, "scale_loss")

    input_shape, input_scale, output = job["input_shape"], job["input_scale"], job["output"]
    pad = augment_pad_px(input_shape)
    checkpointed = None
    if job["recompute"]:
        from odtd.trainer.recompute import Checkpointed

        checkpointed = Checkpointed(tf, model, share=job["recompute"])
    forward_model = checkpointed or model
    signature = [networks.images_spec(job), tf.TensorSpec([None], tf.int64),
                 tf.TensorSpec([None, len(job["classes"])], tf.float32),
                 tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.float32)]

    @networks.compiled(signature)
    def gradients_of(images: Any, labels: Any, teacher: Any, weights: Any, total: Any) -> Any:
        """Gradients of this part's summed loss / ``total`` (the whole batch's size)."""
        if job["augment"]:
            images = augment_batch(tf, images, pad)
        with tf.GradientTape() as tape:
            logits = networks.forward(forward_model, images, input_scale, output, training=True)
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
            if job["distill"]:  # traced only when distilling: the plain step stays as it was
                losses += distillation_loss(tf, logits, teacher, weights)
            loss = tf.reduce_sum(losses) / total
            if legacy_scaling:
                scaled_loss = optimizer.get_scaled_loss(loss)
            elif keras3_scaling:
                scaled_loss = optimizer.scale_loss(loss)
            else:
                scaled_loss = loss
        saved = checkpointed.save_statistics() if checkpointed is not None else None
        gradients = tape.gradient(scaled_loss, variables)
        if saved is not None:
            checkpointed.restore_statistics(saved)
        if legacy_scaling:
            gradients = optimizer.get_unscaled_gradients(gradients)
        return loss, gradients

    @networks.compiled(signature[:4])
    def whole_batch(images: Any, labels: Any, teacher: Any, weights: Any) -> Any:
        loss, gradients = gradients_of(images, labels, teacher, weights,
                                       tf.cast(tf.shape(labels)[0], tf.float32))
        optimizer.apply_gradients(zip(gradients, variables))
        return loss

    micro = job["micro_batch_size"]
    if not micro or micro >= job["batch_size"]:
        return whole_batch

    @networks.compiled()
    def apply(gradients: Any) -> None:
        optimizer.apply_gradients(zip(gradients, variables))

    def micro_batches(images: Any, labels: Any, teacher: Any, weights: Any) -> Any:
        total = tf.constant(float(int(labels.shape[0])))
        loss, summed = 0.0, None
        for begin in range(0, int(labels.shape[0]), micro):
            part = slice(begin, begin + micro)
            part_loss, gradients = gradients_of(images[part], labels[part], teacher[part],
                                                weights[part], total)
            loss += part_loss
            summed = gradients if summed is None else [a + b for a, b in zip(summed, gradients)]
        apply(summed)
        return loss

    return micro_batches


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
        groups = load_groups(job["validation_data"], len(validation[1]))
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
    images, labels = tf.constant(x_train), tf.constant(y_train)
    soft, soft_weights = tf.constant(teacher[0]), tf.constant(teacher[1])
    # Finite either way (profile mode requires max_steps); the count sizes the schedule.
    batches = list(iterate_batches(len(y_train), batch_size, None if profiling else job["epochs"],
                                   job["max_steps"], np.random.RandomState(job["seed"])))
    rate = make_rate(tf, job, None if profiling else len(batches))
    train_step = make_train_step(tf, model, make_optimizer(tf, job, precision, rate), job)
    steps = samples = 0
    train_started = time.monotonic()
    for epoch, indices in batches:
        if should_stop():
            break
        start = time.monotonic()
        batch = tf.constant(indices)
        loss = float(train_step(tf.gather(images, batch), tf.gather(labels, batch),
                                tf.gather(soft, batch), tf.gather(soft_weights, batch)))
        end = time.monotonic()
        emit("step", index=steps, epoch=epoch, batch_size=len(indices), loss=loss,
             lr=float(rate(steps)) if callable(rate) else rate, start=start, end=end)
        steps += 1
        samples += len(indices)
        if not profiling and not np.isfinite(loss) and not all(
                np.isfinite(array).all() for array in model.get_weights()):
            # No candidate, nothing more to score. (A float16 step that overflowed and was
            # skipped by loss scaling leaves the weights finite: training goes on.)
            fields.update(status="diverged", diverged_at_step=steps - 1)
            break
    fields.update(steps=steps, samples=samples, train_seconds=time.monotonic() - train_started)
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
