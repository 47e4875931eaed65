"""A model file's plain tensor arithmetic, rewritten as the built-in Keras layers it amounts to.

Code that does arithmetic on Keras tensors (``x + 3.0``, ``x * (1.0 / 6.0)``, ``inputs / 255.0``,
``x * y``) is not held in a layer: Keras 3 writes it as an operation node (``keras.src.ops.numpy``
``Add``, ``Multiply``, ``TrueDivide``, ...), tf.keras 2 as a ``TFOpLambda`` naming a TensorFlow
function (``__operators__.add``, ``math.multiply``). Keras's own ``MobileNetV3Small`` and
``MobileNetV3Large`` are built this way (their hard sigmoid is ``relu6(x + 3) * (1 / 6)``), and so
is a model that scales its pixels with ``inputs / 255.0``. Such a node names code rather than a
layer, so ``model_file.screen`` refuses it; the ones below are rewritten first, in the file's
own dialect, into layers that compute the same thing:

- a tensor and a number: ``Rescaling(scale, offset)``, which computes ``x * scale + offset``
  (``x + c``, ``c + x``, ``x - c``, ``c - x``, ``x * c``, ``c * x``, ``x / c``, ``-x``);
- two tensors: the merge layers ``Add``, ``Subtract`` and ``Multiply``.

The layer keeps the node's name, so every reference to it (and the weights' places) stays as
in the file; none of these hold weights. Anything else (``c / x``, ``x / y``, another function,
an array constant) is left as it is, for the screen to refuse with its name.

    as_layers(config) -> (config, count)   a rewritten copy and how many nodes were rewritten

Standard library only; Python 3.6-compatible.
"""

# Keras 3 operation node class -> the merge layer it is between two tensors (None: not one)
_KERAS3_OPS = {
    "Add": "Add", "Subtract": "Subtract", "Multiply": "Multiply",
    "TrueDivide": None, "Divide": None, "Negative": None,
}
# tf.keras 2 TFOpLambda function -> the same operation's Keras 3 name
_KERAS2_FUNCTIONS = {
    "__operators__.add": "Add", "math.add": "Add",
    "math.subtract": "Subtract", "__operators__.sub": "Subtract",
    "math.multiply": "Multiply", "__operators__.mul": "Multiply",
    "math.truediv": "TrueDivide", "math.divide": "TrueDivide",
    "__operators__.truediv": "TrueDivide",
    "math.negative": "Negative", "__operators__.neg": "Negative",
}


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rescaling_of(op, operands):
    """``(scale, offset)`` of ``op`` applied to ``operands`` (one ``"x"``, the rest numbers).

    None when the operation is not ``x * scale + offset`` (``c / x``) or divides by zero.
    """
    if op == "Negative":
        return (-1.0, 0.0) if operands == ["x"] else None
    if len(operands) != 2 or operands.count("x") != 1:
        return None
    tensor_first = operands[0] == "x"
    constant = float(operands[1] if tensor_first else operands[0])
    if op == "Add":
        return 1.0, constant
    if op == "Multiply":
        return constant, 0.0
    if op == "Subtract":
        return (1.0, -constant) if tensor_first else (-1.0, constant)
    if op in ("TrueDivide", "Divide") and tensor_first and constant != 0.0:
        return 1.0 / constant, 0.0
    return None


# ----- Keras 3: {"class_name": "Add", "config": {"name"}, "inbound_nodes": [{"args": [...]}]}
def _is_tensor3(value):
    return isinstance(value, dict) and value.get("class_name") == "__keras_tensor__"


