"""What a model file's configuration says: dialect, input shape, classes, output convention.

Read from the configuration as JSON (``model_file.read_config``), never from a built model:

    model_summary(cfg)  -> dialect, input shape, classes, output convention, nested models
    fix_input_size(cfg, (height, width)) sets the size of an input that has none
    without_augmentation(cfg) -> a copy with random augmentation layers as identities

Standard library only; Python 3.6-compatible.
"""
import json

MODEL_CLASSES = ("Functional", "Sequential", "Model")
# Convolutions whose filters can be a classifier's outputs (a convolutional head).
CLASS_CONVOLUTIONS = ("Conv1D", "Conv2D", "SeparableConv2D")
# Random augmentation: the identity at inference, so odtd builds each as an identity layer
# (``without_augmentation``) and augments by its own policy (``training.augment``). Both
# Kerases', then tf.keras 2's RandomHeight/Width and Keras 3's newer ones (each checked to return
# its input at inference: tf.keras 2.15, Keras 3.15). Not RandomCrop: tf.keras 2 crops the
# centre at inference, Keras 3 returns its input.
AUGMENTATION_LAYERS = frozenset("""
RandomFlip RandomRotation RandomZoom RandomTranslation RandomContrast RandomBrightness
RandomHeight RandomWidth
RandomColorDegeneration RandomColorJitter RandomElasticTransform RandomErasing RandomGaussianBlur
RandomGrayscale RandomHue RandomInvert RandomPerspective RandomPosterization RandomSaturation
RandomSharpness RandomShear Solarization Equalization AugMix RandAugment CutMix MixUp
""".split())
# A model that starts with one of these scales its own pixels: it takes 0..255 as they come
# (after any of INPUT_PREPROCESSING, which do not change the pixels' range).
INPUT_SCALERS = ("Rescaling", "Normalization")
INPUT_PREPROCESSING = AUGMENTATION_LAYERS | frozenset(("Resizing", "CenterCrop"))


def _layers(config):
    return (config.get("config") or {}).get("layers") or []


def dialect(config):
    """``keras3`` or ``keras2``, by the config's own spelling (not by ``keras_version``)."""
    text = json.dumps(config)
    if '"batch_shape"' in text or '"__keras_tensor__"' in text or '"DTypePolicy"' in text:
        return "keras3"
    return "keras2"


def input_shape(config):
    """(H, W, C) of a single-input model, from its InputLayer (or Sequential build info)."""
    layers = _layers(config)
    for layer in layers:
        if layer.get("class_name") == "InputLayer":
            cfg = layer["config"]
            shape = cfg.get("batch_shape") or cfg.get("batch_input_shape")
            return tuple(shape[1:])
    # Keras-2 Sequential without an explicit InputLayer: first layer's batch_input_shape
    if layers:
        cfg = layers[0].get("config", {})
        shape = cfg.get("batch_input_shape") or cfg.get("batch_shape")
        if shape:
            return tuple(shape[1:])
    build = (config.get("config") or {}).get("build_input_shape") or config.get(
        "build_config", {}).get("input_shape")
    return tuple(build[1:]) if build else None


def fix_input_size(config, input_size):
    """Set the free height and width of the model's input (where ``input_shape`` reads it)."""
    height, width = input_size

    def fixed(shape):
        return [shape[0], height, width] + list(shape[3:]) if shape and len(shape) == 4 else shape

    layers = _layers(config)
    for layer in layers:
        if layer.get("class_name") == "InputLayer":
            cfg = layer["config"]
            for key in ("batch_shape", "batch_input_shape"):
                if cfg.get(key):
                    cfg[key] = fixed(cfg[key])
            return
    if layers:
        cfg = layers[0].get("config", {})
        for key in ("batch_input_shape", "batch_shape"):
            if cfg.get(key):
                cfg[key] = fixed(cfg[key])
                return
    inner = config.get("config") or {}
    if inner.get("build_input_shape"):
        inner["build_input_shape"] = fixed(inner["build_input_shape"])
    if (config.get("build_config") or {}).get("input_shape"):
        config["build_config"]["input_shape"] = fixed(config["build_config"]["input_shape"])


