"""A user's Keras model file, read and screened without deserializing anything in it.

``odtctl init --model-file`` brings a classifier trained elsewhere: a ``.keras`` archive (Keras 3,
or tf.keras >= 2.13) or an ``.h5`` file (any tf.keras 2 and Keras 3). Loading such a file the
usual way can run code stored in it: a ``Lambda`` layer's marshalled bytecode, a custom class,
a function named by module path. tf.keras 2.15 runs an ``.h5`` file's Lambda even with
``safe_mode=True``, TF 2.7 (a TX2's) has no safe mode at all, and Keras 3 before 3.11 had
safe-mode bypasses (CVE-2025-1550, CVE-2025-9905, CVE-2025-9906). So the file's configuration is
read as JSON here and screened against an allowlist of built-in Keras layers and objects; only a
configuration that passes is ever built (``imported``), and its weights are copied with h5py.
``load_model`` is never called on the user's file.

    read_config(path)   -> {"format", "keras_version", "config", "arithmetic_layers"}
                           (raises ModelFileError; tensor arithmetic such as ``x + 3.0`` comes
                           back as the built-in layers it amounts to: ``arithmetic``)
    screen(config)      -> a Refusal (layer name, reason) for each refused construct

What the screened configuration says (input shape, classes, output convention) is read by
``model_config``.

Standard library only (h5py, which every TensorFlow install has, for ``.h5``); Python
3.6-compatible.
"""
import json
import os
import zipfile
from typing import NamedTuple, Optional

from odtd.trainer.modelfile import arithmetic, keras_dialects
from odtd.trainer.modelfile.model_config import (
    AUGMENTATION_LAYERS,
    MODEL_CLASSES,
    fix_input_size,
    input_shape,
    model_summary,
)

# Classes a model file may name. Anything else (a Lambda, TFOpLambda, a custom or registered
# class, a Keras-3 operation node, a function by module path) is refused, except the plain
# arithmetic ``read_config`` has already rewritten as layers.
SAFE_LAYERS = frozenset("""
InputLayer Conv1D Conv2D DepthwiseConv2D SeparableConv2D Conv2DTranspose Dense EinsumDense
BatchNormalization LayerNormalization GroupNormalization UnitNormalization
Activation ReLU LeakyReLU PReLU ELU Softmax
Add Subtract Multiply Average Maximum Minimum Concatenate Dot
GlobalAveragePooling1D GlobalAveragePooling2D GlobalMaxPooling1D GlobalMaxPooling2D
MaxPooling1D MaxPooling2D AveragePooling1D AveragePooling2D
Dropout SpatialDropout1D SpatialDropout2D GaussianNoise GaussianDropout AlphaDropout
Flatten Reshape Permute RepeatVector ZeroPadding1D ZeroPadding2D Cropping1D Cropping2D
UpSampling1D UpSampling2D Identity
Rescaling Normalization Resizing CenterCrop
Functional Sequential Model
""".split())
SAFE_LAYERS = SAFE_LAYERS | AUGMENTATION_LAYERS
SAFE_OBJECTS = frozenset("""
GlorotUniform GlorotNormal HeNormal HeUniform LecunNormal LecunUniform Zeros Ones Constant
RandomNormal RandomUniform TruncatedNormal VarianceScaling Orthogonal Identity
L1 L2 L1L2 OrthogonalRegularizer
MaxNorm MinMaxNorm NonNeg UnitNorm RadialConstraint
DTypePolicy FloatDTypePolicy Policy
__keras_tensor__ __tuple__ __numpy__
""".split())
SAFE_ACTIVATIONS = frozenset("""
linear relu relu6 sigmoid softmax log_softmax tanh elu selu gelu swish silu hard_sigmoid
hard_silu hard_swish softplus softsign exponential leaky_relu mish
""".split())
KERAS_ZIP_MEMBERS = ("config.json", "metadata.json")


