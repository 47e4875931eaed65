"""Pseudo-labels: the device's images without a label, labelled by the served model where it is sure.

A training job's step before the steps (job key ``pseudo_labels``, a confidence threshold):
the model the candidate must beat scores each image of ``unlabelled_x`` and its mirror image,
its logit offset (``priors``) applied; an image is kept where both views give the same class
and their mean probability of it reaches the threshold, the surest first, at most as many as
the session's labelled images of the device (the labels stay the majority). Kept images join
the training data with that class as their label. Confirmation bias is what such labels risk;
the candidate still passes the acceptance and reference guards like any other, so a long
stream of wrong labels cannot reach the served model.

Numpy only (the model runs through the validation set's ``eval_step``). Python 3.6-compatible.
"""

from typing import Any, Callable, Dict, Optional

import numpy as np

from odtd.trainer.learning.evaluation import unless_stopped
from odtd.trainer.learning.priors import logits_function, softmax


def pseudo_label(job: Dict[str, Any], data: Dict[str, Any], eval_step: Optional[Callable[[Any, Any], Any]],
                 should_stop: Callable[[], bool], fields: Dict[str, Any]) -> None:
    """Add the sure ones of the device's unlabelled images to ``data["train_data"]``.

    ``eval_step`` scores the model as loaded; call it under the served weights where they
    differ. ``fields["pseudo_labels"]``: ``offered``, ``kept``, ``threshold``, ``by_class``
    (kept per class), or ``status: skipped`` and why.
    """
    threshold = job["pseudo_labels"]
    unlabelled = (data.get("priors") or {}).get("unlabelled_x")
    if unlabelled is None or eval_step is None or not len(unlabelled):
        fields["pseudo_labels"] = {"status": "skipped", "reason": "no image without a label"
                                   if eval_step is not None else "no validation set"}
        return
    x, y = data["train_data"]
    room = data["priors"]["session_labelled"]  # the session's labelled images of the device
    offset = 0.0 if job["logit_offset"] is None else np.asarray(job["logit_offset"], np.float32)
    logits_of = logits_function(job, eval_step, should_stop)
    views = [softmax(unless_stopped(logits_of(np.ascontiguousarray(images))) + offset)
             for images in (unlabelled, unlabelled[:, :, ::-1])]
    agree = views[0].argmax(axis=1) == views[1].argmax(axis=1)
    mean = (views[0] + views[1]) / 2
    confidence, label = mean.max(axis=1), mean.argmax(axis=1)
    sure = np.flatnonzero(agree & (confidence >= threshold))
    kept = sure[np.argsort(-confidence[sure], kind="stable")][:room]
    data["train_data"] = (np.concatenate([x, unlabelled[kept]]),
                          np.concatenate([y, label[kept].astype(y.dtype)]))
    if data.get("rehearsed") is not None:  # distillation's mask: these are the device's images
        data["rehearsed"] = np.concatenate([data["rehearsed"], np.zeros(len(kept), dtype=bool)])
    fields["pseudo_labels"] = {
        "status": "labelled", "offered": int(len(unlabelled)), "kept": int(len(kept)),
        "threshold": threshold,
        "by_class": [int(n) for n in np.bincount(label[kept], minlength=len(job["classes"]))]}
