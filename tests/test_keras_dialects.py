"""Configurations translated between the Keras 2 and 3 dialects: layer names that hold "/",
keys one dialect writes and the other refuses, activations named alike that differ (no
TensorFlow)."""

from pathlib import Path

import pytest

from odtd.trainer.modelfile import model_file
from odtd.trainer.modelfile.keras_dialects import ConversionError, to_keras2, to_keras3

FIXTURES = Path(__file__).parent / "fixtures" / "keras"


def _layer(cls, name, *sources, kwargs=None, **settings):
    return {"class_name": cls, "name": name,
            "config": dict({"name": name, "dtype": "float32"}, **settings),
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


def _keras3_layer(cls, name, source=None, **settings):
    """A layer as Keras 3 writes it: its call's tensors as ``__keras_tensor__`` arguments."""
    layer = _layer(cls, name, **settings)
    if source is not None:
        layer["inbound_nodes"] = [{"args": [{"class_name": "__keras_tensor__", "config": {
            "shape": [None, 8], "dtype": "float32", "keras_history": [source, 0, 0]}}],
            "kwargs": {}}]
    return layer


def _by_name(config):
    return {layer["name"]: layer for layer in config["config"]["layers"]}


def test_tf_keras_2_hard_sigmoid_is_built_for_keras_3_as_what_tf_keras_2_computes():
    # tf.keras 2: clip(0.2 x + 0.5, 0, 1); Keras 3's hard_sigmoid is clip(x / 6 + 0.5, 0, 1).
    config = _functional("m", [_layer("InputLayer", "image"),
                               _layer("Activation", "gate", "image", activation="hard_sigmoid"),
                               _layer("Dense", "probs", "gate", activation="softmax")],
                         ["image"], ["probs"])
    layers = _by_name(to_keras3(config))
    assert list(layers) == ["image", "gate_scale", "gate", "probs"]
    scale = layers["gate_scale"]
    assert scale["class_name"] == "Rescaling"
    assert (scale["config"]["scale"], scale["config"]["offset"]) == (0.2, 0.5)
    assert scale["inbound_nodes"] == [[["image", 0, 0, {}]]]
    gate = layers["gate"]  # keeps the name every reference uses
    assert gate["class_name"] == "ReLU" and gate["config"]["max_value"] == 1.0
    assert gate["inbound_nodes"] == [[["gate_scale", 0, 0, {}]]]
    assert layers["probs"]["inbound_nodes"] == [[["gate", 0, 0, {}]]]


def test_keras_3_activations_tf_keras_2_lacks_are_built_from_its_layers():
    config = _functional("m", [
        _keras3_layer("InputLayer", "image"),
        _keras3_layer("Activation", "hswish", "image", activation="hard_silu"),
        _keras3_layer("Activation", "gate", "hswish", activation="hard_sigmoid"),
        _keras3_layer("Activation", "six", "gate", activation="relu6"),
        _keras3_layer("Activation", "leaky", "six", activation="leaky_relu"),
        _keras3_layer("Activation", "silu", "leaky", activation="silu"),
        _keras3_layer("LeakyReLU", "leaky_layer", "silu", negative_slope=0.3),
    ], ["image"], ["leaky_layer"])
    layers = _by_name(to_keras2(config))
    assert [layers[n]["class_name"] for n in ("hswish_scale", "hswish_clip", "hswish")] == [
        "Rescaling", "ReLU", "Multiply"]
    assert layers["hswish_scale"]["config"]["scale"] == pytest.approx(1 / 6)
    assert layers["hswish"]["inbound_nodes"] == [[["image", 0, 0, {}], ["hswish_clip", 0, 0, {}]]]
    assert layers["gate_scale"]["config"]["scale"] == pytest.approx(1 / 6)
    assert layers["gate_scale"]["inbound_nodes"] == [[["hswish", 0, 0, {}]]]
    assert layers["six"]["class_name"] == "ReLU" and layers["six"]["config"]["max_value"] == 6
    assert layers["leaky"]["class_name"] == "LeakyReLU" and layers["leaky"]["config"]["alpha"] == 0.2
    assert layers["silu"]["config"]["activation"] == "swish"
    assert layers["leaky_layer"]["config"] == {"name": "leaky_layer", "dtype": "float32",
                                               "alpha": 0.3}


@pytest.mark.parametrize("convert, activation, match", [
    (to_keras3, "hard_sigmoid", r"layer probs: activation 'hard_sigmoid' computes differently "
                                r"in Keras 3 \(rebuilt only as an Activation layer"),
    (to_keras2, "hard_silu", r"layer probs: activation 'hard_silu' computes differently in "
                             r"tf.keras 2"),
    (to_keras2, "log_softmax", r"layer probs: activation 'log_softmax' is not in tf.keras 2; "
                               r"train it with a Keras 3 worker"),
])
def test_an_activation_that_cannot_be_translated_is_refused_naming_the_layer(
        convert, activation, match):
    layer = _keras3_layer if convert is to_keras2 else _layer
    config = _functional("m", [layer("InputLayer", "image"),
                               layer("Dense", "probs", "image", activation=activation)],
                         ["image"], ["probs"])
    with pytest.raises(ConversionError, match=match):
        convert(config)


def test_tf_keras_2_files_keys_keras_3_refuses_and_tensorflows_initializers():
    # tf.keras 2's SeparableConv2D writes its Conv base's unused kernel_* settings; a bias
    # initializer of TensorFlow's own is written under TensorFlow's module.
    info = model_file.read_config(str(FIXTURES / "k2" / "dialect_details.h5"))
    assert "tensorflow.python" not in str(info["config"])
    assert list(model_file.screen(info["config"])) == []
    layers = _by_name(to_keras3(info["config"]))
    sep = layers["sep"]["config"]
    assert "depthwise_initializer" in sep and "kernel_initializer" not in sep
    assert layers["probs"]["config"]["bias_initializer"]["class_name"] == "Constant"


def test_keys_one_keras_writes_and_the_other_refuses_are_dropped_at_their_defaults():
    # As each Keras writes them (Keras 3.15 and tf.keras 2.15 get_config; the keys the other's
    # from_config refused were found by trying every allowed layer). Keras 3's layers without
    # their (dict) nodes: only the settings are at stake.
    keras3 = _functional("k3", [
        _layer("InputLayer", "image", batch_shape=[None, 40, 40, 3]),
        _layer("Resizing", "resize", height=32, width=32, interpolation="bilinear",
               crop_to_aspect_ratio=False, data_format="channels_last",
               pad_to_aspect_ratio=False, fill_mode="constant", fill_value=0.0,
               antialias=False),
        _layer("CenterCrop", "crop", height=30, width=30,
               data_format="channels_last"),
        _layer("LayerNormalization", "norm", axis=-1, rms_scaling=False),
        _layer("SpatialDropout2D", "drop", rate=0.1, seed=None,
               data_format="channels_last"),
    ], ["image"], ["drop"])
    layers = _by_name(to_keras2(keras3))
    assert layers["resize"]["config"] == {"name": "resize", "dtype": "float32", "height": 32,
                                          "width": 32, "interpolation": "bilinear",
                                          "crop_to_aspect_ratio": False}
    assert "data_format" not in layers["crop"]["config"]
    assert "rms_scaling" not in layers["norm"]["config"]
    assert layers["drop"]["config"]["data_format"] == "channels_last"  # tf.keras 2 has it
    keras3["config"]["layers"][1]["config"]["antialias"] = True
    with pytest.raises(ConversionError, match="layer resize: antialias=True has no equivalent"):
        to_keras2(keras3)

    keras2 = _functional("k2", [
        _layer("InputLayer", "image", batch_input_shape=[None, 8, 8, 3]),
        _layer("SpatialDropout2D", "drop", "image", trainable=True, rate=0.1, noise_shape=None,
               seed=None, data_format="channels_last"),
        _layer("Conv2DTranspose", "up", "drop", filters=4, kernel_size=[3, 3], groups=1),
    ], ["image"], ["up"])
    layers = _by_name(to_keras3(keras2))
    drop = dict(layers["drop"]["config"], dtype=None)
    assert drop == {"name": "drop", "dtype": None, "rate": 0.1, "seed": None,
                    "data_format": "channels_last"}
    assert "groups" not in layers["up"]["config"]
    keras2["config"]["layers"][2]["config"]["groups"] = 2
    with pytest.raises(ConversionError, match="layer up: groups=2 has no equivalent"):
        to_keras3(keras2)