class ModelFileError(Exception):
    """The file is missing, unreadable, truncated, not a Keras model, or refused by the screen."""


def read_config(path):
    """Return {"format", "keras_version", "config", "arithmetic_layers"} of a model file.

    ``format`` is "keras" or "h5"; ``config`` has the file's plain tensor arithmetic as layers,
    and ``arithmetic_layers`` says how many such nodes there were (``arithmetic.as_layers``).
    """
    if not os.path.exists(path):
        raise ModelFileError("no such file: {}".format(path))
    with open(path, "rb") as handle:
        head = handle.read(8)
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
                if "config.json" not in names:
                    raise ModelFileError("{}: a zip without config.json, not a .keras model "
                                         "(has {})".format(path, ", ".join(names[:5])))
                bad = archive.testzip()  # CRC of every member: catches a damaged archive
                if bad is not None:
                    raise ModelFileError("{}: corrupt member {}".format(path, bad))
                if "model.weights.h5" not in names:
                    raise ModelFileError("{}: .keras archive without model.weights.h5".format(
                        path))
                config = json.loads(archive.read("config.json").decode("utf-8"))
                meta = {}
                if "metadata.json" in names:
                    meta = json.loads(archive.read("metadata.json").decode("utf-8"))
        except zipfile.BadZipFile as error:
            raise ModelFileError("{}: corrupt or truncated zip ({})".format(path, error)) from None
        except ValueError as error:  # json
            raise ModelFileError("{}: config.json is not JSON ({})".format(path, error)) from None
        if isinstance(config, dict):
            # How the server compiled it (optimizer, loss, metrics): odtd trains with its own.
            config.pop("compile_config", None)
        return _in_built_in_terms(
            {"format": "keras", "keras_version": meta.get("keras_version"), "config": config})
    if head == b"\x89HDF\r\n\x1a\n":
        try:
            import h5py  # comes with TensorFlow; the daemon's interpreter may lack it
        except ImportError:
            raise ModelFileError("{}: reading .h5 needs h5py (pip install h5py)".format(path)) from None
        try:
            with h5py.File(path, "r") as handle:
                raw = handle.attrs.get("model_config")
                version = handle.attrs.get("keras_version")
                has_weights = "model_weights" in handle
        except (OSError, IOError) as error:
            raise ModelFileError("{}: unreadable HDF5 ({})".format(path, str(error)[:120])) from None
        if raw is None:
            raise ModelFileError("{}: HDF5 without model_config: not a saved Keras model "
                                 "(a weights-only file?)".format(path))
        if not has_weights:
            raise ModelFileError("{}: HDF5 model without model_weights".format(path))
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        if isinstance(version, bytes):
            version = version.decode("utf-8")
        try:
            config = json.loads(raw)
        except ValueError as error:
            raise ModelFileError("{}: model_config is not JSON ({})".format(path, error)) from None
        return _in_built_in_terms({"format": "h5", "keras_version": version, "config": config})
    raise ModelFileError("{}: neither a .keras zip nor an HDF5 file".format(path))


def _in_built_in_terms(info):
    """``info`` with the config's tensor arithmetic (``x + 3.0``) as built-in layers, counted.

    TensorFlow's own initializers are named as the Keras ones they equal, too
    (``keras_dialects.tf_initializers_as_keras``).
    """
    info["config"], info["arithmetic_layers"] = arithmetic.as_layers(info["config"])
    keras_dialects.tf_initializers_as_keras(info["config"])
    return info


def _class_name(obj):
    name = obj.get("class_name")
    return name if isinstance(name, str) else None


class Refusal(NamedTuple):
    """A construct ``screen`` refuses.

    Attributes:
        layer: The name of the layer it is in (None: outside any named layer).
        reason: What it is, in a few words (``Lambda layer (runs Python code from the file)``).
    """

    layer: Optional[str]
    reason: str


