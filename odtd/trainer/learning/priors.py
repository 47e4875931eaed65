"""The device's class priors, estimated from its images, as an offset added to the model's logits.

A device's camera sees its classes in its own proportions (a doorbell: mostly people and
cars). A model trained on evenly mixed images predicts as if every class were as likely; under
label shift alone the right classifier adds ``log(pi_device / pi_source)`` to its calibrated
logits (Saerens, Latinne and Decaestecker 2002). The device knows the labels of the images it
was given and has many more without labels; ``estimate_priors`` is their EM (Saerens et al.'s),
the labelled images counted by their labels, the others by the model's calibrated posteriors.
Calibration is bias-corrected temperature scaling (Alexandari, Kundaje and Shrikumar, ICML 2020):
a temperature and a bias per class fitted on labelled images of the original domain (the home's
reference set, else the rehearsed replay images), whose class frequencies are ``pi_source``.

The result, ``logit_offset``, is a vector in the model's own logit units (for a softmax model,
its log-probabilities): adding it to the model's output changes which class wins where the
device's mix says so. It is kept with the model version and applied when the device's images
are scored (its acceptance and hold-out groups), never on the reference set, whose images are
evenly mixed by construction: the reference guard still judges the features, not the prior.

Numpy only. Python 3.6-compatible.
"""

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from odtd.trainer.learning.evaluation import (
    REFERENCE_GROUP,
    acceptance_rows,
    offset_rows,
    paired_counts,
    unless_stopped,
)

SMOOTHING = 1.0  # a Dirichlet pseudo-count per class: no class's prior is ever 0
_CALIBRATION_ROUNDS = 10  # turns of temperature, then biases
_BIAS_STEPS = 50
_CALIBRATION_RATE = 0.5
_BIAS_PENALTY = 0.01  # ridge on the bias: a small calibration set cannot fit ten biases freely
EM_STEPS = 200
EM_TOLERANCE = 1e-7
# How far the device's labelled images may disagree with the mix its unlabelled images'
# posteriors give before those posteriors are set aside: a chi-square's upper 0.1% (as a
# standard normal deviate, Wilson and Hilferty's cube root). The labelled images are a sample
# of the device's mix; posteriors that a camera's shift left uncalibrated are not.
DISAGREEMENT_Z = 3.09


class Calibration(NamedTuple):
    """Bias-corrected temperature scaling: ``calibrated = logits / temperature + bias``."""

    temperature: float
    bias: np.ndarray  # one per class


class PriorEstimate(NamedTuple):
    """What ``logit_offset`` found, for the session's record."""

    offset: np.ndarray  # added to the model's logits (its own units)
    device: np.ndarray  # the device's class priors (EM)
    source: np.ndarray  # the calibration set's class frequencies, smoothed
    temperature: float
    labelled: int  # the device's images counted by their labels
    unlabelled: int  # and by the model's posteriors
    em_steps: int
    # How far the labels disagree with the posteriors' mix (``disagreement``); None untested.
    disagreement_z: Optional[float] = None
    set_aside: int = 0  # unlabelled images not counted: their posteriors disagreed


