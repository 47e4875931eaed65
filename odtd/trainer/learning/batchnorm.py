"""BatchNorm's moving statistics in the worker: recalibration and adaptation to the device.

Two ways to set them, both by streaming batches through one compiled forward pass (no gradients
kept, so never more memory than a training step) and assigning once at the end:

- ``recalibrate_batchnorm`` ("precise BN"): after training, every trained BatchNorm layer's
  statistics become the average over the session's training images under the trained weights.
- ``adapt_batchnorm``: every BatchNorm layer's statistics (frozen ones too) become a mixture of
  the device's own images (weight ``w``) and the rehearsed images of the original domain
  (``1 - w``): label-free adaptation to the device's camera (AdaBN, Li et al. 2016, at ``w`` 1)
  that keeps part of the original domain's statistics. A session adapts before training (so
  the steps see the device's statistics) and again after it (under the trained weights).
  ``bn_device_share: auto`` measures both domains once after training and tries each of
  ``AUTO_WEIGHTS`` on the evaluation set; ``choose_weight`` keeps the best on the device's
  validation images of those that do not forget the reference set (the original domain).

TensorFlow is passed in (``tf``), never imported here. Python 3.6-compatible; tf.keras 2 and
Keras 3 alike.
"""

import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from odtd.trainer.learning.evaluation import REFERENCE_GROUP, acceptance_group, score_group, score_rest
from odtd.trainer.models.imported import batchnorm_layers

Moments = List[Tuple[np.ndarray, np.ndarray]]
# The compiled statistics passes of this process, by ``_statistics_key``: a session measures
# batch statistics up to five times (adapting before and after training, each over the device's
# and the rehearsed images, then recalibration), and tracing a large model's forward pass takes
# seconds each time (MobileNetV2 at 64x64: about 5 s on the development CPU).
_COMPILED = {}  # type: Dict[Tuple[Any, ...], Tuple[Any, Callable[[Any], Any]]]


def batch_moments(tf: Any, model: Any, job: Any, layers: List[Any], x: np.ndarray,
                  batch_size: int, should_stop: Callable[[], bool]) -> Optional[Moments]:
    """Each layer's mean and variance over ``x`` (batch statistics weighted by batch size).

    The layers must be trainable (a frozen BatchNormalization normalises by its moving
    statistics even in training mode). Their moving statistics are left as they were.

    Returns:
        One ``(mean, variance)`` pair per layer (float64), or None if a stop was requested.
    """
    kept = [(layer.moving_mean.numpy(), layer.moving_variance.numpy()) for layer in layers]
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.momentum = 0.0  # after a forward pass, the moving statistics are that batch's

    batch_statistics = _statistics_pass(tf, model, job, layers)
    sums = [[np.zeros_like(mean, dtype=np.float64), np.zeros_like(var, dtype=np.float64)]
            for mean, var in kept]
    try:
        for begin in range(0, len(x), batch_size):
            if should_stop():
                return None
            part = x[begin:begin + batch_size]
            for total, (mean, variance) in zip(sums, batch_statistics(tf.constant(part))):
                total[0] += len(part) * mean.numpy()
                total[1] += len(part) * variance.numpy()
    finally:
        for layer, momentum, (mean, variance) in zip(layers, momenta, kept):
            layer.momentum = momentum
            layer.moving_mean.assign(mean)
            layer.moving_variance.assign(variance)
    return [(mean_sum / len(x), variance_sum / len(x)) for mean_sum, variance_sum in sums]


def _statistics_pass(tf: Any, model: Any, job: Any, layers: List[Any]) -> Callable[[Any], Any]:
    """The compiled forward pass that returns ``layers``' moving statistics after it.

    Traced once per model, measured layers and trainable flags of every BatchNorm layer: a traced
    BatchNormalization keeps the training behaviour of the flag it was traced with (a frozen
    one normalises by its moving statistics), and its momentum (``batch_moments`` sets 0 before
    every call).
    """
    from odtd.trainer.models import networks
    from odtd.trainer.plans.pool_first import pooling_first

    key = (id(model), tuple(id(layer) for layer in layers),
           tuple(bool(layer.trainable) for layer in batchnorm_layers(tf, model)),
           tuple(job["input_shape"]), job["input_scale"], job["output"])
    if key in _COMPILED:
        return _COMPILED[key][1]

    forward_model = pooling_first(tf, model)

    @networks.compiled([networks.images_spec(job)])
    def batch_statistics(images: Any) -> Any:
        networks.forward(forward_model, images, job["input_scale"], job["output"], training=True)
        return [(tf.identity(tf.convert_to_tensor(layer.moving_mean)),
                 tf.identity(tf.convert_to_tensor(layer.moving_variance))) for layer in layers]

    _COMPILED[key] = (model, batch_statistics)  # the model held: its id is not reused
    return batch_statistics


