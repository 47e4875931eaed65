"""Translate a screened model configuration between the Keras 2 and Keras 3 dialects (JSON only).

A model trained on a server with Keras 3 must train on a TX2 whose worker runs tf.keras 2.7, and
the reverse: neither reads the other's files (tf.keras 2.15 refuses Keras 3's ``batch_shape``
and ``keras.src.models`` modules; Keras 3 refuses Keras 2's nested-model node indices, mixed
precision ``Policy`` dicts and DepthwiseConv2D ``groups``). Input: a configuration from
``model_file.read_config`` that ``model_file.screen`` passed. Output: one the running Keras
builds (``imported.build_from_config``); weights are copied separately.
Standard library only; Python 3.6-compatible.

What differs between the dialects (found by loading each stack's files on the other):
- InputLayer: Keras 3 ``batch_shape`` (+ ``optional``) vs Keras 2 ``batch_input_shape``.
- dtype: Keras 3 ``{"class_name": "DTypePolicy", "config": {"name": ...}}`` on every layer;
  Keras 2 a string, or ``{"class_name": "Policy", ...}`` for a mixed policy.
- inbound_nodes: Keras 3 ``[{"args": [<__keras_tensor__ ...>], "kwargs": {}}]``; Keras 2
  ``[[[layer, node_index, tensor_index, kwargs], ...]]``.
- node_index of a nested model: Keras 2 counts the nested model's own construction as node 0,
  so the outer model's first call is node 1; Keras 3 counts it as node 0.
- input_layers/output_layers: Keras 3 writes a bare ``[name, 0, 0]`` for a single tensor.
- layer names: Keras 2 allows "/" in a name (tf.keras 2's MobileNetV3: ``Conv/BatchNorm``),
  Keras 3 does not; such a layer is renamed with "_" for Keras 3 (``keras3_name``), and weights
  are matched to the file's by that name (``imported``).
- per-layer keys: Keras 2 DepthwiseConv2D writes ``groups`` and SeparableConv2D the unused
  ``kernel_initializer``/``_regularizer``/``_constraint`` of its Conv base (Keras 3 rejects
  them), tf.keras 2's Conv2DTranspose ``groups`` and SpatialDropout ``trainable`` and
  ``noise_shape`` (Keras 3 rejects them), Keras 3 Dense writes ``quantization_config``/lora
  keys, BatchNormalization ``synchronized`` (not in TF 2.7), Normalization ``invert`` (not in
  TF 2.7), Resizing, CenterCrop and ZeroPadding1D ``data_format`` and Resizing's padding and
  antialiasing, LayerNormalization ``rms_scaling`` (not in tf.keras 2.15), the
  module/registered_name/build_config metadata.
"""
import copy

MODEL_CLASSES = ("Functional", "Sequential", "Model")
PLAIN_DTYPES = ("float16", "float32", "float64", "bfloat16")
# Keys a target cannot take; dropped only if the value is the listed default (else refuse).
DROP_FOR_KERAS2 = {
    "Dense": {"quantization_config": None, "lora_rank": None, "lora_alpha": None},
    "EinsumDense": {"quantization_config": None, "lora_rank": None, "lora_alpha": None},
    "InputLayer": {"optional": False},
    "Conv2D": {"lora_rank": None, "lora_alpha": None},
    "DepthwiseConv2D": {"lora_rank": None, "lora_alpha": None},
    # Keras 3's newer settings (each checked against tf.keras 2.15's from_config).
    "LayerNormalization": {"rms_scaling": False},
    "Resizing": {"data_format": "channels_last", "pad_to_aspect_ratio": False,
                 "fill_mode": "constant", "fill_value": 0.0, "antialias": False},
    "CenterCrop": {"data_format": "channels_last"},
    "ZeroPadding1D": {"data_format": "channels_last"},
}
# Layer settings Keras 3 renamed: (class, Keras 3 key, Keras 2 key).
KEYS_RENAMED_FOR_KERAS2 = [("LeakyReLU", "negative_slope", "alpha")]
# Arguments older tf.keras lacks: (first TF version with it, class, key, default). From the
# versioned API docs: BatchNormalization(synchronized=) appears in r2.12 (SyncBatchNormalization
# before); Normalization(invert=) is not in the r2.7-era signature (axis, mean, variance).
NEWER_KEYS = [((2, 12), "BatchNormalization", "synchronized", False),
              ((2, 10), "Normalization", "invert", False)]