def softmax(logits: np.ndarray) -> np.ndarray:
    """Each row's probabilities (numerically stable)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def _nll(logits: np.ndarray, onehot: np.ndarray, scale: float, bias: np.ndarray) -> float:
    calibrated = scale * logits + bias
    top = calibrated.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(calibrated - top).sum(axis=1)) + top[:, 0]
    return float(np.mean(log_norm - np.sum(onehot * calibrated, axis=1)))


def _best_log_scale(logits: np.ndarray, onehot: np.ndarray, bias: np.ndarray) -> float:
    """The log of the scale that minimises the NLL (convex in the scale): golden-section search."""
    low, high = -6.0, 4.0
    ratio = (np.sqrt(5.0) - 1) / 2
    for _ in range(60):
        left, right = high - ratio * (high - low), low + ratio * (high - low)
        if _nll(logits, onehot, np.exp(left), bias) <= _nll(logits, onehot, np.exp(right), bias):
            high = right
        else:
            low = left
    return (low + high) / 2


def calibrate(logits: np.ndarray, labels: np.ndarray) -> Calibration:
    """Fit a temperature and per-class biases to labelled images, minimising their NLL.

    In turns: the temperature by a line search (the NLL is convex in ``1 / temperature``),
    then the biases by gradient steps (each component of their gradient lies in [-1, 1]).
    The biases carry a small ridge penalty, so a few images per class move them little.
    """
    logits = np.asarray(logits, np.float64)
    classes = logits.shape[1]
    onehot = np.eye(classes)[np.asarray(labels, np.int64)]
    bias = np.zeros(classes)
    log_scale = 0.0
    for _ in range(_CALIBRATION_ROUNDS):
        log_scale = _best_log_scale(logits, onehot, bias)
        scale = np.exp(log_scale)
        for _ in range(_BIAS_STEPS):
            error = softmax(scale * logits + bias) - onehot  # d NLL / d calibrated logits
            bias = bias - _CALIBRATION_RATE * (error.mean(axis=0) + 2 * _BIAS_PENALTY * bias)
    return Calibration(float(np.exp(-log_scale)), bias)


def estimate_priors(posteriors: np.ndarray, labels: np.ndarray, source: np.ndarray
                    ) -> Tuple[np.ndarray, int]:
    """EM for the device's class priors (Saerens et al. 2002), labelled images at their labels.

    Args:
        posteriors: Calibrated posteriors (rows sum to 1) of the device's unlabelled images,
            under the source priors.
        labels: The device's labelled images' classes.
        source: The priors the posteriors hold (the calibration set's).

    Returns:
        ``(priors, steps)``.
    """
    classes = len(source)
    counted = np.bincount(np.asarray(labels, np.int64), minlength=classes).astype(np.float64)
    total = len(labels) + len(posteriors) + SMOOTHING * classes
    priors = np.array(source, np.float64)
    steps = 0
    while steps < EM_STEPS:
        steps += 1
        if len(posteriors):
            weighted = posteriors * (priors / source)
            weighted /= weighted.sum(axis=1, keepdims=True)
            expected = weighted.sum(axis=0)
        else:
            expected = np.zeros(classes)
        updated = (counted + expected + SMOOTHING) / total
        done = float(np.abs(updated - priors).max()) < EM_TOLERANCE
        priors = updated
        if done or not len(posteriors):
            break
    return priors, steps


def disagreement(labels: np.ndarray, mix: np.ndarray) -> float:
    """How far ``labels`` are from a sample of ``mix``: Pearson's chi-square as a z-score.

    Wilson and Hilferty's cube-root transform of the statistic (``classes - 1`` degrees of
    freedom) to a standard normal deviate; above ``DISAGREEMENT_Z`` the labels were not drawn
    from ``mix`` (p < 0.001).
    """
    classes = len(mix)
    counted = np.bincount(np.asarray(labels, np.int64), minlength=classes).astype(np.float64)
    expected = len(labels) * np.asarray(mix, np.float64)
    statistic = float(np.sum((counted - expected) ** 2 / expected))
    freedom = classes - 1.0
    spread = 2.0 / (9.0 * freedom)
    return float(((statistic / freedom) ** (1.0 / 3.0) - (1.0 - spread)) / np.sqrt(spread))


def logit_offset(calibration_logits: Optional[np.ndarray], calibration_labels: Optional[np.ndarray],
                 labelled_labels: np.ndarray, unlabelled_logits: np.ndarray,
                 classes: int) -> Optional[PriorEstimate]:
    """The offset that turns the model's logits into the device's prior-corrected ones.

    ``temperature * (bias + log(pi_device / pi_source))``: the calibrated, corrected logits
    times the temperature, which ranks the classes as they do. Without calibration images
    (``calibration_labels`` None) the model is taken as calibrated on evenly mixed classes.
    None without an image of the device's.
    """
    if len(labelled_labels) + len(unlabelled_logits) == 0:
        return None
    if calibration_labels is None or len(calibration_labels) == 0:
        calibration = Calibration(1.0, np.zeros(classes))
        source = np.full(classes, 1.0 / classes)
    else:
        calibration = calibrate(calibration_logits, calibration_labels)
        source = np.bincount(np.asarray(calibration_labels, np.int64), minlength=classes) + SMOOTHING
        source = source / source.sum()
    posteriors = softmax(np.asarray(unlabelled_logits, np.float64) / calibration.temperature
                          + calibration.bias) if len(unlabelled_logits) else \
        np.zeros((0, classes))
    z, set_aside = None, 0
    if len(labelled_labels) and len(posteriors):  # do the posteriors agree with the labels?
        z = disagreement(labelled_labels, estimate_priors(posteriors, labelled_labels[:0], source)[0])
        if z > DISAGREEMENT_Z:  # no: the labels alone
            set_aside, posteriors = len(posteriors), posteriors[:0]
    device, steps = estimate_priors(posteriors, labelled_labels, source)
    offset = calibration.temperature * (calibration.bias + np.log(device / source))
    return PriorEstimate(offset - offset.mean(), device, source, calibration.temperature,
                         int(len(labelled_labels)), int(len(posteriors)), steps,
                         None if z is None else round(z, 2), set_aside)


def correct_priors(job: Dict[str, Any], data: Dict[str, Any], validation: Any,
                   should_stop: Callable[[], bool], fields: Dict[str, Any]) -> bool:
    """A training job's step: the candidate's logit offset (job key ``prior_correction``).

    Estimated on the trained model (``estimate``), or the served version's offset, or the
    served model's priors estimated anew (``refresh_served``), or the served offset moved to
    today's priors (``carried_offset``), whichever the candidate scores highest with
    (``better_offset``). ``fields`` get ``logit_offset_after`` (None: no offset), its basis
    ``logit_offset_basis_after`` (``offset_basis``) and ``priors`` (what was estimated, or why
    not); ``validation`` (``judging.Validation``) then scores the candidate with it. Without
    ``prior_correction`` the candidate has none.

    Returns:
        Whether the candidate's offset differs from the one its tries were scored with (the
        served model's): a chooser's scores are then stale.
    """
    had = None if validation is None else validation.offset["vector"]
    offset, fields["priors"], basis = None, None, None
    if job["prior_correction"]:
        offset, fields["priors"] = estimate(job, data, validation, should_stop)
        refresh = fields.get("prior_refresh") or {}
        choices = [("candidate", offset, offset_basis(fields["priors"])),
                   ("served", job["logit_offset"], served_basis(job)),
                   ("refresh", refresh.get("logit_offset"), refresh.get("basis")),
                   ("carried",) + carried_offset(job, fields["priors"].get("device"))]
        basis = choices[0][2] if offset is not None else None
        if offset is not None and any(vector is not None for _, vector, _ in choices[1:]):
            offset, basis = better_offset(job, validation, choices, should_stop, fields["priors"])
    fields["logit_offset_after"] = None if offset is None else [round(float(v), 6) for v in offset]
    fields["logit_offset_basis_after"] = basis
    if validation is not None:
        validation.offset["vector"] = offset
    return not _same(had, offset)


def better_offset(job: Dict[str, Any], validation: Any,
                  offsets: List[Tuple[str, Optional[np.ndarray], Optional[Dict[str, Any]]]],
                  should_stop: Callable[[], bool], info: Dict[str, Any]
                  ) -> Tuple[np.ndarray, Optional[Dict[str, Any]]]:
    """The offset of ``offsets`` the candidate scores highest with, and its basis.

    ``offsets``: (name, vector, basis), in order of preference; the basis is what the vector was
    made with (``offset_basis``), for the version's manifest.

    The names: ``candidate`` (its own estimate), ``served`` (the served version's offset),
    ``refresh`` (the served model's priors estimated anew, ``refresh_served``) and ``carried`` (the
    served offset moved to today's priors, ``carried_offset``); in ``refresh_served``, ``anew`` and
    ``carried``. An offset that is None or the same as an earlier one (``_same``) is left out. The
    score, on the group the acceptance test reads. The candidate's own estimate is calibrated on
    the original domain (the reference set), where a session's training on the device's uneven mix
    shows otherwise than through the device's camera: on an imported DenseNet40 behind a dusk
    camera, a day-1 candidate scored 55.8% on validation with its own offset and 72.7% with the
    base model's priors. A later estimate on a trained model is calibrated so too: the version
    served from that day-1 candidate scored 72.5% with the base model's offset and 64.7% with its
    own priors estimated anew, so the served version's offset is a choice of its own. One pass of
    the candidate over that group's images; the offsets are compared on its logits. ``info`` (the
    record's ``priors``) gets ``offset`` (the name kept) and each one's accuracy; a tie keeps the
    earlier.
    """
    rows = acceptance_rows(validation.groups, len(validation.y))
    logits = unless_stopped(logits_function(job, validation.eval_step, should_stop)(
        validation.x[rows]))
    labels = validation.y[rows]
    kept, scores = [], {}  # type: List[Tuple[str, np.ndarray, Optional[Dict[str, Any]]]], Dict[str, float]
    for name, vector, basis in offsets:
        if vector is not None and not any(_same(vector, seen) for _, seen, _ in kept):
            kept.append((name, np.asarray(vector, np.float32), basis))
            scores[name] = float(np.mean(np.argmax(logits + kept[-1][1], axis=1) == labels)) \
                if len(labels) else 0.0
    best = kept[0]
    for choice in kept[1:]:  # strictly higher: a tie keeps the earlier
        if scores[choice[0]] > scores[best[0]]:
            best = choice
    info.update(offset=best[0], offset_accuracy={k: round(v, 5) for k, v in scores.items()})
    return best[1], best[2]


def refresh_served(job: Dict[str, Any], data: Dict[str, Any], validation: Any,
                   before: Tuple[np.ndarray, np.ndarray], should_stop: Callable[[], bool],
                   fields: Dict[str, Any]) -> Optional[np.ndarray]:
    """The served model with its priors estimated anew.

    Run while the model holds the served weights (``training.refresh_priors``). A promoted
    version keeps the offset it was scored with; the device's mix moves on, and a refused
    candidate would leave the served model's offset behind. This estimates the offset on the
    served model (``estimate``), or, where the served model scores higher with it, moves the
    served offset to the priors of that estimate (``carried_offset``), and scores the served
    model with it; ``fields["prior_refresh"]`` gets the offset, the estimate, its basis
    (``offset_basis``), the scores by group and per class and the paired counts against the
    served model as it is (``before``: its correctness and loss on each validation image; the
    images no offset applies to, the reference set, keep them unscored). The session
    serves it where it scores above the served model and the trained candidate
    (``session.promotion``).

    Returns:
        The new offset; None where none was estimated or it is the one served (the job's
        ``logit_offset``): then nothing goes to ``fields``. ``acceptance`` in the record holds
        the served model's accuracy on the acceptance group with its own offset and with this.
    """
    offset, info = estimate(job, data, validation, should_stop)
    basis = offset_basis(info)
    carried = carried_offset(job, info.get("device"))
    if offset is not None and carried[0] is not None and not _same(offset, carried[0]):
        offset, basis = better_offset(job, validation, [("anew", offset, basis), ("carried",) + carried],
                                      should_stop, info)
    served = None if job["logit_offset"] is None else np.asarray(job["logit_offset"], np.float32)
    if offset is None or _same(served, offset):
        return None
    unchanged = ~offset_rows(validation.groups, data.get("validation_offset_rows"),
                             len(validation.y))
    scored_with = validation.offset["vector"]  # the served model's: restored after
    validation.offset["vector"] = offset
    try:
        scores = unless_stopped(validation.score((unchanged,) + tuple(before)))
    finally:
        validation.offset["vector"] = scored_with
    correct = scores.pop("correct")
    scores.pop("losses")
    rows = acceptance_rows(validation.groups, len(validation.y))
    fields["prior_refresh"] = {
        "logit_offset": [round(float(v), 6) for v in offset], "priors": info, "basis": basis,
        "by_group": scores["by_group"], "per_class": scores["per_class"],
        "paired_by_group": paired_counts(before[0], correct, validation.groups),
        "acceptance": {"served": round(float(np.mean(before[0][rows])), 5),
                       "refresh": round(float(np.mean(correct[rows])), 5)}}
    return offset


def carried_offset(job: Dict[str, Any], device: Optional[List[float]]
                   ) -> Tuple[Optional[np.ndarray], Optional[Dict[str, Any]]]:
    """The served version's offset moved to the device's priors ``device``, and its basis.

    ``temperature * (bias + log(pi_device / pi_source))`` with the temperature and biases the
    served offset was estimated with (on the model it was estimated on, the base model before
    the first training, say) and today's estimate of the device's priors: the served offset
    plus ``temperature * (log device - log priors then)`` (job keys ``logit_offset_priors``
    and ``logit_offset_temperature``), centred. A later estimate on trained weights is
    calibrated on their reference images, where training on the device's mix shows otherwise
    than through its camera; this keeps the calibration and moves only the priors, as the
    device's labels add up. The basis (``offset_basis``): ``device`` and the served offset's
    temperature. (None, None) without a served offset and what it was estimated with.
    """
    basis = None if job["logit_offset"] is None else served_basis(job)
    if basis is None or device is None:
        return None, None
    moved = np.asarray(job["logit_offset"], np.float64) + basis["temperature"] * (
        np.log(np.asarray(device, np.float64)) - np.log(np.asarray(basis["priors"], np.float64)))
    return (moved - moved.mean()).astype(np.float32), dict(basis, priors=list(device))


def offset_basis(info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """What an estimate's offset was made with (``carried_offset``'s basis), or None.

    From ``estimate``'s record: the device's priors and the calibration's temperature.
    """
    if info.get("device") is None:
        return None
    return {"priors": info["device"], "temperature": info["temperature"]}


def served_basis(job: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The served offset's basis, as the job gives it; None where it does not."""
    if job["logit_offset_priors"] is None:
        return None
    return {"priors": job["logit_offset_priors"], "temperature": job["logit_offset_temperature"]}


SAME_OFFSET_ATOL = 1e-5
"""Offsets this close are one: a version's offset travels rounded to 6 decimals (the result
event, the manifest, the job), so the served or refreshed one read back is not bit-equal to
the float32 vector it was computed as."""


def _same(had: Optional[np.ndarray], offset: Optional[np.ndarray]) -> bool:
    if had is None or offset is None:
        return had is offset
    had, offset = np.asarray(had, np.float64), np.asarray(offset, np.float64)
    return had.shape == offset.shape and bool(np.allclose(had, offset, rtol=0.0, atol=SAME_OFFSET_ATOL))


def estimate(job: Dict[str, Any], data: Dict[str, Any], validation: Any,
             should_stop: Callable[[], bool]) -> Tuple[Optional[np.ndarray], Dict[str, Any]]:
    """The model's offset for the device's priors as it now holds weights, and what was estimated.

    Calibrated on the validation set's reference group where it holds an image per class, else
    on the rehearsed images of the original domain (``data["priors"]``,
    ``worker.data.load_prior_data``), else not (a home with neither: the model taken as
    calibrated on even classes); the device's labelled images (the session's, earlier days')
    counted by their labels, its images without a label by the model's posteriors.

    Returns:
        ``(offset, priors)``: the offset (None where none was estimated) and the record's
        ``priors`` (``status`` ``estimated`` with the estimate, or ``skipped`` and why).
    """
    sets = data.get("priors")
    if sets is None or validation is None:
        return None, {"status": "skipped", "reason": "no device images or no validation set"}
    logits_of = logits_function(job, validation.eval_step, should_stop)
    groups = validation.groups
    reference = np.zeros(len(validation.y), dtype=bool) if groups is None else \
        groups.astype(str) == REFERENCE_GROUP
    classes = len(job["classes"])
    if int(np.sum(reference)) >= classes:
        calibration, calibrated_on = (validation.x[reference], validation.y[reference]), "reference"
    elif len(sets["calibration"][1]) >= classes:
        calibration, calibrated_on = sets["calibration"], "rehearsed"
    else:  # no image of the original domain: the model taken as calibrated, classes as even
        calibration, calibrated_on = None, "none"
    found = logit_offset(
        None if calibration is None else unless_stopped(logits_of(calibration[0])),
        None if calibration is None else calibration[1], sets["labels"],
        unless_stopped(logits_of(sets["unlabelled"])), classes)
    if found is None:
        return None, {"status": "skipped", "reason": "no image of the device's"}
    return found.offset.astype(np.float32), {
        "status": "estimated", "calibrated_on": calibrated_on,
        "calibration_images": 0 if calibration is None else int(len(calibration[1])),
        "device": [round(float(p), 5) for p in found.device],
        "source": [round(float(p), 5) for p in found.source],
        "temperature": round(found.temperature, 4), "labelled": found.labelled,
        "unlabelled": found.unlabelled, "em_steps": found.em_steps,
        "disagreement_z": found.disagreement_z, "set_aside": found.set_aside}


def logits_function(job: Dict[str, Any], eval_step: Callable[[Any, Any], Any],
            should_stop: Callable[[], bool]) -> Callable[[np.ndarray], Optional[np.ndarray]]:
    """The model's logits on images, in batches of the evaluation batch (None on a stop)."""
    batch_size = job["eval_batch_size"] or job["batch_size"]

    def logits_of(x: np.ndarray) -> Optional[np.ndarray]:
        out = [np.zeros((0, len(job["classes"])), np.float32)]
        for begin in range(0, len(x), batch_size):
            if should_stop():
                return None
            images = x[begin:begin + batch_size]
            out.append(eval_step(images, np.zeros(len(images), np.int64))[1].numpy())
        return np.concatenate(out)

    return logits_of
