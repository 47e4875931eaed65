"""A functional Keras model's graph: who consumes each tensor, where the model can be cut.

``consumers`` maps each tensor to the layers that read it, for a model whose layers are each
called once (``dense_blocks`` walks dense blocks with it); ``valid_cuts`` lists the layers whose
output is all the rest of the model needs of the layers before (``recompute`` cuts segments
there, ``pool_first`` runs a pair of layers apart there); ``nested_chain`` says whether the model
is a chain around nested models, which both then take layer by layer. All read the model's own
nodes: a layer's nodes in other graphs, such as sub-models built over it, do not count.
``part_runner`` is how both run a part (a sub-model, a layer).

Python 3.6-compatible; tf.keras 2 and Keras 3 alike (TensorFlow passed in where needed).
"""

from typing import Any, Callable, Dict, List, Optional


def producer(tensor: Any) -> Any:
    """The layer that made a symbolic tensor of the model's graph."""
    return tensor._keras_history[0]


def inputs_of(layer: Any) -> List[Any]:
    """A layer's input tensors in its (single) call."""
    value = layer.input
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _own_nodes(model: Any) -> set:
    """The nodes of ``model``'s own graph (both Keras stacks keep ``_nodes_by_depth``)."""
    return {id(node) for nodes in getattr(model, "_nodes_by_depth", {}).values() for node in nodes}


def _owner(node: Any) -> Any:
    """The layer that made a node (Keras 3: ``operation``; tf.keras 2: ``layer``)."""
    return getattr(node, "operation", None) or getattr(node, "layer", None)


def sub_model(tf: Any, start: Any, end: Any) -> Any:
    """The part of a model's graph from tensor ``start`` to tensor ``end``, as a model.

    ``keras.Model(start, end)``, its layers the model's own (their weights shared). tf.keras 2.6
    builds a model only from ``keras.Input`` tensors (2.7 clones the nodes between intermediate
    ones: keras/engine/functional_utils.py); there the layers from ``start`` to ``end`` are
    called again, in the order of the graph, on a new Input of ``start``'s shape. Each such call
    adds a node to a layer, outside the model's own graph (``_own_nodes``), which nothing here
    counts.
    """
    keras = tf.keras
    if producer(start).__class__.__name__ == "InputLayer" or not _tf_keras_26(tf):
        return keras.Model(start, end)
    inputs = keras.Input(shape=tuple(start.shape[1:]), dtype=start.dtype)
    return keras.Model(inputs, _called_again(tf, start, end, inputs, flatten=False))


def flattened(tf: Any, model: Any) -> Any:
    """tf.keras 2: ``model`` as one flat graph, its nested models' layers called in it.

    What an ``.h5`` export writes, so Keras 3 opens it too: Keras 3 cannot resolve tf.keras 2's
    reference to a nested model's call (inbound node index 1) in an ``.h5`` ("Invalid
    Functional model configuration ... failed to be resolved"; the nested Sequential of a
    user's model, the network inside a built-in network's export). The layers, and so the
    weights, are the model's own; a model of several inputs or outputs, or whose flat graph
    would repeat a layer name, is returned as it is.
    """
    keras = tf.keras
    if len(model.inputs) != 1 or len(model.outputs) != 1 or not any(
            isinstance(layer, keras.Model) for layer in model.layers):
        return model
    start = model.inputs[0]
    inputs = keras.Input(shape=tuple(start.shape[1:]), dtype=start.dtype,
                         name=producer(start).name)
    try:
        return keras.Model(inputs, _called_again(tf, start, model.outputs[0], inputs, True),
                           name=model.name)
    except ValueError:  # "All layer names should be unique": nested names that collide
        return model


def _called_again(tf: Any, start: Any, end: Any, tensor: Any, flatten: bool) -> Any:
    """``end`` computed from ``tensor`` in place of ``start``.

    tf.keras 2's layers between them are called again in the graph's order; with ``flatten``, a
    nested model's layers one by one.
    """
    keras = tf.keras
    mapping = {id(start): tensor}

    def mapped(value: Any) -> Any:
        return mapping[id(value)] if hasattr(value, "_keras_history") else value

    for node in _nodes_between(start, end):
        args = tf.nest.map_structure(mapped, node.call_args)
        kwargs = tf.nest.map_structure(mapped, node.call_kwargs)
        layer = node.layer
        if flatten and isinstance(layer, keras.Model) and len(layer.inputs) == 1 \
                and len(layer.outputs) == 1:
            outputs = _called_again(tf, layer.inputs[0], layer.outputs[0],
                                    tf.nest.flatten(args)[0], True)
        else:
            outputs = layer(*args, **kwargs)
        for old, new in zip(tf.nest.flatten(node.outputs), tf.nest.flatten(outputs)):
            mapping[id(old)] = new
    return mapping[id(end)]