def _keras3_layer(node):
    """The layer for a Keras 3 operation node, or None to leave the node as it is."""
    op = node.get("class_name")
    module = node.get("module")
    inner = node.get("config")
    inbound = node.get("inbound_nodes")
    if op not in _KERAS3_OPS or not isinstance(inner, dict) or "trainable" in inner:
        return None  # a real layer (every layer's config has "trainable"), or not arithmetic
    if module is not None and module != "keras.src.ops.numpy":
        return None
    if not (isinstance(inbound, list) and len(inbound) == 1 and isinstance(inbound[0], dict)):
        return None
    args, kwargs = inbound[0].get("args"), inbound[0].get("kwargs") or {}
    if not isinstance(args, list) or kwargs:
        return None
    name = inner.get("name")
    tensors = [arg for arg in args if _is_tensor3(arg)]
    if len(tensors) == 2 and len(args) == 2 and _KERAS3_OPS[op] is not None:
        class_name, layer_config, layer_args = _KERAS3_OPS[op], {}, [tensors]
    elif len(tensors) == 1 and all(_is_tensor3(arg) or _number(arg) for arg in args):
        scaling = rescaling_of(op, ["x" if _is_tensor3(arg) else arg for arg in args])
        if scaling is None:
            return None
        class_name, layer_args = "Rescaling", tensors
        layer_config = {"scale": scaling[0], "offset": scaling[1]}
    else:
        return None
    layer = dict(node)
    layer["class_name"] = class_name
    layer["config"] = dict(layer_config, name=name, trainable=True)
    layer["inbound_nodes"] = [{"args": layer_args, "kwargs": {}}]
    if module is not None:
        layer["module"] = "keras.layers"
        layer["registered_name"] = None
    return layer


# ----- tf.keras 2: {"class_name": "TFOpLambda", "config": {"function"}, "inbound_nodes":
#       [[layer, node, tensor, {"y": 3.0, "name": null}]]}; a number first is
#       ["_CONSTANT_VALUE", -1, 3.0, {"y": [layer, node, tensor]}]
_CONSTANT = "_CONSTANT_VALUE"


def _is_tensor2(value):
    return (isinstance(value, list) and len(value) in (3, 4) and isinstance(value[0], str)
            and value[0] != _CONSTANT and isinstance(value[1], int)
            and isinstance(value[2], int) and not isinstance(value[2], bool))


def _keras2_layer(node):
    """The layer for a tf.keras 2 TFOpLambda, or None to leave it as it is."""
    inner = node.get("config")
    inbound = node.get("inbound_nodes")
    if node.get("class_name") != "TFOpLambda" or not isinstance(inner, dict):
        return None
    op = _KERAS2_FUNCTIONS.get(inner.get("function"))
    if op is None or not (isinstance(inbound, list) and len(inbound) == 1
                          and isinstance(inbound[0], list) and len(inbound[0]) == 4
                          and isinstance(inbound[0][3], dict)):
        return None
    first, kwargs = inbound[0][:3], dict(inbound[0][3])
    kwargs.pop("name", None)
    other = kwargs.pop("y", None)
    if kwargs:
        return None
    if first[0] == _CONSTANT and first[1] == -1:
        operands = [first[2], "x" if _is_tensor2(other) else other]
        tensors = [other]
    else:
        operands = ["x"] + ([] if op == "Negative" else ["x" if _is_tensor2(other) else other])
        tensors = [first] + ([other] if _is_tensor2(other) else [])
    if not all(_is_tensor2(tensor) for tensor in tensors) or not all(
            operand == "x" or _number(operand) for operand in operands):
        return None
    if len(tensors) == 2 and _KERAS3_OPS[op] is not None:
        class_name, layer_config = _KERAS3_OPS[op], {}
    elif len(tensors) == 1:
        scaling = rescaling_of(op, operands)
        if scaling is None:
            return None
        class_name, layer_config = "Rescaling", {"scale": scaling[0], "offset": scaling[1]}
    else:
        return None
    layer = dict(node)
    layer["class_name"] = class_name
    layer["config"] = dict(layer_config, name=inner.get("name"), trainable=True,
                           dtype=inner.get("dtype", "float32"))
    layer["inbound_nodes"] = [[[tensor[0], tensor[1], tensor[2], {}] for tensor in tensors]]
    if "module" in node:  # the .keras format of tf.keras >= 2.13
        layer["module"] = "keras.layers"
        layer["registered_name"] = None
        layer.pop("build_config", None)  # the op's input shape; these layers hold no weights
    return layer


def as_layers(config):
    """A copy of ``config`` with each rewritable arithmetic node a layer; and their count."""
    count = [0]

    def walk(obj):
        if isinstance(obj, list):
            return [walk(item) for item in obj]
        if not isinstance(obj, dict):
            return obj
        layer = None
        if "inbound_nodes" in obj:
            layer = _keras3_layer(obj) or _keras2_layer(obj)
        if layer is not None:
            count[0] += 1
            return layer
        return dict((key, walk(value)) for key, value in obj.items())

    return walk(config), count[0]
