"""What a trainer worker's result event says, read onto the session's record.

The worker scores the served model and the candidate on the evaluation set, in groups
(docs/worker-protocol.md, ``validation_data``): the validation set, the device's held-out
images and the reference set. The record's ``accuracy_before``/``_after`` are the first group
the set has; the others, the paired counts and what the worker chose go to its details.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from odtd.store.records import SessionRecord
from odtd.trainer.protocol.launch import WARMUP_STEPS

GROUP_VALIDATION, GROUP_HOLDOUT, GROUP_REFERENCE = 0, 1, 2  # docs/worker-protocol.md


class PriorRefresh(NamedTuple):
    """The served model with the device's priors estimated anew (the worker's ``prior_refresh``)."""

    logit_offset: list[float]
    accuracy: Optional[float]  # on the group the acceptance test reads, as ``accuracy_after``
    holdout_accuracy: Optional[float]
    paired: Optional[dict[str, int]]  # against the served model as it is, on that group
    per_class: Optional[dict[str, Any]]
    priors: dict[str, Any]  # the estimate (``details.priors``'s keys)
    basis: Optional[dict[str, Any]] = None  # what the offset was made with (manifest's)


def read_result(record: SessionRecord, result: dict[str, Any], classes: list[str]) -> None:
    """Fill the record's accuracy fields and details from the worker's result event."""
    before = result.get("by_group_before") or {}
    after = result.get("by_group_after") or {}
    primary = _primary(before)
    record.accuracy_before = before.get(primary, result.get("accuracy_before"))
    record.accuracy_after = after.get(primary, result.get("accuracy_after"))
    details = record.details
    details.holdout_accuracy_before = before.get(str(GROUP_HOLDOUT))
    details.holdout_accuracy_after = after.get(str(GROUP_HOLDOUT))
    details.reference_accuracy_before = before.get(str(GROUP_REFERENCE))
    details.reference_accuracy_after = after.get(str(GROUP_REFERENCE))
    details.reference_paired = (result.get("paired_by_group") or {}).get(str(GROUP_REFERENCE))
    details.reference_paired_origin = result.get("reference_paired_origin")
    details.bn_device_weight = result.get("bn_device_share")
    details.bn_weights_tried = result.get("bn_shares_tried") or None
    details.trained_share = result.get("trained_share")
    details.trained_shares_tried = result.get("trained_shares_tried") or None
    details.served_share = result.get("served_share")
    details.served_shares_tried = result.get("served_shares_tried") or None
    details.paired = (result.get("paired_by_group") or {}).get(primary)
    details.per_class_before = _by_class(classes, result.get("per_class_before"))
    details.per_class_after = _by_class(classes, result.get("per_class_after"))
    details.precision = result.get("precision")
    details.precision_reason = result.get("precision_reason")
    details.tf_peak_memory_mb = result.get("tf_peak_memory_mb")
    details.learning_rate = result.get("learning_rate", details.learning_rate)
    details.lr_attempts = result.get("lr_attempts") or None
    details.priors = result.get("priors")
    details.pseudo_labels = result.get("pseudo_labels")


def read_prior_refresh(result: dict[str, Any], classes: list[str]) -> Optional[PriorRefresh]:
    """The worker's ``prior_refresh`` (``training.prior_correction``), None where it has none."""
    refresh = result.get("prior_refresh")
    if not refresh:
        return None
    by_group = refresh.get("by_group") or {}
    primary = _primary(result.get("by_group_before") or {})
    return PriorRefresh(refresh["logit_offset"], by_group.get(primary),
                        by_group.get(str(GROUP_HOLDOUT)),
                        (refresh.get("paired_by_group") or {}).get(primary),
                        _by_class(classes, refresh.get("per_class")), refresh.get("priors") or {},
                        refresh.get("basis"))


def _primary(by_group_before: dict[str, Any]) -> str:
    # The group the acceptance test reads: the validation set's, else the held-out images'.
    return str(GROUP_VALIDATION) if str(GROUP_VALIDATION) in by_group_before else str(GROUP_HOLDOUT)


def throughput_sps(steps: list[dict[str, Any]]) -> Optional[float]:
    """Samples per second over the steps after the warm-up (all steps if there are few)."""
    measured = steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else steps
    seconds = sum(s["end"] - s["start"] for s in measured)
    samples = sum(s["batch_size"] for s in measured)
    return round(samples / seconds, 3) if seconds > 0 else None


def _by_class(classes: list[str], values: Optional[list[Optional[float]]]) -> Optional[dict[str, Any]]:
    return dict(zip(classes, values)) if values is not None else None