def assign_moments(layers: List[Any], moments: Moments) -> None:
    """Set each layer's moving statistics, in the layer's own dtype."""
    for layer, (mean, variance) in zip(layers, moments):
        layer.moving_mean.assign(mean.astype(layer.moving_mean.numpy().dtype))
        layer.moving_variance.assign(variance.astype(layer.moving_variance.numpy().dtype))


def recalibrate_batchnorm(tf: Any, model: Any, job: Any, x: np.ndarray, batch_size: int,
                          should_stop: Callable[[], bool]) -> Optional[float]:
    """Recompute every trained BatchNormalization layer's moving statistics over ``x``.

    A short fine-tuning leaves moving averages that mix the statistics of the weights before and
    during it. Here each layer's moving mean and variance become the average of its batch
    statistics over ``x`` (not augmented; each batch weighted by its size) under the trained
    weights; nothing else changes.

    Returns:
        The seconds it took, or None if a stop was requested meanwhile (statistics unchanged).
    """
    layers = [layer for layer in batchnorm_layers(tf, model) if layer.trainable]
    if not layers:
        return 0.0
    started = time.monotonic()
    moments = batch_moments(tf, model, job, layers, x, batch_size, should_stop)
    if moments is None:
        return None
    assign_moments(layers, moments)
    return time.monotonic() - started


def mix_moments(device: Moments, rehearsal: Optional[Moments], weight: float) -> Moments:
    """The moments of a mixture: ``weight`` of the device's distribution, the rest rehearsal's.

    Mean ``w m_d + (1 - w) m_r``; variance ``w v_d + (1 - w) v_r + w (1 - w) (m_d - m_r)^2``.
    """
    if rehearsal is None or weight >= 1.0:
        return device
    mixed = []
    for (mean_d, var_d), (mean_r, var_r) in zip(device, rehearsal):
        mean = weight * mean_d + (1.0 - weight) * mean_r
        variance = (weight * var_d + (1.0 - weight) * var_r
                    + weight * (1.0 - weight) * np.square(mean_d - mean_r))
        mixed.append((mean, variance))
    return mixed


AUTO = "auto"
AUTO_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)  # the mixtures ``bn_device_share: auto`` tries
AUTO_WEIGHT_BEFORE = 0.5  # ``auto``'s mixture while training, before the choice is made


def class_balanced_moments(tf: Any, model: Any, job: Any, layers: List[Any], x: np.ndarray,
                           labels: np.ndarray, batch_size: int, should_stop: Callable[[], bool]
                           ) -> Optional[Moments]:
    """Each layer's moments over ``x`` with every class present weighing alike.

    Measured class by class (``batch_moments``), then their equal mixture: the mean of the
    classes' means, the mean of their variances plus the spread of their means. A device
    that sees one class for hours (or mostly one class) then does not set the statistics
    every other class is normalised by. None if a stop was requested meanwhile.
    """
    per_class = []
    for label in np.unique(labels):
        moments = batch_moments(tf, model, job, layers, x[labels == label], batch_size, should_stop)
        if moments is None:
            return None
        per_class.append(moments)
    balanced = []
    for layer_moments in zip(*per_class):
        means = np.stack([mean for mean, _ in layer_moments])
        variances = np.stack([variance for _, variance in layer_moments])
        balanced.append((means.mean(axis=0), variances.mean(axis=0) + means.var(axis=0)))
    return balanced


def domain_moments(tf: Any, model: Any, job: Any, device_x: np.ndarray,
                   rehearsal_x: Optional[np.ndarray], batch_size: int,
                   should_stop: Callable[[], bool], weight: Any,
                   device_y: Optional[np.ndarray] = None
                   ) -> Optional[Tuple[List[Any], Moments, Optional[Moments]]]:
    """Every BatchNorm layer's moments over the device's images and over the rehearsed ones.

    Every layer, frozen or not: frozen layers (``freeze_bn``, a ``trainable`` scope) are made
    trainable for the forward passes only, so they measure batch statistics, and then frozen
    again. The rehearsed images are measured only if ``weight`` needs them (below 1, or
    ``auto``). With ``device_y`` (the device's images' labels: ``bn_class_balanced``) the
    device's moments weigh every class alike (``class_balanced_moments``).

    Returns:
        ``(layers, device, rehearsal)``, ``rehearsal`` None without rehearsed images; None if
        a stop was requested meanwhile.
    """
    layers = batchnorm_layers(tf, model)
    frozen = [layer for layer in layers if not layer.trainable]
    for layer in frozen:
        layer.trainable = True
    try:
        device = batch_moments(tf, model, job, layers, device_x, batch_size, should_stop) \
            if device_y is None else \
            class_balanced_moments(tf, model, job, layers, device_x, device_y, batch_size, should_stop)
        rehearsal = None
        if device is not None and rehearsal_x is not None and len(rehearsal_x) \
                and (weight == AUTO or weight < 1.0):
            rehearsal = batch_moments(tf, model, job, layers, rehearsal_x, batch_size, should_stop)
            if rehearsal is None:
                return None
    finally:
        for layer in frozen:
            layer.trainable = False
    return None if device is None else (layers, device, rehearsal)



