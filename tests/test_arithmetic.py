"""Tensor arithmetic in a user's model file (``x + 3.0``, ``x * y``), built as Keras layers.

tests/fixtures/keras/k2 and k3 hold ``arithmetic``, written by tf.keras 2.15 (``TFOpLambda``
layers) and Keras 3.15 (operation nodes) with tests/make_keras_models.py: nine operations,
pixels scaled by ``inputs / 255.0``, MobileNetV3's hard sigmoid, a convolutional head.
"""

import json

import h5py
import pytest
from conftest import native_suffix, odtctl
from test_byom import CLASSES, FIXTURES, keras_major, predict_max_diff

from odtd.trainer.modelfile import arithmetic, model_file

REWRITTEN = {"Rescaling", "Add", "Subtract", "Multiply"}


@pytest.mark.parametrize("op, operands, expected", [
    ("Add", ["x", 3.0], 8.0), ("Add", [3.0, "x"], 8.0),
    ("Subtract", ["x", 3.0], 2.0), ("Subtract", [1.0, "x"], -4.0),
    ("Multiply", ["x", 0.5], 2.5), ("Multiply", [2, "x"], 10.0),
    ("TrueDivide", ["x", 255.0], 5.0 / 255.0), ("Negative", ["x"], -5.0),
])
def test_each_operation_is_the_rescaling_that_computes_it(op, operands, expected):
    scale, offset = arithmetic.rescaling_of(op, operands)
    assert scale * 5.0 + offset == pytest.approx(expected)


@pytest.mark.parametrize("op, operands", [
    ("TrueDivide", [2.0, "x"]), ("TrueDivide", ["x", 0.0]), ("Add", ["x", "x"]),
    ("Negative", ["x", 1.0]),
])
def test_what_is_not_a_rescaling_is_not_one(op, operands):
    assert arithmetic.rescaling_of(op, operands) is None


@pytest.mark.parametrize("stack", ["k2", "k3"])
@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_the_files_arithmetic_reads_as_layers(stack, suffix):
    path = str(FIXTURES / stack / ("arithmetic" + suffix))
    info, summary = model_file.read_screened(path)
    assert info["arithmetic_layers"] == 9
    # inputs / 255.0 became a Rescaling in front: the model scales its own pixels.
    assert summary["rescales_input"] is True
    assert summary["classes"] == 4 and summary["output"] == "softmax"  # the 1x1 Conv2D head
    layers = info["config"]["config"]["layers"]
    assert REWRITTEN <= {layer["class_name"] for layer in layers}
    assert "TFOpLambda" not in {layer["class_name"] for layer in layers}
    # Each layer keeps the name of the node it replaces: the file's graph and weights hold.
    names = [layer["config"].get("name") for layer in raw_config(stack)["config"]["layers"]]
    assert [layer["config"].get("name") for layer in layers] == names


def raw_config(stack):
    """The .h5 file's configuration as written, before any rewriting."""
    with h5py.File(FIXTURES / stack / "arithmetic.h5", "r") as handle:
        return json.loads(handle.attrs["model_config"])


def first(layers, class_name):
    return next(layer for layer in layers if layer["class_name"] == class_name)


def test_a_number_divided_by_a_tensor_stays_refused():
    # Keras 3 writes 255.0 / x as an operation node TrueDivide with the number first.
    config = raw_config("k3")
    node = first(config["config"]["layers"], "TrueDivide")
    node["inbound_nodes"][0]["args"].reverse()
    rewritten, count = arithmetic.as_layers(config)
    assert count == 8
    assert list(model_file.screen(rewritten)) == [
        (node["config"]["name"], "operation node TrueDivide (a tensor op outside a layer)")]


def test_a_layer_whose_config_has_no_trainable_is_not_taken_for_an_operation_node():
    # Keras 3.15 writes SpatialDropout2D's config without "trainable" (as copied from its
    # file); an operation node named like a layer has nothing but its name.
    def node(cls, config):
        return {"module": None, "class_name": cls, "config": config, "name": config["name"],
                "inbound_nodes": [{"args": [{"class_name": "__keras_tensor__", "config": {
                    "shape": [None, 8, 8, 4], "dtype": "float32",
                    "keras_history": ["input_layer", 0, 0]}}], "kwargs": {"training": False}}]}

    spatial = node("SpatialDropout2D", {"rate": 0.1, "seed": None, "name": "spatial_dropout2d",
                                        "dtype": "float32", "data_format": "channels_last"})
    bare = node("Multiply", {"name": "multiply"})
    config = {"class_name": "Functional", "config": {"name": "m", "layers": [spatial, bare]}}
    assert list(model_file.screen(config)) == [
        ("multiply", "operation node Multiply (a tensor op outside a layer)")]


def test_a_tensorflow_function_other_than_arithmetic_stays_refused():
    config = raw_config("k2")
    node = first(config["config"]["layers"], "TFOpLambda")
    node["config"]["function"] = "math.pow"
    rewritten, count = arithmetic.as_layers(config)
    assert count == 8
    assert list(model_file.screen(rewritten)) == [
        (node["config"]["name"], "TFOpLambda layer (a TensorFlow function called by name: "
                                 "math.pow)")]


@pytest.mark.trains
def test_the_other_stacks_arithmetic_imports_and_exports_predicting_as_the_file(tmp_path):
    # A model the other Keras wrote (tf.keras 2's TFOpLambda for Keras 3, and the reverse),
    # imported and exported by this one: the export predicts what the file's model did.
    other_stack = FIXTURES / ("k2" if keras_major() == 3 else "k3")
    exported = []
    for suffix in (".keras", ".h5"):
        home = tmp_path / suffix[1:]
        summary = json.loads(odtctl(
            "init", "--model-file", str(other_stack / ("arithmetic" + suffix)), "--classes",
            CLASSES["arithmetic"], "--json", home=home).stdout)
        assert any(note.startswith("9 tensor operations of the model") for note in
                   summary["notes"]), summary["notes"]
        assert summary["output"] == "softmax"
        out = tmp_path / f"v0-{suffix[1:]}{native_suffix(suffix)}"
        odtctl("models", "export", "0", "--out", str(out), home=home)
        exported.append((out, other_stack / "arithmetic.ref.npz"))
    assert max(predict_max_diff(exported)) < 1e-5
