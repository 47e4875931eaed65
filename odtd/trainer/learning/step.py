"""One training step in the worker: batches, the optimizer and its rate, augmentation, the step.

``make_train_step`` compiles what one step does: augment, forward (``make_forward``:
checkpointed with the job's ``recompute``, else pooling first where the model allows), loss
(with distillation's term when the job distils), gradients (summed over micro-batches with
``micro_batch_size``, their global norm clipped to ``clip_norm``), one update.
``train_steps`` runs the steps ``iterate_batches`` gives it, and again at a lower rate after a
divergence (``diverging``); ``release_free_heap`` gives malloc's free heap back after the first.

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import ctypes
import math
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import numpy as np

Emit = Callable[..., None]  # prints one worker event (``worker.process.emit``)


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


def make_rate(tf: Any, job: Dict[str, Any], total_steps: Optional[int], peak: float) -> Any:
    """Return the learning rate at ``peak``: a number, or a Keras schedule called with the step.

    With the job's ``lr_schedule`` cosine and ``total_steps`` known, the rate decays from
    ``peak`` to 0 over the job's steps: a session ends annealed, wherever it started.
    """
    if job["lr_schedule"] == "cosine" and total_steps:
        return tf.keras.optimizers.schedules.CosineDecay(peak, total_steps)
    return peak


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


def make_forward(tf: Any, model: Any, job: Dict[str, Any]) -> Any:
    """What the train step calls for the model's output.

    With the job's ``recompute``, the model checkpointed (``recompute.Checkpointed``); else the
    model pooling first where it can (``pool_first.pooling_first``: a transition's 1x1
    convolution on a quarter of the pixels, the same step), which is the model itself where
    nothing swaps.
    """
    if job["recompute"]:
        from odtd.trainer.plans.recompute import Checkpointed

        return Checkpointed(tf, model, share=job["recompute"])
    from odtd.trainer.plans.pool_first import pooling_first

    return pooling_first(tf, model)


def make_train_step(tf: Any, model: Any, forward_model: Any, optimizer: Any,
                    job: Dict[str, Any], adjustment: Optional[np.ndarray] = None
                    ) -> Callable[[Any, Any, Any, Any], Any]:
    """Return a step ``(uint8 images, int64 labels, teacher, weights) -> mean loss``.

    One step updates the weights once, ``forward_model`` (``make_forward``) giving the model's
    output. With the job's ``distill``, ``teacher`` (float32 logits, one row per image) and
    ``weights`` (float32, one per image) add each image's distillation term
    (``distill.distillation_loss``); without it they are not used.

    The compiled parts' input signature has a free batch dimension, so a short last batch does
    not retrace. With ``micro_batch_size`` below the batch, the batch runs as micro-batches
    whose gradients are summed before one update: the same step as the whole batch at the
    memory of a micro-batch (a BatchNorm that trains normalises each micro-batch by its own
    statistics).

    ``adjustment`` (one float per class), if given, is added to the logits the labels'
    cross-entropy reads (``balanced_adjustment``), not to those distillation reads.
    """
    from odtd.trainer.learning.distill import distillation_loss
    from odtd.trainer.models import networks

    variables = model.trainable_variables
    # tf.keras 2 and Keras 3 spell loss scaling differently; Keras 3 unscales in apply_gradients.
    legacy_scaling = hasattr(optimizer, "get_scaled_loss")
    keras3_scaling = not legacy_scaling and hasattr(optimizer, "scale_loss")

    input_shape, input_scale, output = job["input_shape"], job["input_scale"], job["output"]
    pad = augment_pad_px(input_shape)
    # A recomputation updates BatchNorm's moving statistics a second time: put them back.
    checkpointed = forward_model if hasattr(forward_model, "restore_statistics") else None
    shift = None if adjustment is None else tf.constant(adjustment, tf.float32)
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
            if job["objective"] == "entropy":  # the predictions' own entropy: no label is read
                losses = -tf.reduce_sum(tf.nn.softmax(logits) * tf.nn.log_softmax(logits), axis=-1)
            else:
                losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=labels, logits=logits if shift is None else logits + tf.cast(
                        shift, logits.dtype))
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

    clip_norm, mu = job["clip_norm"], job["proximal_mu"]
    # FedProx's proximal term (mu / 2) * ||w - w_start||^2: its gradient mu * (w - w_start) is
    # added to each step's. The start: the weights as the steps begin (a round's global model).
    anchors = [tf.convert_to_tensor(np.array(v.numpy())) for v in variables] if mu else None

    def clipped(gradients: Any) -> Any:
        """The step's gradients, the proximal term's added, their norm clipped to ``clip_norm``."""
        scale = getattr(optimizer, "dynamic_scale", None) if keras3_scaling else None
        # Keras 3's float16: scaled gradients, unscaled in apply_gradients.
        scale = None if scale is None else tf.cast(scale, tf.float32)
        if anchors is not None:
            gradients = [g if g is None else g + mu * (v - a) * (1.0 if scale is None else scale)
                         for g, v, a in zip(gradients, variables, anchors)]
        if not clip_norm:
            return gradients
        norm = tf.constant(clip_norm, tf.float32)
        if scale is not None:
            norm = norm * scale
        return tf.clip_by_global_norm(gradients, norm)[0]

    @networks.compiled(signature[:4])
    def whole_batch(images: Any, labels: Any, teacher: Any, weights: Any) -> Any:
        loss, gradients = gradients_of(images, labels, teacher, weights,
                                       tf.cast(tf.shape(labels)[0], tf.float32))
        optimizer.apply_gradients(zip(clipped(gradients), variables))
        return loss

    micro = job["micro_batch_size"]
    if not micro or micro >= job["batch_size"]:
        return whole_batch

    @networks.compiled()
    def apply(gradients: Any) -> None:
        optimizer.apply_gradients(zip(clipped(gradients), variables))

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


def balanced_adjustment(labels: np.ndarray, classes: int) -> np.ndarray:
    """The logit adjustment that trains as if ``labels`` were evenly mixed (``balanced_loss``).

    ``log`` of each class's frequency among the training images (one pseudo-count each),
    centred on 0: added to the logits in the cross-entropy, the class mix is in the loss and
    the weights need not learn it (logit adjustment, Menon et al., ICLR 2021). The model then
    predicts as if every class were as likely, as it was trained on the server, and
    ``prior_correction``'s offset adds the device's mix once.
    """
    counts = np.bincount(np.asarray(labels, np.int64), minlength=classes).astype(np.float64) + 1.0
    adjustment = np.log(counts / counts.sum())
    return (adjustment - adjustment.mean()).astype(np.float32)


def train_steps(tf: Any, job: Dict[str, Any], model: Any, precision: str, inputs: Tuple[Any, ...],
                batches: List[Tuple[int, np.ndarray]], should_stop: Callable[[], bool],
                emit: Emit, adjustment: Optional[np.ndarray] = None) -> Trained:
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
        adjustment: added to the logits in the labels' loss (``balanced_adjustment``), if given.
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
                                     job, adjustment)
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
