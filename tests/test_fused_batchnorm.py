"""fused_batchnorm: the fused kernel trains a Keras 3 model as its own BatchNormalization does.

The models run in a subprocess (TensorFlow stays out of the test process): two copies of one
model with the same weights, one fused, take the same SGD steps in float32 and mixed_bfloat16;
the losses, every weight and the moving statistics must agree, and the fused copy's step must
really contain the fused op (so the comparison can fail). Under tf.keras 2 the layers are left
as they are. On both, a float32 layer that trains fused turns Grappler's remapper off.
"""


import pytest
from conftest import bfloat16_refused, tensorflow_report

SCRIPT = r"""
import json
import numpy as np
import tensorflow as tf
from odtd.trainer.plans import fused_batchnorm
from odtd.trainer.models.imported import keras_major
from odtd.trainer.plans.precision import bfloat16_error
from odtd.trainer.worker.process import seed_everything

L = tf.keras.layers

def build():
    inp = tf.keras.Input((12, 12, 3))
    x = L.Conv2D(8, 3, padding="same", name="conv1")(inp)
    x = L.BatchNormalization(name="bn_default")(x)
    x = L.ReLU()(x)
    x = tf.keras.Sequential([L.Conv2D(8, 3, padding="same", name="conv2"),
                             L.BatchNormalization(center=False, scale=False, momentum=0.5,
                                                  name="bn_nested_plain")], name="block")(x)
    x = L.BatchNormalization(epsilon=1e-6, name="bn_tiny_epsilon")(x)
    x = L.GlobalAveragePooling2D()(x)
    x = L.Dense(8)(x)
    x = L.BatchNormalization(name="bn_dense")(x)
    return tf.keras.Model(inp, L.Dense(3, dtype="float32")(x))

rng = np.random.default_rng(0)
batches = [(rng.normal(size=(16, 12, 12, 3)).astype("float32"), rng.integers(0, 3, 16))
           for _ in range(3)]
report = {"keras": keras_major(tf), "tensorflow": tf.__version__, "bfloat16_error": bfloat16_error(tf)}
policies = ("float32",) if report["bfloat16_error"] else ("mixed_bfloat16", "float32")
for policy in policies:  # the order the remapper is left on, then off
    tf.keras.mixed_precision.set_global_policy(policy)
    seed_everything(tf, 1)  # tf.keras 2.6 has no set_random_seed
    models = [build(), build()]
    models[1].set_weights(models[0].get_weights())
    fused = fused_batchnorm.fuse(tf, models[1])
    apart = fused_batchnorm.keep_relu_apart(tf, models[1])
    remapping = tf.config.optimizer.get_experimental_options().get("remapping")
    losses, ops = [], []  # per model, in order: the plain one, the fused one
    for model in models:
        sgd = tf.keras.optimizers.SGD(0.1, momentum=0.9)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                    y, model(x, training=True), from_logits=True))
            sgd.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            return loss

        losses.append([float(step(x, y)) for x, y in batches])
        ops.append(any(op.type == "FusedBatchNormV3" for op in
                    step.get_concrete_function(*batches[0]).graph.get_operations()))
    # Each weight's largest difference against its scale (at least 0.1: a bias near 0 whose
    # gradient is only rounding, as a BatchNorm's beta before another BatchNorm, is not scale).
    gaps = {getattr(a, "path", None) or a.name:
            float(np.max(np.abs(a.numpy() - b.numpy())) / max(np.max(np.abs(a.numpy())), 0.1))
            for a, b in zip(models[0].weights, models[1].weights)}
    moved = float(np.max(np.abs(models[0].get_layer("bn_default").moving_variance.numpy() - 1.0)))
    report[policy] = {"fused": fused, "apart": apart, "remapping": remapping, "fused_op": ops,
                      "losses": losses, "gaps": gaps, "moved": moved,
                      "again": fused_batchnorm.fuse(tf, models[1])}
print(json.dumps(report))
"""


@pytest.mark.trains
def test_fused_batchnorm_trains_as_keras_own_and_only_where_it_applies():
    report = tensorflow_report(SCRIPT)
    for policy, tolerance in (("float32", 1e-4), ("mixed_bfloat16", 2e-2)):
        if policy == "mixed_bfloat16" and bfloat16_refused(report):
            continue
        result = report[policy]
        if report["keras"] == 2:  # tf.keras 2 fuses by itself: both copies run the fused op
            assert result["fused"] == 0 and result["fused_op"] == [True, True]
        else:
            # The 4-D layers with a usable epsilon, the nested one too; not the 2-D one or
            # the one whose epsilon the kernel would raise; fusing twice changes nothing.
            assert result["fused"] == result["again"] == 2
            assert result["fused_op"] == [False, True]
        # A float32 layer training fused on the CPU keeps Grappler from merging it with its
        # ReLU (for the process, so float32 runs last); under mixed precision nothing changes.
        assert result["apart"] is (policy == "float32")
        assert result["remapping"] is (False if policy == "float32" else None)
        plain, fused = result["losses"]
        assert max(abs(a - b) for a, b in zip(plain, fused)) < tolerance * max(plain), result
        assert result["moved"] > 0.01  # the moving statistics really moved ...
        worst = max(result["gaps"].items(), key=lambda item: item[1])
        assert worst[1] < tolerance, (policy, worst)  # ... and the same way, as every weight