def _output_layer(config):
    """The layer config producing the model output (recursing into a nested model)."""
    inner = config.get("config") or {}
    layers = inner.get("layers") or []
    if config.get("class_name") == "Sequential":
        last = layers[-1]
    else:
        outs = inner.get("output_layers")
        if outs and isinstance(outs[0], str):  # keras 3 single output: ["name", 0, 0]
            outs = [outs]
        if len(outs) != 1:
            raise ValueError("model has {} outputs; need exactly one".format(len(outs)))
        name = outs[0][0]
        last = [layer for layer in layers if layer.get("config", {}).get("name") == name or
                layer.get("name") == name][0]
    if last.get("class_name") in MODEL_CLASSES:
        return _output_layer(last)
    return last


def _dtype_name(value):
    if isinstance(value, dict):
        return (value.get("config") or {}).get("name")
    return value


def output_convention(config):
    """('softmax'|'sigmoid'|'logits'|'other:<act>', units, last layer name, its dtype)."""
    last = _output_layer(config)
    cfg = last.get("config", {})
    cls = last.get("class_name")
    dtype = _dtype_name(cfg.get("dtype"))
    if cls == "Softmax":
        kind = "softmax"
    elif cls in ("Activation", "Dense"):
        act = cfg.get("activation", "linear")
        if isinstance(act, dict):
            act = act.get("config")
        kind = {"softmax": "softmax", "sigmoid": "sigmoid", "linear": "logits",
                None: "logits"}.get(act, "other:{}".format(act))
    else:
        kind = "other:{}".format(cls)
    return kind, cfg.get("units"), cfg.get("name"), dtype


def num_classes(config):
    """The class count: the last Dense's units or the last convolution's filters.

    Walking back from the output; a convolutional head is Keras's MobileNetV3's (a 1x1 Conv2D,
    Flatten, softmax).
    """
    kind, units, _, _ = output_convention(config)
    if units:
        return units
    layers = _flat_layers(config)
    for layer in reversed(layers):
        if layer.get("class_name") == "Dense":
            return layer["config"]["units"]
        if layer.get("class_name") in CLASS_CONVOLUTIONS:
            return layer["config"].get("filters")
    return None


def _flat_layers(config):
    out = []
    for layer in _layers(config):
        if layer.get("class_name") in MODEL_CLASSES:
            out.extend(_flat_layers(layer))
        else:
            out.append(layer)
    return out


def nested_models(config):
    """(name, class) of each model nested directly in this one."""
    return [(layer["config"]["name"], layer["class_name"]) for layer in _layers(config)
            if layer.get("class_name") in MODEL_CLASSES]


def without_augmentation(config):
    """A copy of ``config`` with every random augmentation layer an identity ``Activation``.

    Those layers change nothing at inference; in odtd's training steps they would augment a
    second time. The name, dtype and any input shape the layer carried are kept, so the
    model's graph and its weights' places are as in the file (the layers hold no weights).
    """
    if isinstance(config, list):
        return [without_augmentation(item) for item in config]
    if not isinstance(config, dict):
        return config
    out = dict((key, without_augmentation(value)) for key, value in config.items())
    if out.get("class_name") in AUGMENTATION_LAYERS and isinstance(out.get("config"), dict):
        kept = ("name", "trainable", "dtype", "batch_input_shape", "batch_shape", "input_shape")
        out["class_name"] = "Activation"
        out["config"] = dict((key, value) for key, value in out["config"].items() if key in kept)
        out["config"]["activation"] = "linear"
        if "registered_name" in out:
            out["registered_name"] = None
    return out


def _rescales_input(config):
    """Whether the model's first layer past input preprocessing scales the pixels itself."""
    for layer in _flat_layers(config):
        name = layer.get("class_name")
        if name != "InputLayer" and name not in INPUT_PREPROCESSING:
            return name in INPUT_SCALERS
    return False


def model_summary(config):
    """What odtd needs to know of a model: dialect, input shape, classes, output convention."""
    kind, units, last, dtype = output_convention(config)
    return {"dialect": dialect(config), "input_shape": input_shape(config),
            "rescales_input": _rescales_input(config),
            "classes": num_classes(config), "output": kind, "output_layer": last,
            "output_dtype": dtype, "nested_models": nested_models(config),
            "layers": len(_flat_layers(config))}