class Adapted(NamedTuple):
    """What ``adapt_batchnorm`` did."""

    seconds: float
    weight: Optional[float]  # the device's share assigned; None: nothing to adapt
    scores: Optional[Dict[str, Any]]  # the kept weight's evaluation (``AUTO`` only)
    tried: Dict[float, Dict[str, float]]  # {weight: accuracy by group} (``AUTO`` only)


def adapt_batchnorm(tf: Any, model: Any, job: Any, device_x: np.ndarray,
                    rehearsal_x: Optional[np.ndarray], batch_size: int,
                    should_stop: Callable[[], bool], weight: Any,
                    score: Optional[Callable[..., Optional[Dict[str, Any]]]] = None,
                    reference_before: Optional[float] = None,
                    groups: Optional[np.ndarray] = None,
                    refused: Optional[Callable[[Dict[str, Any]], bool]] = None,
                    spared: Optional[Callable[[Dict[str, Any]], bool]] = None,
                    device_y: Optional[np.ndarray] = None) -> Optional[Adapted]:
    """Set every BatchNormalization layer's statistics to the device / rehearsal mixture.

    ``device_y``: the device's images' labels, to weigh its classes alike (``domain_moments``).

    ``weight`` is the device's share; without rehearsal images the device's statistics are used
    alone. Gamma and beta never change here. ``AUTO`` (``bn_device_share: auto`` after
    training) needs ``score``: both domains are measured once, each of ``AUTO_WEIGHTS`` is
    assigned and scored, and ``choose_weight`` keeps one (the job's ``reference_tolerance``;
    ``reference_before`` is the served model's accuracy on the reference group). ``score(cached)``
    is ``evaluate`` over the evaluation set (its ``groups``) with ``cached`` passed on, None on
    a stop.

    When the reference is guarded, the tries are scored lazily with the same outcome: each on
    the acceptance group alone, then in full from the best there down, until one spares the
    reference. The others' reference accuracy is not measured (on 1,000 validation and 2,000
    reference images that saves up to three fifths of the scoring), nor that of a try the
    acceptance test already ``refused`` on the acceptance group (``choose_mixture``; ``spared``
    judges the reference as the session's guard does).

    Returns:
        ``(seconds, weight assigned, its evaluation, {weight: accuracy by group})``, the last two
        only under ``AUTO`` (else None and ``{}``); the weight None when there was nothing to
        adapt (no BatchNorm, no device images). None if a stop was requested meanwhile
        (statistics unchanged).
    """
    if not batchnorm_layers(tf, model) or len(device_x) == 0:
        return Adapted(0.0, None, None, {})
    started = time.monotonic()
    measured = domain_moments(tf, model, job, device_x, rehearsal_x, batch_size, should_stop,
                              weight, device_y)
    if measured is None:
        return None
    layers, device, rehearsal = measured
    kept_evaluation = None  # type: Optional[Dict[str, Any]]
    tried = {}  # type: Dict[float, Dict[str, float]]
    if weight == AUTO:
        def assign(candidate: float) -> None:
            assign_moments(layers, mix_moments(device, rehearsal, candidate))

        chosen = choose_mixture(assign, AUTO_WEIGHTS if rehearsal is not None else (1.0,),
                                score, groups, reference_before, job["reference_tolerance"],
                                refused, spared)
        if chosen is None:
            return None
        weight, kept_evaluation, tried = chosen
    assign_moments(layers, mix_moments(device, rehearsal, weight))
    return Adapted(time.monotonic() - started, weight, kept_evaluation, tried)


class Chosen(NamedTuple):
    """The candidate ``choose_mixture`` kept."""

    value: float  # the weight or share kept
    scores: Dict[str, Any]  # its evaluation
    tried: Dict[float, Dict[str, float]]  # {candidate: accuracy by group}