def _tf_keras_26(tf: Any) -> bool:
    major, minor = tf.__version__.split(".")[:2]
    return (int(major), int(minor)) < (2, 7)


def _nodes_between(start: Any, end: Any) -> List[Any]:
    """tf.keras 2's nodes that compute ``end`` from ``start``, each after those it reads."""
    order = []  # type: List[Any]
    seen = set()  # type: set
    stack = [(end, False)]
    while stack:
        tensor, expanded = stack.pop()
        if tensor is start:
            continue
        layer, node_index, _ = tensor._keras_history
        node = layer._inbound_nodes[node_index]
        if expanded:
            if id(node) not in seen:
                seen.add(id(node))
                order.append(node)
            continue
        if id(node) in seen:
            continue
        if layer.__class__.__name__ == "InputLayer":
            raise ValueError("{} does not lead back to {}".format(end.name, start.name))
        stack.append((tensor, True))
        stack.extend((parent, False) for parent in node.keras_inputs)
    return order


def part_runner(part: Any) -> Callable[..., Any]:
    """``(tensor, training=True) -> part(tensor, training=training)``: a sub-model or a layer."""
    def run(tensor: Any, training: bool = True) -> Any:
        return part(tensor, training=training)
    return run


def consumers(model: Any) -> Optional[Dict[int, List[Any]]]:
    """Per tensor (by id) its consumers, for a model whose layers are each called once.

    None when a layer is called more than once (a shared layer: its input and output are not
    one tensor each).
    """
    own = _own_nodes(model)
    found = {}  # type: Dict[int, List[Any]]
    for layer in model.layers:
        nodes = [node for node in getattr(layer, "_inbound_nodes", []) if id(node) in own]
        if len(nodes) > 1:
            return None
        if not nodes or layer.__class__.__name__ == "InputLayer":
            continue
        for tensor in inputs_of(layer):
            found.setdefault(id(tensor), []).append(layer)
    return found


def valid_cuts(model: Any) -> List[int]:
    """Indices k of ``model.layers`` whose output is all that layers after k need of layers up to k.

    A cut after layer k is valid when every edge from a layer at or before k to a layer after k
    starts at layer k itself, and layer k has one output and is called once.
    """
    layers = list(model.layers)
    index = {id(layer): position for position, layer in enumerate(layers)}
    own = _own_nodes(model)
    violated = [0] * (len(layers) + 1)
    called_once = []
    for position, layer in enumerate(layers):
        nodes = [node for node in getattr(layer, "_inbound_nodes", [])
                 if (not own or id(node) in own)
                 and any(id(_owner(parent)) in index for parent in getattr(node, "parent_nodes", []))]
        called_once.append(len(nodes) <= 1)
        for node in nodes:
            for parent in node.parent_nodes:
                start = index.get(id(_owner(parent)))
                if start is None:
                    continue
                # This edge spans cuts start..position-1; all but the one at `start` break.
                if start + 1 <= position - 1:
                    violated[start + 1] += 1
                    violated[position] -= 1
    cuts, running = [], 0
    for k in range(len(layers) - 1):
        running += violated[k]
        single = not isinstance(getattr(layers[k], "output", None), (list, tuple))
        if k >= 1 and running == 0 and called_once[k] and single:
            cuts.append(k)
    return cuts


def nested_chain(tf: Any, model: Any, cuts: List[int]) -> Optional[List[Any]]:
    """The layers after the input when ``model`` is a chain of layers around nested models.

    An exported model (rescaling and softmax around its network) or a backbone in a wrapper: a
    nested model's output is not a tensor of this graph, so whatever runs the model in parts
    takes such a chain layer by layer and each nested model inside itself. ``cuts``:
    ``valid_cuts(model)``. None for any other model.
    """
    layers = list(model.layers)
    if any(isinstance(layer, tf.keras.Model) for layer in layers) \
            and cuts == list(range(1, len(layers) - 1)):
        return layers[1:]
    return None
