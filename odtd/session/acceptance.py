"""Whether a candidate may replace the served model: the acceptance test on validation accuracy.

The policy's ``acceptance`` section sets it: a candidate is refused if its validation accuracy
is below the served model's by more than ``tolerance``, or, with ``confidence_z`` > 0, if its
gain is not that many standard errors of the paired difference clear of ``-tolerance`` (strictly:
a candidate right and wrong on the same images as the served model has a gain of 0 and a
standard error of 0, and is not clear of a tolerance of 0).
"""

from __future__ import annotations

from typing import Optional

from odtd.trainer.protocol.paired import (
    acceptance_margin,
    loss_margin,
    margin_standard_error,
    paired_standard_error,
)


def refusal_reason(before: float, after: float, tolerance: float, confidence_z: float,
                   paired: Optional[dict[str, int]]) -> Optional[str]:
    """Why a candidate may not replace the served model, or None if it may.

    The candidate passes if its validation gain, less ``confidence_z`` standard errors of the
    paired difference, is at least ``-tolerance`` (fractions, not points). The standard error
    comes from the images only one of the two models gets right (``paired``: ``gained``,
    ``lost``, ``samples``; McNemar): two models that disagree on few images differ reliably
    by less than two that disagree on many. Tested that way, the margin must be strictly above
    ``-tolerance``: a candidate the served model's equal on every image (gain 0, standard error
    0) is no gain clear of a tolerance of 0, and promoting it would spend a version and reset
    the schedule's backoff on nothing the validation set can tell. Measured as is
    (``confidence_z`` 0, or no paired counts), a gain of exactly ``-tolerance`` passes.
    """
    gain = after - before
    bound = acceptance_margin(gain, paired, confidence_z)
    tested = confidence_z > 0 and bool(paired) and bool(paired.get("samples"))
    if bound > -tolerance or (not tested and bound >= -tolerance):
        return None
    if not tested:
        return f"validation accuracy {after:.2%} < {before:.2%} - {tolerance:.2%} tolerance"
    se = paired_standard_error(paired["gained"], paired["lost"], paired["samples"])
    allowed = 0.0 - 100 * tolerance  # 0.0 - 0.0 is 0.0, never -0.0
    return (f"validation accuracy {after:.2%} vs {before:.2%}: gain {100 * gain:+.2f} - "
            f"{confidence_z:g} x {100 * se:.2f} (standard error) = {100 * bound:+.2f} points, "
            f"not above {allowed:.2f} (tolerance)")


def reference_refusal(before: float, after: float, tolerance: float, confidence_z: float,
                      paired: Optional[dict[str, int]], origin: Optional[float] = None,
                      origin_paired: Optional[dict[str, int]] = None) -> Optional[str]:
    """Why a candidate that passed validation may still not replace the served model, or None.

    The reference set holds images of the original domain (the base model's training images,
    held out of the replay seed). The candidate is refused if it loses more than ``tolerance``
    (a fraction) there against the served model: by the measured difference, or with
    ``confidence_z`` > 0 by more than that many standard errors of the paired difference, so
    that noise alone does not refuse. With ``origin`` (the home's first model's accuracy there,
    ``Store.reference_origin``) it is also refused if it scores more than ``tolerance`` below
    that, the same way (``origin_paired``: the two compared image by image; without it, by the
    measured difference): small losses that each pass against the served model cannot add up
    over promotions beyond what the reference set can tell from noise.
    """
    loss = before - after
    se = margin_standard_error(paired, confidence_z)
    if loss_margin(loss, paired, confidence_z) > tolerance:
        return (f"reference (original domain) accuracy {after:.2%} vs {before:.2%}: lost "
                f"{100 * loss:.2f}{_margin(confidence_z, se)} points > {100 * tolerance:.2f} "
                "(reference_tolerance)")
    if origin is None:
        return None
    below = origin - after
    se = margin_standard_error(origin_paired, confidence_z)
    if loss_margin(below, origin_paired, confidence_z) > tolerance + 1e-12:
        return (f"reference (original domain) accuracy {after:.2%} vs the first model's "
                f"{origin:.2%}: {100 * below:.2f}{_margin(confidence_z, se)} points below it > "
                f"{100 * tolerance:.2f} (reference_tolerance)")
    return None


def _margin(confidence_z: float, se: float) -> str:
    return f" - {confidence_z:g} x {100 * se:.2f} (standard error)" if se else ""
