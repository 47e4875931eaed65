"""Averaging the trained weights with the served model's (``training.trained_share``).

After a session trains, the candidate becomes ``a * trained + (1 - a) * served`` for every
floating-point weight, BatchNorm's moving statistics included: weight-space ensembling of the
fine-tuned model with the one it started from (WiSE-FT, Wortsman et al. 2022), which keeps
part of what fine-tuning gained on the new data and more of what the start model knew. Day
after day a promoted average is the next session's served model, so the served model is an
exponential moving average of the days' candidates, which damps their day-to-day swings.

``mixes_served``: whether a federated round's candidate is averaged with the served model too.

``auto`` scores each of ``AUTO_SHARES`` (a federated round's: ``ROUND_SHARES``) on the
evaluation set and keeps one by the rule
``bn_device_share: auto`` keeps a mixture by (``batchnorm.choose_mixture``): the best on the
device's validation images among the shares that lose at most the reference tolerance on the
reference set (the original domain); ties go to the smaller share, nearer the served model.

TensorFlow is not used here: the model's ``get_weights`` / ``set_weights``. Python
3.6-compatible; tf.keras 2 and Keras 3 alike.
"""

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from odtd.trainer.learning.batchnorm import AUTO, choose_mixture

AUTO_SHARES = (0.25, 0.5, 0.75, 1.0)  # what ``trained_share: auto`` tries
# A federated round tries its start too, the round's global model as it came (share 0): the
# fleet's model under the device's priors, where the device's own update from it scores lower.
ROUND_SHARES = (0.0,) + AUTO_SHARES
UNSCORED_SHARE = 0.5  # ``auto`` without an evaluation set: nothing to choose by

class Averaged(NamedTuple):
    """What ``average_with_served`` did."""

    share: float  # the trained weights' share kept
    scores: Optional[Dict[str, Any]]  # its evaluation (``AUTO`` with a score only)
    tried: Dict[float, Dict[str, float]]  # {share: accuracy by group} (``AUTO`` only)


def averaged(trained: List[np.ndarray], served: List[np.ndarray], share: float
             ) -> List[np.ndarray]:
    """``share * trained + (1 - share) * served`` per floating-point array, in its dtype.

    Computed in the arrays' own dtype: no float64 copies of the weights, whose memory the
    session's budget did not count. Integer arrays (counters, seeds) are the trained model's.
    """
    return [new if not np.issubdtype(new.dtype, np.floating)
            else (new * new.dtype.type(share) + old * new.dtype.type(1.0 - share))
            for new, old in zip(trained, served)]


def average_with_served(model: Any, served: List[np.ndarray], share: Any,
                        score: Optional[Callable[..., Optional[Dict[str, Any]]]] = None,
                        groups: Optional[np.ndarray] = None,
                        reference_before: Optional[float] = None,
                        reference_tolerance: Optional[float] = None,
                        refused: Optional[Callable[[Dict[str, Any]], bool]] = None,
                        spared: Optional[Callable[[Dict[str, Any]], bool]] = None,
                        shares: Sequence[float] = AUTO_SHARES,
                        refused_at: Optional[Dict[float, Callable[[Dict[str, Any]], bool]]] = None
                        ) -> Optional[Averaged]:
    """Set the model's weights to the average of its trained ones and ``served``.

    ``share`` is the trained weights' share, or ``AUTO`` with ``score`` (``evaluate`` over the
    evaluation set, ``groups`` its groups, as ``batchnorm.adapt_batchnorm`` takes them), which
    tries ``shares``; ``refused_at`` is ``choose_mixture``'s (a share's own acceptance test).

    Returns:
        ``(share kept, its evaluation, {share: accuracy by group})``, the last two only under
        ``AUTO`` with ``score`` (else None and ``{}``). None if a stop was requested meanwhile
        (the trained weights are then left as they were).
    """
    trained = model.get_weights()
    if share == AUTO and score is None:
        share = UNSCORED_SHARE
    if share != AUTO:
        if share < 1.0:
            model.set_weights(averaged(trained, served, share))
        return Averaged(share, None, {})

    def assign(candidate: float) -> None:
        model.set_weights(trained if candidate >= 1.0 else averaged(trained, served, candidate))

    chosen = choose_mixture(assign, shares, score, groups, reference_before,
                            reference_tolerance, refused, spared, refused_at)
    if chosen is None:
        model.set_weights(trained)
        return None
    assign(chosen.value)
    return Averaged(*chosen)


def mixes_served(job: Dict[str, Any], served_weights: Optional[List[np.ndarray]],
                 validation: Any) -> bool:
    """Whether a federated round's candidate is averaged with the device's served model too.

    The round's model plus the device's update (averaged with the round's start) is then
    averaged with the model the device serves, at the share that scores best on the device's
    validation images (``auto``'s rule; 1: the candidate as it was): the global and the
    personal model mixed in weight space, as APFL does (Deng et al., 2020). Only where the
    job asks (``average_with: start+served``, ``training.federated_mix``) under
    ``trained_share: auto``, with the served weights and a validation set to choose by.
    """
    return job["average_with"] == "start+served" and job["trained_share"] == AUTO \
        and served_weights is not None and validation is not None
