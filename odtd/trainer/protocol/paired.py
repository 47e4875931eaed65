"""The paired statistics of two models scored on the same samples, which both sides use.

The worker's refusal check (``learning.evaluation``) and the session's acceptance test
(``session.acceptance``) judge a candidate by the same margin: its gain less ``confidence_z``
standard errors of the paired difference. On the reference set the rule is the mirror image,
a loss less that many standard errors (``loss_margin``): the worker's choosers (``auto``) and
the session's guard hold a candidate to it alike. A federated round's model as the fleet sent
it is judged by its own margin (``round_confidence_z``) on both sides too:
``round_model_as_sent`` tells that candidate. Standard library only; Python 3.6-compatible.
"""

from typing import Dict, Optional


def round_model_as_sent(trained_share: Optional[float], served_share: Optional[float]) -> bool:
    """Whether a federated round's candidate, by its shares, is the round's model as it came.

    ``trained_share`` 0 of the device's update (averaged with the round's start), not averaged
    with the served model after (``served_share`` 1 or none).
    """
    return trained_share == 0.0 and served_share in (None, 1.0)


def paired_standard_error(gained: int, lost: int, samples: int) -> float:
    """Standard error of the accuracy difference of two models scored on the same samples."""
    mean = (gained - lost) / samples
    variance = ((gained + lost) / samples - mean * mean) / samples
    return max(variance, 0.0) ** 0.5


def margin_standard_error(paired: Optional[Dict[str, int]], confidence_z: float) -> float:
    """The standard error a margin allows: 0 with ``confidence_z`` <= 0 or no paired counts."""
    if confidence_z <= 0 or not paired or not paired.get("samples"):
        return 0.0
    return paired_standard_error(paired["gained"], paired["lost"], paired["samples"])


def acceptance_margin(gain: float, paired: Optional[Dict[str, int]], confidence_z: float) -> float:
    """A candidate's validation gain less ``confidence_z`` standard errors of the difference.

    Fractions; the acceptance test refuses a candidate below ``-tolerance``. The gain alone with
    ``confidence_z`` <= 0 or no paired counts (``paired_counts``' entry of the group).
    """
    return gain - confidence_z * margin_standard_error(paired, confidence_z)


def loss_margin(loss: float, paired: Optional[Dict[str, int]], confidence_z: float) -> float:
    """A candidate's loss on the reference set less ``confidence_z`` standard errors.

    Fractions; the guard refuses a candidate whose margin is above ``reference_tolerance``.
    The loss alone with ``confidence_z`` <= 0 or no paired counts (compared as measured).
    """
    return loss - confidence_z * margin_standard_error(paired, confidence_z)