DROP_FOR_KERAS3 = {
    "DepthwiseConv2D": {"groups": 1},
    "SeparableConv2D": {"groups": 1},
    "BatchNormalization": {"renorm": False, "renorm_clipping": None, "renorm_momentum": 0.99,
                           "fused": None, "virtual_batch_size": None, "adjustment": None},
    "Conv2DTranspose": {"groups": 1},
    "SpatialDropout1D": {"noise_shape": None},
    "SpatialDropout2D": {"noise_shape": None},
}
# Keys a Keras 2 layer writes but never uses, which Keras 3 refuses: dropped whatever their
# value. tf.keras 2's SeparableConv2D inherits Conv's kernel_* settings into its config (every
# such layer has them, NASNet's `kernel_initializer="he_normal"` too); its kernels are the
# depthwise and pointwise ones, with their own initializers, regularizers and constraints.
INERT_FOR_KERAS3 = {
    "SeparableConv2D": ("kernel_initializer", "kernel_regularizer", "kernel_constraint"),
    # Keras 3's SpatialDropout takes no "trainable" (it has no weights either way).
    "SpatialDropout1D": ("trainable",),
    "SpatialDropout2D": ("trainable",),
}
KERAS3_EMPTY_DEFAULT = {"fused": True}  # fused=True is also harmless for Keras 3 (dropped)


class ConversionError(ValueError):
    """A layer setting has no equivalent in the target dialect."""


def _drop(cls, cfg, table, name):
    for key, default in table.get(cls, {}).items():
        if key in cfg:
            value = cfg.pop(key)
            if value != default and not (key == "fused" and value in (True, False)):
                raise ConversionError("layer {}: {}={!r} has no equivalent".format(
                    name, key, value))


def _policy_name(dtype):
    if isinstance(dtype, dict):
        return (dtype.get("config") or {}).get("name")
    return dtype