def choose_mixture(assign: Callable[[float], None], candidates: Sequence[float],
                   score: Callable[..., Optional[Dict[str, Any]]], groups: Optional[np.ndarray],
                   reference_before: Optional[float], reference_tolerance: Optional[float],
                   refused: Optional[Callable[[Dict[str, Any]], bool]] = None,
                   spared: Optional[Callable[[Dict[str, Any]], bool]] = None,
                   refused_at: Optional[Dict[float, Callable[[Dict[str, Any]], bool]]] = None
                   ) -> Optional[Chosen]:
    """``adapt_batchnorm``'s ``AUTO``: (weight kept, its evaluation, accuracies tried).

    ``tried[w]`` is each try's accuracy by group; a try scored on the acceptance group only
    has that group alone. ``refused`` (of a try's ``score_group`` evaluation) tells a try the
    acceptance test already refuses on that group: its reference is not scored; ``refused_at``
    holds the test of particular tries instead (a federated round's start, share 0, judged by
    ``round_confidence_z``). If no try is
    scored in full, the best on the acceptance group is kept with that group's evaluation.
    ``spared`` (of a try's full evaluation) tells a try the reference guard passes, standard
    errors allowed (``evaluation.reference_check``); without it, a try may lose at most
    ``reference_tolerance`` below ``reference_before`` as measured. None on a stop.
    """
    group = acceptance_group(groups)
    tried = {}  # type: Dict[float, Dict[str, float]]
    if groups is None or group is None or REFERENCE_GROUP not in np.unique(groups).astype(str) \
            or reference_before is None or reference_tolerance is None:
        evaluations = {}  # type: Dict[float, Dict[str, Any]]
        for candidate in candidates:  # nothing to spare: score each in full
            assign(candidate)
            evaluation = score(None)
            if evaluation is None:
                return None
            evaluations[candidate] = evaluation
            tried[candidate] = evaluation["by_group"] or {"all": evaluation["accuracy"]}
        kept = choose_weight(tried, reference_before, reference_tolerance, group, REFERENCE_GROUP)
        return Chosen(kept, evaluations[kept], tried)
    first = {}  # type: Dict[float, Dict[str, Any]]
    for candidate in candidates:  # only the acceptance group's images run
        assign(candidate)
        evaluation = score_group(score, groups, group)
        if evaluation is None:
            return None
        first[candidate], tried[candidate] = evaluation, dict(evaluation["by_group"])
    full = {}  # type: Dict[float, Dict[str, Any]]
    for candidate in sorted(candidates, key=lambda w: (-tried[w][group], w)):
        test = (refused_at or {}).get(candidate, refused)
        if test is not None and test(first[candidate]):
            continue
        assign(candidate)
        evaluation = score_rest(score, groups, group, first[candidate])
        if evaluation is None:
            return None
        full[candidate], tried[candidate] = evaluation, evaluation["by_group"]
        if spared(evaluation) if spared is not None else \
                spares_reference(tried[candidate], reference_before, reference_tolerance):
            return Chosen(candidate, evaluation, tried)
    # None spares the reference: of those scored in full, the least loss there.
    scored = {w: tried[w] for w in full} or tried
    kept = choose_weight(scored, reference_before, reference_tolerance, group, REFERENCE_GROUP)
    return Chosen(kept, full.get(kept, first[kept]), tried)


def spares_reference(by_group: Dict[str, float], reference_before: float,
                     reference_tolerance: float, reference_group: str = REFERENCE_GROUP) -> bool:
    """Whether a try loses at most the tolerance on the reference group."""
    return by_group[reference_group] >= reference_before - reference_tolerance - 1e-12


def choose_weight(scores: Dict[float, Dict[str, float]], reference_before: Optional[float],
                  reference_tolerance: Optional[float], acceptance_group: Optional[str],
                  reference_group: str) -> float:
    """The mixture ``auto`` keeps, from each tried weight's accuracy per evaluation group.

    ``scores[w]`` is ``evaluate``'s ``by_group`` (or ``{"all": accuracy}``) with the statistics
    mixed at ``w``. With a reference set (the original domain), a tolerance and the served
    model's accuracy on it: the weights that lose at most the tolerance there are eligible, and
    of those the best on the acceptance group wins (ties: the smaller weight, nearer the
    original domain); if none is eligible, the best on the reference. Otherwise simply the best
    on the acceptance group.
    """
    group = acceptance_group or "all"
    weights = sorted(scores)
    if reference_before is not None and reference_tolerance is not None \
            and all(reference_group in scores[w] for w in weights):
        eligible = [w for w in weights
                    if spares_reference(scores[w], reference_before, reference_tolerance,
                                        reference_group)]
        if not eligible:
            return max(weights, key=lambda w: (scores[w][reference_group], -w))
        weights = eligible
    return max(weights, key=lambda w: (scores[w].get(group, 0.0), -w))