def screen(config):
    """Yield a ``Refusal`` for every construct that is not plain built-in Keras.

    The configuration is walked as JSON: a Keras object (a dict with a ``class_name``) is
    judged by its class, module and registered name (``_function_refusal``, ``_code_refusal``,
    ``_class_refusal``) and, if it passes, its fields are walked in turn; any other dict's
    fields are judged by ``_field_refusals`` (activations named as strings, ``function``
    fields).
    """
    return _visit(config, None)


def _visit(obj, layer):
    """The refusals in ``obj`` (any JSON value), found inside the layer named ``layer``."""
    if isinstance(obj, list):
        for item in obj:
            yield from _visit(item, layer)
    elif isinstance(obj, dict):
        if _class_name(obj) is None:
            yield from _field_refusals(obj, layer)
        else:
            yield from _object_refusals(obj, layer)


def _object_refusals(obj, layer):
    """A Keras object's refusal, or, when it passes, those of what it contains."""
    if _class_name(obj) == "function":  # a function by name: nothing inside to walk
        refusal = _function_refusal(obj, layer)
        if refusal is not None:
            yield refusal
        return
    here = _layer_name(obj, layer)
    refusal = _code_refusal(obj, layer, here) or _class_refusal(obj, here)
    if refusal is not None:
        yield refusal
        return
    for key, value in obj.items():
        if key not in ("class_name", "module", "registered_name"):
            yield from _visit(value, here)


def _layer_name(obj, layer):
    """The layer a Keras object's contents are in: its own name if it is a layer, else ``layer``."""
    cls = _class_name(obj)
    inner = obj.get("config")
    if isinstance(inner, dict) and isinstance(inner.get("name"), str) and (
            cls in SAFE_LAYERS or "inbound_nodes" in obj or cls not in SAFE_OBJECTS):
        return inner["name"]
    return layer


def _function_refusal(obj, layer):
    """Refuse a function named by module unless it is a built-in Keras activation."""
    module = obj.get("module")
    inner = obj.get("config")
    if isinstance(module, str) and module.startswith("keras") and inner in SAFE_ACTIVATIONS:
        return None
    return Refusal(layer, "custom function {}.{}".format(module, inner))


def _code_refusal(obj, layer, here):
    """Refuse a Keras object that is code: a Lambda, a TensorFlow op by name, serialized Python."""
    cls = _class_name(obj)
    inner = obj.get("config")
    if cls == "Lambda":
        return Refusal(here, "Lambda layer (runs Python code from the file)")
    if cls in ("TFOpLambda", "SlicingOpLambda"):
        return Refusal(here, "{} layer (a TensorFlow function called by name: {})".format(
            cls, (inner or {}).get("function")))
    if cls in ("__lambda__", "__python_function__") or cls.startswith("__") and (
            cls not in SAFE_OBJECTS):
        return Refusal(layer, "serialized Python code ({})".format(cls))
    return None


def _class_refusal(obj, here):
    """Refuse a Keras object whose class is not a built-in on the allowlist."""
    cls = _class_name(obj)
    module = obj.get("module")
    registered = obj.get("registered_name")
    inner = obj.get("config")
    if ">" in cls or (registered and registered not in (cls, None)):
        return Refusal(here, "custom class {}".format(registered or cls))
    if module is not None and not (module == "keras" or module.startswith("keras.")):
        return Refusal(here, "class {} from module {}".format(cls, module))
    if isinstance(module, str) and module.startswith("keras.src.ops"):
        return Refusal(here, "operation node {} (a tensor op outside a layer)".format(cls))
    if ("inbound_nodes" in obj and isinstance(inner, dict) and cls != "InputLayer"
            and cls not in MODEL_CLASSES and "trainable" not in inner and "dtype" not in inner):
        # Keras 3 writes a bare tensor op (x * 2.0) as {"class_name": "Multiply",
        # "config": {"name": ...}}: in .h5 without a module, so it looks like the
        # Multiply layer. A real layer's config has "dtype" (Keras 3's SpatialDropout2D
        # has no "trainable") and nearly always "trainable"; an op's has neither.
        return Refusal(here, "operation node {} (a tensor op outside a layer)".format(cls))
    if cls not in SAFE_LAYERS and cls not in SAFE_OBJECTS:
        if module is None and obj.get("module", 1) is None:
            return Refusal(here, "custom class {}".format(registered or cls))
        return Refusal(here, "class {} not on the allowlist".format(cls))
    return None


