"""How ``bn_device_share: auto`` picks a mixture: the rule, and its lazy scoring (no TensorFlow);
the compiled statistics passes behind it (TensorFlow in a child process)."""

import numpy as np
import pytest
from conftest import tensorflow_report

from odtd.trainer.learning.batchnorm import AUTO_WEIGHTS, choose_mixture, choose_weight


def test_choose_weight_prefers_the_device_within_the_reference_tolerance():
    scores = {0.0: {"0": 0.20, "2": 0.39}, 0.5: {"0": 0.30, "2": 0.385},
              1.0: {"0": 0.41, "2": 0.30}}
    assert choose_weight(scores, 0.39, 0.01, "0", "2") == 0.5  # 1.0 forgets 9 points
    assert choose_weight(scores, 0.39, None, "0", "2") == 1.0  # no reference guard
    assert choose_weight(scores, 0.50, 0.01, "0", "2") == 0.0  # none spares it: the least loss
    assert choose_weight({0.0: {"all": 0.5}, 1.0: {"all": 0.5}}, None, None, None, "2") == 0.0


def _scorer(correct_by_weight, groups, scored):
    """``evaluate`` over fixed per-image outcomes; counts the images it runs in ``scored``."""
    state = {}

    def assign(weight):
        state["weight"] = weight

    def score(cached):
        correct = np.array(correct_by_weight[state["weight"]])
        losses = np.where(correct, 0.1, 2.0)
        known = np.zeros(len(groups), dtype=bool) if cached is None else cached[0]
        scored.append(int((~known).sum()))
        if cached is not None:
            correct = np.where(known, cached[1], correct)
            losses = np.where(known, cached[2], losses)
        return {"accuracy": float(correct.mean()), "seconds": 1.0, "cached": int(known.sum()),
                "by_group": {str(g): float(correct[groups == g].mean()) for g in np.unique(groups)},
                "correct": correct, "losses": losses}
    return assign, score


@pytest.mark.parametrize("seed", range(40))
def test_lazy_scoring_keeps_what_scoring_every_try_in_full_keeps(seed):
    rng = np.random.default_rng(seed)
    groups = np.repeat([0, 2], [30, 60])
    outcomes = {w: rng.random(90) < rng.uniform(0.2, 0.8) for w in AUTO_WEIGHTS}
    before, tolerance = rng.uniform(0.3, 0.7), 0.05
    full = {w: {"0": float(c[:30].mean()), "2": float(c[30:].mean())} for w, c in outcomes.items()}
    scored = []
    assign, score = _scorer(outcomes, groups, scored)
    kept, evaluation, tried = choose_mixture(assign, AUTO_WEIGHTS, score, groups, before,
                                             tolerance)
    assert kept == choose_weight(full, before, tolerance, "0", "2")
    assert tried[kept] == full[kept]
    np.testing.assert_array_equal(evaluation["correct"], outcomes[kept])
    assert evaluation["cached"] == 0 and evaluation["seconds"] == 2.0  # both passes
    # Each try on the 30 validation images, then the 60 reference images of as few as needed:
    # from the best on validation down to the first that spares the reference, or all five.
    assert scored[:5] == [30] * 5 and set(scored[5:]) == {60}
    spared = [w for w, f in full.items() if f["2"] >= before - tolerance]
    better = sum((f["0"], -w) > (full[kept]["0"], -kept) for w, f in full.items())
    assert len(scored) - 5 == (1 + better if spared else 5)
    assert sum("2" in groups_ for groups_ in tried.values()) == len(scored) - 5


def test_without_a_reference_every_try_is_scored_in_full():
    groups = np.zeros(20, dtype=np.int64)
    outcomes = {w: np.arange(20) < 4 * i for i, w in enumerate(AUTO_WEIGHTS)}
    scored = []
    assign, score = _scorer(outcomes, groups, scored)
    kept, evaluation, tried = choose_mixture(assign, AUTO_WEIGHTS, score, groups, 0.5, 0.01)
    assert kept == 1.0 and scored == [20] * 5 and sorted(tried) == list(AUTO_WEIGHTS)
    np.testing.assert_array_equal(evaluation["correct"], outcomes[1.0])


