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
