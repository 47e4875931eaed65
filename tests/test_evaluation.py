"""Scoring a candidate in the worker, the acceptance group first (no TensorFlow)."""

import numpy as np
import pytest

from odtd.session.acceptance import refusal_reason
from odtd.trainer.learning.evaluation import (
    acceptance_group,
    evaluate,
    paired_counts,
    refusal_check,
    score_candidate,
)


def _score(x, y, groups, predictions, ran):
    """``evaluate`` of a model that predicts ``predictions``; counts the images run in ``ran``."""
    def eval_step(images, labels):
        ran.append(len(labels))
        index = images[:, 0].astype(np.int64)

        class Tensor:  # what eval_step returns (losses, logits): tensors with .numpy()
            def __init__(self, value):
                self.value = value

            def numpy(self):
                return self.value
        # logits whose largest is the prediction
        return Tensor(np.zeros(len(labels))), Tensor(np.eye(3)[predictions[index]])

    def score(cached=None):
        return evaluate(eval_step, x, y, 3, 16, lambda: False, groups, cached)
    return score


def _data(rng, sizes):
    groups = np.repeat(np.arange(len(sizes)), sizes)
    count = len(groups)
    x = np.arange(count).reshape(count, 1)
    return x, rng.integers(0, 3, count), groups


def test_acceptance_group_is_validation_else_the_hold_out():
    assert acceptance_group(np.array([0, 1, 2])) == "0"
    assert acceptance_group(np.array([1, 2, 2])) == "1"
    assert acceptance_group(np.array([2, 2])) is None and acceptance_group(None) is None


@pytest.mark.parametrize("seed", range(30))
def test_the_worker_refuses_on_validation_alone_what_the_session_refuses(seed):
    # refusal_check sees only the acceptance group; the session's refusal_reason sees both
    # accuracies and the paired counts. They agree, so a candidate the session would promote
    # is always scored on the reference too.
    rng = np.random.default_rng(seed)
    x, y, groups = _data(rng, [200, 50, 300])
    before = rng.random(len(y)) < 0.5
    after = np.where(rng.random(len(y)) < rng.uniform(0.05, 0.4), ~before, before)
    tolerance, z = rng.choice([0.0, 0.01]), rng.choice([0.0, 1.5, 3.0])
    refused = refusal_check(before, groups, tolerance, z)
    inside = groups == 0
    session = refusal_reason(float(before[inside].mean()), float(after[inside].mean()), tolerance,
                             z, paired_counts(before[inside], after[inside], None)["all"])
    assert refused({"correct": after}) == (session is not None)


def test_a_refused_candidate_is_scored_on_the_acceptance_group_alone():
    rng = np.random.default_rng(3)
    x, y, groups = _data(rng, [40, 10, 60])
    right, wrong = y.copy(), (y + 1) % 3
    ran = []
    first = score_candidate(_score(x, y, groups, wrong, ran), groups, lambda ev: True)
    assert sum(ran) == 40 and first["by_group"] == {"0": 0.0} and first["samples"] == 40
    assert first["per_class"] is None and first["accuracy"] == 0.0
    ran.clear()
    full = score_candidate(_score(x, y, groups, right, ran), groups, lambda ev: False)
    assert sum(ran) == 110 and full["by_group"] == {"0": 1.0, "1": 1.0, "2": 1.0}
    assert full["accuracy"] == 1.0 and full["samples"] == 110 and full["cached"] == 0
    ran.clear()
    whole = score_candidate(_score(x, y, groups, right, ran), groups, None)
    assert ran == [16] * 6 + [14] and whole["by_group"] == full["by_group"]  # one pass
