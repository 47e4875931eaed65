"""Keras 2 configurations translated for Keras 3: layer names that hold "/" (no TensorFlow)."""

import pytest

from odtd.trainer.keras_dialects import ConversionError, to_keras3


def _layer(cls, name, *sources, kwargs=None):
    return {"class_name": cls, "name": name, "config": {"name": name, "dtype": "float32"},
            "inbound_nodes": [[[source, 0, 0, kwargs or {}] for source in sources]]
            if sources else []}


def _functional(name, layers, inputs, outputs):
    return {"class_name": "Functional", "config": {
        "name": name, "layers": layers, "input_layers": [[n, 0, 0] for n in inputs],
        "output_layers": [[n, 0, 0] for n in outputs]}}


def test_slash_names_become_underscores_everywhere_a_layer_is_named():
    inner = _functional("se/block", [_layer("InputLayer", "se/in"),
                                     _layer("Dense", "se/dense", "se/in")],
                        ["se/in"], ["se/dense"])
    inner.update(name="se/block", inbound_nodes=[[["Conv/BatchNorm", 0, 0, {}]]])
    inner["config"]["name"] = "se/block"
    config = _functional("mobilenet/v3", [
        _layer("InputLayer", "image"),
        _layer("Conv2D", "Conv/conv", "image"),
        _layer("BatchNormalization", "Conv/BatchNorm", "Conv/conv"),
        inner,
        # A tensor passed by keyword ([layer, node, tensor] in tf.keras 2's node kwargs).
        _layer("TFOpLambda", "multiply", "se/block",
               kwargs={"y": ["Conv/BatchNorm", 0, 0], "name": None}),
    ], ["image"], ["multiply"])
    # Keras 2 counts a nested model's first call in the outer model as its node 1.
    config["config"]["layers"][-1]["inbound_nodes"][0][0][1] = 1
    out = to_keras3(config)["config"]
    names = [layer["config"]["name"] for layer in out["layers"]]
    assert out["name"] == "mobilenet_v3"
    assert names == ["image", "Conv_conv", "Conv_BatchNorm", "se_block", "multiply"]
    assert [layer["name"] for layer in out["layers"]] == names
    nodes = {layer["name"]: layer["inbound_nodes"] for layer in out["layers"]}
    assert nodes["Conv_BatchNorm"][0][0][0] == "Conv_conv"
    assert nodes["se_block"][0][0][0] == "Conv_BatchNorm"
    assert nodes["multiply"][0][0][:3] == ["se_block", 0, 0]
    assert nodes["multiply"][0][0][3] == {"y": ["Conv_BatchNorm", 0, 0], "name": None}
    nested = out["layers"][3]["config"]
    assert [layer["name"] for layer in nested["layers"]] == ["se_in", "se_dense"]
    assert nested["layers"][1]["inbound_nodes"][0][0][0] == "se_in"
    assert nested["input_layers"] == [["se_in", 0, 0]]
    assert nested["output_layers"] == [["se_dense", 0, 0]]
    assert out["output_layers"] == [["multiply", 0, 0]]
    assert "/" not in str(out)
    assert "Conv/BatchNorm" in str(config)  # the caller's configuration is left as it was


def test_a_slash_name_whose_underscore_name_is_taken_is_refused_naming_both():
    config = _functional("m", [_layer("InputLayer", "image"), _layer("Dense", "a/b", "image"),
                               _layer("Dense", "a_b", "a/b")], ["image"], ["a_b"])
    with pytest.raises(ConversionError, match=r"layer 'a/b': .* 'a_b' is taken"):
        to_keras3(config)