def _field_refusals(obj, layer):
    """The refusals among a plain dict's fields: non-built-in activations, ``function`` fields."""
    for key, value in obj.items():
        if key in ("activation", "recurrent_activation") and isinstance(value, str):
            if value not in SAFE_ACTIVATIONS:
                yield Refusal(layer, "activation {!r} is not a built-in".format(value))
        elif key == "function":
            yield Refusal(layer, "a 'function' field (code or a function name)")
        else:
            yield from _visit(value, layer)


def read_screened(path, input_size=None):
    """Read a model file and check it is a single-input image classifier odtd can train.

    ``input_size`` ``(height, width)`` fixes the size of a model whose input has none
    (``keras.Input((None, None, 3))``, a fully convolutional classifier): the configuration
    returned is built at that size.

    Returns:
        ``(info, summary)``: ``read_config``'s result and ``model_summary``'s.

    Raises:
        ModelFileError: one line naming the file, and the layer where one is at fault: an
            unreadable file, a construct that would run code (Lambda, custom classes or
            functions), an input that is not an image (rank, channels 1 or 3, fixed height
            and width), or an output that is neither softmax probabilities nor logits.
    """
    info = read_config(path)
    config = info["config"]
    if _class_name(config) not in MODEL_CLASSES:
        raise ModelFileError("{}: the top-level object is {!r}, not a Keras Functional or "
                             "Sequential model".format(path, _class_name(config)))
    for refusal in screen(config):
        raise ModelFileError(
            "{}: layer {!r}: {}; code in a model file is not loaded: rebuild the model from "
            "built-in Keras layers and save it again".format(path, refusal.layer, refusal.reason))
    try:
        if input_size is not None:
            _size_input(path, config, input_size)
        summary = model_summary(config)
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise ModelFileError("{}: cannot read the model's input and output ({})".format(
            path, error)) from None
    shape = summary["input_shape"]
    if shape is None or len(shape) != 3 or shape[2] not in (1, 3):
        raise ModelFileError("{}: input shape {} is not an image: odtd trains models whose "
                             "input is (height, width, channels) with 1 or 3 channels".format(
                                 path, None if shape is None else list(shape)))
    if shape[0] is None or shape[1] is None:
        raise ModelFileError("{}: input shape {} has no fixed height and width; give the size "
                             "the model was trained at with --input-size HxW (or build it with "
                             "keras.Input(shape=(height, width, {})) and save it again)".format(
                                 path, list(shape), shape[2]))
    if summary["output"] not in ("softmax", "logits"):
        raise ModelFileError("{}: the last layer {!r} outputs {}; odtd trains classifiers "
                             "ending in softmax probabilities or logits".format(
                                 path, summary["output_layer"], summary["output"]))
    return info, summary


def _size_input(path, config, input_size):
    """Build an image input's free height and width at ``input_size``; refuse another size."""
    shape = input_shape(config)
    if shape is None or len(shape) != 3:
        return  # not an image: read_screened says so
    if any(size not in (None, given) for size, given in zip(shape[:2], input_size)):
        raise ModelFileError("{}: --input-size {}x{}: the model's input is fixed at {}; leave "
                             "--input-size out".format(
                                 path, input_size[0], input_size[1],
                                 "x".join("?" if size is None else str(size)
                                          for size in shape[:2])))
    fix_input_size(config, input_size)