@pytest.mark.parametrize("seed", range(20))
def test_a_try_the_acceptance_test_refuses_is_not_scored_on_the_reference(seed):
    # refused (the worker's refusal_check) drops a try before its reference pass: what is
    # kept is then what scoring the tries it let through in full keeps, or, if it refuses
    # every try, the best on validation, with only validation scored.
    rng = np.random.default_rng(100 + seed)
    groups = np.repeat([0, 2], [30, 60])
    outcomes = {w: rng.random(90) < rng.uniform(0.2, 0.8) for w in AUTO_WEIGHTS}
    before, tolerance = rng.uniform(0.3, 0.7), 0.05
    full = {w: {"0": float(c[:30].mean()), "2": float(c[30:].mean())} for w, c in outcomes.items()}
    cut = rng.choice(sorted(f["0"] for f in full.values()) + [1.1])  # refuse below this
    let_through = [w for w in AUTO_WEIGHTS if full[w]["0"] >= cut]
    scored = []
    assign, score = _scorer(outcomes, groups, scored)
    kept, evaluation, tried = choose_mixture(
        assign, AUTO_WEIGHTS, score, groups, before, tolerance,
        refused=lambda first: first["by_group"]["0"] < cut)
    assert scored[:5] == [30] * 5 and set(scored[5:]) <= {60}
    assert len(scored) - 5 <= len(let_through)
    assert all("2" not in tried[w] for w in AUTO_WEIGHTS if w not in let_through)
    if let_through:
        assert kept == choose_weight({w: full[w] for w in let_through}, before, tolerance,
                                     "0", "2")
        assert evaluation["by_group"] == full[kept]
    else:
        assert kept == choose_weight({w: {"0": f["0"]} for w, f in full.items()}, None, None,
                                     "0", "2")
        assert evaluation["by_group"] == {"0": full[kept]["0"]} and len(scored) == 5
        assert evaluation["accuracy"] == full[kept]["0"] and evaluation["samples"] == 30


STATISTICS_SCRIPT = r"""
import json
import numpy as np
import tensorflow as tf
from odtd.trainer.learning import batchnorm

L = tf.keras.layers
inp = tf.keras.Input((8, 8, 3))
x = L.Conv2D(4, 3, padding="same")(inp)
x = L.BatchNormalization(name="bn1")(x)
x = L.ReLU()(x)
x = tf.keras.Sequential([L.Conv2D(4, 3, padding="same"), L.BatchNormalization(name="bn2")],
                        name="block")(x)
model = tf.keras.Model(inp, L.Dense(3)(L.GlobalAveragePooling2D()(x)))
bn1, bn2 = batchnorm.batchnorm_layers(tf, model)
job = {"input_shape": [8, 8, 3], "input_scale": "0-1", "output": "logits"}
rng = np.random.default_rng(0)
device = rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8)
rehearsal = rng.integers(0, 128, (12, 8, 8, 3), dtype=np.uint8)
statistics = [v for layer in (bn1, bn2) for v in (layer.moving_mean, layer.moving_variance)]
moving = [v.numpy().copy() for v in statistics]

def moments(layers, x, fresh):
    if fresh:
        batchnorm._COMPILED.clear()
    out = batchnorm.batch_moments(tf, model, job, layers, x, 8, lambda: False)
    return [np.concatenate(pair).tolist() for pair in out]

def passes(fresh):
    for v, value in zip(statistics, moving):
        v.assign(value)
    bn1.trainable = True  # adaptation: every layer measured, over both domains
    out = [moments([bn1, bn2], device, fresh), moments([bn1, bn2], rehearsal, fresh)]
    bn1.trainable = False  # recalibration: the trainable layers only
    out.append(moments([bn2], device, fresh))
    kept = all(np.array_equal(a, v.numpy()) for a, v in zip(moving, statistics))
    bn1.trainable = True  # the same layer measured with bn1 training: another state
    out.append(moments([bn2], device, fresh))
    return out, kept

cached, kept = passes(False)
report = {"traces": len(batchnorm._COMPILED), "moving_kept": kept,
          "retraced": max(f.experimental_get_tracing_count()
                          for _, f in batchnorm._COMPILED.values())}
fresh, _ = passes(True)
report["gap"] = max(float(np.max(np.abs(np.array(a) - np.array(b))))
                    for a, b in zip(cached, fresh))
report["states_differ"] = float(np.max(np.abs(np.array(cached[2]) - np.array(cached[3]))))
print(json.dumps(report))
"""


@pytest.mark.trains
def test_a_statistics_pass_is_traced_once_per_state_and_measures_what_a_fresh_one_does():
    # A session measures batch statistics up to five times; each pass is compiled once per
    # model, measured layers and trainable flags, and must measure what a fresh trace does.
    report = tensorflow_report(STATISTICS_SCRIPT)
    assert report["traces"] == 3 and report["retraced"] == 1
    assert report["gap"] < 1e-6
    assert report["states_differ"] > 1e-3  # bn2's inputs differ, so a stale trace would show
    assert report["moving_kept"]


def test_without_a_reference_set_the_choice_is_a_chosen_too():
    # An imported model's recipe (`trained_share: auto`) on a home without `--replay`: no
    # reference group. choose_mixture returned a plain tuple there, and the averaging that
    # reads `.value` failed every session.
    groups = np.repeat([0], 20)
    outcomes = {w: np.arange(20) < 10 + int(10 * w) for w in (0.25, 0.5, 1.0)}
    assign, score = _scorer(outcomes, groups, [])
    chosen = choose_mixture(assign, (0.25, 0.5, 1.0), score, groups, None, None)
    assert chosen.value == 1.0 and chosen.scores["accuracy"] == 1.0
    assert set(chosen.tried) == {0.25, 0.5, 1.0}