def _strip_meta(obj):
    """Remove Keras-3-only serialization metadata recursively (module, registered_name...)."""
    if isinstance(obj, list):
        return [_strip_meta(item) for item in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for key, value in obj.items():
        if key in ("module", "registered_name", "build_config", "compile_config",
                   "shared_object_id"):
            continue
        out[key] = _strip_meta(value)
    return out


def _nested_names(layers):
    return set(layer["config"]["name"] for layer in layers
               if layer.get("class_name") in MODEL_CLASSES)


# ------------------------------------------------------------------ Keras 3 -> Keras 2
def _k3_node_to_k2(node, nested, layer_name):
    args = node.get("args", [])
    kwargs = dict((k, v) for k, v in (node.get("kwargs") or {}).items() if v is not None)
    if not args:
        raise ConversionError("layer {}: call without tensor arguments".format(layer_name))
    first = args[0]
    tensors = first if isinstance(first, list) else [first]
    if len(args) > 1:
        raise ConversionError("layer {}: extra positional call arguments".format(layer_name))
    out = []
    for tensor in tensors:
        if not (isinstance(tensor, dict) and tensor.get("class_name") == "__keras_tensor__"):
            raise ConversionError("layer {}: non-tensor call argument".format(layer_name))
        name, node_index, tensor_index = tensor["config"]["keras_history"]
        if name in nested:
            node_index += 1
        out.append([name, node_index, tensor_index, kwargs])
    return out


def _k3_io_to_k2(io, nested):
    if io and isinstance(io[0], str):
        io = [io]
    return [[n, i + (1 if n in nested else 0), t] for n, i, t in io]


def _layer_to_k2(layer, nested, tf_version):
    cls = layer["class_name"]
    cfg = layer["config"]
    name = cfg.get("name")
    if cls in MODEL_CLASSES:
        cfg = _model_to_k2(layer, tf_version)["config"]
    else:
        if cls == "InputLayer":
            if "batch_shape" in cfg:
                cfg["batch_input_shape"] = cfg.pop("batch_shape")
        _drop(cls, cfg, DROP_FOR_KERAS2, name)
        for klass, key, old in KEYS_RENAMED_FOR_KERAS2:
            if cls == klass and key in cfg:
                cfg[old] = cfg.pop(key)
        for since, klass, key, default in NEWER_KEYS:
            if tf_version < since and cls == klass:
                _drop(cls, cfg, {cls: {key: default}}, name)
    if "dtype" in cfg:
        pname = _policy_name(cfg["dtype"])
        cfg["dtype"] = pname if pname in PLAIN_DTYPES or pname is None else {
            "class_name": "Policy", "config": {"name": pname}}
    out = {"class_name": cls, "config": cfg}
    if "name" in layer:
        out["name"] = layer["name"]
    if "inbound_nodes" in layer:
        out["inbound_nodes"] = [_k3_node_to_k2(n, nested, name) for n in layer["inbound_nodes"]]
    return out


def _model_to_k2(model, tf_version):
    cfg = model["config"]
    layers = cfg.get("layers") or []
    nested = _nested_names(layers)
    cfg["layers"] = translate_activations(
        [_layer_to_k2(layer, nested, tf_version) for layer in layers], "keras3", "keras2",
        tf_version)
    if model["class_name"] != "Sequential":
        cfg["input_layers"] = _k3_io_to_k2(cfg["input_layers"], nested)
        cfg["output_layers"] = _k3_io_to_k2(cfg["output_layers"], nested)
    if "dtype" in cfg:
        pname = _policy_name(cfg["dtype"])
        cfg["dtype"] = pname if pname in PLAIN_DTYPES or pname is None else {
            "class_name": "Policy", "config": {"name": pname}}
    return {"class_name": "Functional" if model["class_name"] == "Model" else
            model["class_name"], "config": cfg}


OBJECT_DROP_FOR_KERAS2 = {"input_axes": None, "output_axes": None}  # Keras 3.1x initializers


def _objects_to_k2(obj):
    """Initializer/regularizer/constraint sub-configs: drop Keras-3-only keys at defaults."""
    if isinstance(obj, list):
        return [_objects_to_k2(item) for item in obj]
    if not isinstance(obj, dict):
        return obj
    if "class_name" in obj and isinstance(obj.get("config"), dict) and "inbound_nodes" not in obj \
            and obj["class_name"] not in MODEL_CLASSES and "name" not in obj["config"]:
        _drop(obj["class_name"], obj["config"], {obj["class_name"]: OBJECT_DROP_FOR_KERAS2},
              obj["class_name"])
    return dict((k, _objects_to_k2(v)) for k, v in obj.items())


def to_keras2(config, tf_version=(2, 15)):
    """A Keras-3-dialect config -> Keras 2 (for tf.keras ``tf_version``, e.g. (2, 7)) dialect."""
    return _model_to_k2(_objects_to_k2(_strip_meta(copy.deepcopy(config))), tf_version)


# ------------------------------------------------------------------ Keras 2 -> Keras 3
def _dtype_k3(dtype):
    pname = _policy_name(dtype)
    if pname is None:
        return None
    return {"module": "keras", "class_name": "DTypePolicy", "config": {"name": pname},
            "registered_name": None}


def keras3_name(name):
    """A layer's name as Keras 3 takes it: "/" (allowed by Keras 2) becomes "_"."""
    return name.replace("/", "_")


def _keras3_names(layers):
    """{name: new name} for the layers whose names hold "/"."""
    names = set(layer["config"].get("name") for layer in layers)
    renamed = {}
    for name in sorted(n for n in names if isinstance(n, str) and "/" in n):
        new = keras3_name(name)
        if new in names or new in renamed.values():
            raise ConversionError(
                "layer {!r}: Keras 3 allows no '/' in a layer's name, and {!r} is taken; "
                "train it with a tf.keras 2 worker (trainer.python)".format(name, new))
        renamed[name] = new
    return renamed


def _renamed_refs(value, renamed):
    """A call's kwargs with the [layer, node, tensor] references to renamed layers renamed."""
    if isinstance(value, dict):
        return dict((key, _renamed_refs(item, renamed)) for key, item in value.items())
    if isinstance(value, list):
        if len(value) >= 3 and isinstance(value[0], str) and value[0] in renamed \
                and isinstance(value[1], int):
            return [renamed[value[0]]] + value[1:]
        return [_renamed_refs(item, renamed) for item in value]
    return value


def _k2_nodes_fix(inbound, nested, renamed):
    out = []
    for node in inbound:
        fixed = []
        for ref in node:
            ref = list(ref)
            if ref[0] in nested:
                ref[1] -= 1
            ref[0] = renamed.get(ref[0], ref[0])
            if len(ref) > 3:
                ref[3] = _renamed_refs(ref[3], renamed)
            fixed.append(ref)
        out.append(fixed)
    return out


def _layer_to_k3(layer, nested, renamed):
    cls = layer["class_name"]
    cfg = layer["config"]
    name = cfg.get("name")
    if cls in MODEL_CLASSES:
        cfg = _model_to_k3(layer)["config"]
    else:
        if cls == "InputLayer" and "batch_input_shape" in cfg:
            cfg["batch_shape"] = cfg.pop("batch_input_shape")
        _drop(cls, cfg, DROP_FOR_KERAS3, name)
        for key in INERT_FOR_KERAS3.get(cls, ()):
            cfg.pop(key, None)
        if "dtype" in cfg and cls != "InputLayer":
            cfg["dtype"] = _dtype_k3(cfg["dtype"])
    if name in renamed:
        cfg["name"] = renamed[name]
    out = {"class_name": cls, "config": cfg}
    if "name" in layer:
        out["name"] = renamed.get(layer["name"], layer["name"])
    if "inbound_nodes" in layer:
        out["inbound_nodes"] = _k2_nodes_fix(layer["inbound_nodes"], nested, renamed)
    return out


def _model_to_k3(model):
    cfg = model["config"]
    layers = cfg.get("layers") or []
    nested = _nested_names(layers)
    renamed = _keras3_names(layers)
    if isinstance(cfg.get("name"), str):
        cfg["name"] = keras3_name(cfg["name"])
    cfg["layers"] = translate_activations(
        [_layer_to_k3(layer, nested, renamed) for layer in layers], "keras2", "keras3")
    if model["class_name"] != "Sequential":
        for key in ("input_layers", "output_layers"):
            cfg[key] = [[renamed.get(n, n), i - (1 if n in nested else 0), t]
                        for n, i, t in cfg[key]]
    return {"class_name": model["class_name"], "config": cfg}


def to_keras3(config):
    """A Keras-2-dialect config (tf.keras 2.x, .h5 or .keras) -> a config Keras 3 builds."""
    return _model_to_k3(_strip_meta(copy.deepcopy(config)))


# tf.keras 2 writes an initializer made by TensorFlow itself (tf.constant_initializer, as
# keras.applications' EfficientNetV2 sets a bias) under TensorFlow's module. These TF 2 classes
# are what tf.keras's own initializers are built on, with the same configuration; an imported
# model's weights come from the file, so only its building needs them.
TF_INITIALIZER_MODULE = "tensorflow.python.ops.init_ops_v2"
TF_INITIALIZERS = frozenset("""
Constant Zeros Ones RandomNormal RandomUniform TruncatedNormal VarianceScaling Orthogonal
Identity GlorotUniform GlorotNormal
""".split())


def tf_initializers_as_keras(obj):
    """Name TensorFlow's own initializers in ``obj`` (in place) as the Keras ones they equal."""
    if isinstance(obj, list):
        for item in obj:
            tf_initializers_as_keras(item)
    elif isinstance(obj, dict):
        if obj.get("module") == TF_INITIALIZER_MODULE and obj.get("class_name") in TF_INITIALIZERS:
            obj["module"] = "keras.initializers"
            obj["registered_name"] = None
            return
        for value in obj.values():
            tf_initializers_as_keras(value)


# ------------------------------------------------------------------ activations
# An activation named alike in both dialects but computed differently, or one the target lacks,
# is built from layers both have. tf.keras 2's hard_sigmoid is clip(0.2 x + 0.5, 0, 1), Keras
# 3's clip(x / 6 + 0.5, 0, 1): (Rescaling(scale, offset), then ReLU(max_value=1)) either way.
# Keras 3's hard_silu (alias hard_swish) is x * hard_sigmoid(x); tf.keras 2 has none.
HARD_SIGMOID = {"keras2": (0.2, 0.5), "keras3": (1.0 / 6.0, 0.5)}
_DIALECT_NAMES = {"keras2": "tf.keras 2", "keras3": "Keras 3"}
# Keras 3 activations tf.keras 2 lacks, as the tf.keras 2 layer that computes the same.
KERAS3_ONLY_AS_LAYER = {"relu6": ("ReLU", {"max_value": 6.0, "negative_slope": 0.0,
                                           "threshold": 0.0}),
                        "leaky_relu": ("LeakyReLU", {"alpha": 0.2})}
ACTIVATIONS_RENAMED_FOR_KERAS2 = {"silu": "swish"}
# The activations tf.keras 2 (2.7 and later) has; mish since 2.13.
KERAS2_ACTIVATIONS = frozenset("""
linear relu sigmoid softmax tanh elu selu softplus softsign exponential swish gelu hard_sigmoid
""".split())


def _layer_config(name, dtype, **settings):
    cfg = {"name": name, "trainable": True}
    if dtype is not None:
        cfg["dtype"] = dtype
    cfg.update(settings)
    return cfg


def _new_layer(cls, cfg, inbound):
    """A layer called once, in Keras 2's node format (both conversions' output)."""
    return {"class_name": cls, "config": cfg, "name": cfg["name"], "inbound_nodes": [inbound]}


def _hard_sigmoid_layers(layer, source, swish, taken):
    """``layer``, an Activation called once, as Rescaling then ReLU(max_value=1).

    For a hard swish, then Multiply by its input. The last keeps its name, so every reference
    to it holds.
    """
    cfg = layer["config"]
    name, dtype = cfg["name"], cfg.get("dtype")
    nodes = layer.get("inbound_nodes")
    if not nodes or len(nodes) != 1 or len(nodes[0]) != 1:
        raise ConversionError("layer {}: activation {!r} called more than once; not "
                              "translated".format(name, cfg["activation"]))
    for suffix in ("_scale", "_clip"):
        if name + suffix in taken:
            raise ConversionError("layer {}: {!r} is taken".format(name, name + suffix))
    scale, offset = HARD_SIGMOID[source]
    x = nodes[0][0]
    clip = name + "_clip" if swish else name
    out = [_new_layer("Rescaling", _layer_config(name + "_scale", dtype, scale=scale,
                                                 offset=offset), [x]),
           _new_layer("ReLU", _layer_config(clip, dtype, max_value=1.0, negative_slope=0.0,
                                            threshold=0.0),
                      [[name + "_scale", 0, 0, {}]])]
    if swish:
        out.append(_new_layer("Multiply", _layer_config(name, dtype),
                              [list(x[:3]) + [{}], [clip, 0, 0, {}]]))
    return out


def translate_activations(layers, source, target, tf_version=(2, 15)):
    """A model's layers (Keras 2 node format) with their activations translated to ``target``.

    Every activation computed differently in ``target`` than in ``source``, or missing there,
    is rebuilt from layers ``target`` has.

    Raises ConversionError for such an activation inside another layer (Conv2D(activation=...))
    or in a Sequential model, and for one ``target`` has no equivalent for.
    """
    taken = set(layer["config"].get("name") for layer in layers)
    have = KERAS2_ACTIVATIONS | (frozenset(["mish"]) if tf_version >= (2, 13) else frozenset())
    out = []
    for layer in layers:
        cfg = layer["config"]
        act = cfg.get("activation")
        if layer["class_name"] in MODEL_CLASSES or not isinstance(act, str):
            out.append(layer)
            continue
        if target == "keras2":
            act = cfg["activation"] = ACTIVATIONS_RENAMED_FOR_KERAS2.get(act, act)
        hard = act in ("hard_silu", "hard_swish", "hard_sigmoid")
        standalone = layer["class_name"] == "Activation" and "inbound_nodes" in layer
        if hard and standalone:
            out.extend(_hard_sigmoid_layers(layer, source, act != "hard_sigmoid", taken))
        elif target == "keras2" and act in KERAS3_ONLY_AS_LAYER and standalone:
            cls, settings = KERAS3_ONLY_AS_LAYER[act]
            new = dict(layer, class_name=cls)
            new["config"] = _layer_config(cfg["name"], cfg.get("dtype"), **settings)
            out.append(new)
        elif hard or target == "keras2" and act not in have:
            raise ConversionError(
                "layer {}: activation {!r} {} {}{}; train it with a {} worker "
                "(trainer.python)".format(
                    cfg["name"], act, "computes differently in" if hard else "is not in",
                    _DIALECT_NAMES[target],
                    " (rebuilt only as an Activation layer of a functional model)"
                    if hard or act in KERAS3_ONLY_AS_LAYER else "", _DIALECT_NAMES[source]))
        else:
            out.append(layer)
    return out
