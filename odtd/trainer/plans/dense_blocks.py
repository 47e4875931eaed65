"""Densely connected blocks trained in memory linear in their depth (memory-efficient DenseNet).

In a dense block each layer reads the concatenation of everything before it: layer l computes
``y_l = f_l(concat(x0, y_1, ..., y_l-1))`` (f: BatchNorm, ReLU, convolution; in a bottleneck
DenseNet two of those) and the block ends in ``concat(x0, y_1, ..., y_L)``. A training step
keeps, for every layer, its concatenated input and the BatchNorm and ReLU outputs of that
width: memory quadratic in the depth. Gradient checkpointing by segments cannot help much
there, because the tensors a segment starts from are those concatenations themselves.

``dense_block`` runs a block, and the layers after it up to the next tensor the rest of the
network depends on alone (a transition, or the classifier), as one function with its own
gradient, after Pleiss et al., "Memory-Efficient Implementation of DenseNets" (2017): the
forward pass keeps only ``x0`` and the narrow ``y_l``; the backward pass goes through the layers
last to first, rebuilds each layer's concatenated input, recomputes ``f_l`` on it and takes its
gradient, and carries one running gradient of the concatenation, narrowed layer by layer. The
recomputation waits for the gradient it serves (a control dependency), so one layer's
recomputed tensors are alive at a time. The cost is a forward pass of the block.

The layers with the largest inputs (``chunk_from``: in ``recompute.Checkpointed``, at least half
the model's largest) take their gradient a chunk of parts at a time where ``f_l`` starts per
channel and then mixes the channels linearly (BatchNorm, ReLU, convolution: every DenseNet;
``dense_chunks``), never over the whole concatenated input; while they do, the running gradient
is kept per part.

``find_blocks`` finds such blocks in any functional Keras model from its graph: the built-in
DenseNet-40, keras.applications' DenseNets, or a user's own, whichever side of the concatenation
the new features are on (``concat([x, f(x)])`` or ``concat([f(x), x])``, as a port from another
framework may write it; the order may change from layer to layer). A layer in a block or after it
must be called once, take one input, and feed only the next; nothing random (dropout, noise,
random augmentation layers: a recomputation would draw other numbers).

BatchNormalization layers in a block update their moving statistics again in the
recomputation; the caller (``recompute.Checkpointed``) puts back what the forward pass left.

TensorFlow is passed in. Python 3.6-compatible; tf.keras 2 and Keras 3 alike.
"""

from typing import Any, Callable, List, NamedTuple, Optional, Sequence

from odtd.trainer.models.graph import consumers as graph_consumers
from odtd.trainer.models.graph import inputs_of, producer
from odtd.trainer.plans.dense_chunks import accumulate, chunk_gradient, kept_after, split_head
from odtd.trainer.plans.pool_first import pool_first

# Layers that draw random numbers in training: a recomputation would not reproduce them.
RANDOM_LAYERS = ("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
                 "GaussianNoise", "GaussianDropout", "AlphaDropout")
MIN_LAYERS = 2  # a block of one layer keeps as much as the plain model
MAX_UNIT_LAYERS = 17  # longer single-input chains between concatenations are not a dense layer


class Block(NamedTuple):
    """A dense block found in a model's graph.

    Attributes:
        start: The tensor the block starts from (``x0``).
        units: Per dense layer, the layers of ``f_l`` in order.
        first: Per dense layer, whether its concatenation puts ``f_l``'s output first.
        tail: The single-input layers after the block's last concatenation, in order.
        end: The block's result: the tail's output, or the last concatenation without a tail.
        layers: Every layer of the block and its tail (for ``Checkpointed``'s BatchNorm list).
    """

    start: Any
    units: List[List[Any]]
    first: List[bool]
    tail: List[Any]
    end: Any
    layers: List[Any]


def _random(layer: Any) -> bool:
    name = layer.__class__.__name__
    return name in RANDOM_LAYERS or name.startswith("Random")


def find_blocks(tf: Any, model: Any) -> List[Block]:
    """The dense blocks of ``model`` (at least ``MIN_LAYERS`` layers each), input to output."""
    consumers = graph_consumers(model)
    if consumers is None:
        return []
    outputs = {id(tensor) for tensor in model.outputs}
    concatenate = tf.keras.layers.Concatenate

    def single_chain(start: Any, end: Any) -> Optional[List[Any]]:
        """The layers from ``start`` to ``end``, each with one input that feeds only it."""
        chain, tensor = [], end
        while tensor is not start:
            layer = producer(tensor)
            inputs = inputs_of(layer)
            if (len(inputs) != 1 or _random(layer) or isinstance(layer, concatenate)
                    or isinstance(layer, tf.keras.Model) or len(chain) >= MAX_UNIT_LAYERS):
                return None
            if inputs[0] is not start and len(consumers.get(id(inputs[0]), [])) != 1:
                return None
            chain.insert(0, layer)
            tensor = inputs[0]
        return chain or None

    # A link: concat([a, f(a)]) or concat([f(a), a]) on the last axis where a feeds exactly f's
    # first layer and the concatenation.
    links = {}  # type: Dict[int, Any]  # id(a) -> (concat layer, f's layers, f(a) first)
    for layer in model.layers:
        if not isinstance(layer, concatenate) or id(layer.output) in outputs:
            continue
        inputs = inputs_of(layer)
        rank = len(layer.output.shape)
        if len(inputs) != 2 or layer.axis not in (-1, rank - 1) or rank < 2:
            continue
        for first, (head, new) in ((False, inputs), (True, inputs[::-1])):
            chain = single_chain(head, new)
            if chain is not None and ({id(c) for c in consumers.get(id(head), [])}
                                      == {id(layer), id(chain[0])}):
                links[id(head)] = (layer, chain, first)
                break
    starts = set(links) - {id(link[0].output) for link in links.values()}
    blocks = []
    for layer in model.layers:  # in graph order, so the blocks come input to output
        tensor = layer.output
        if isinstance(tensor, (list, tuple)) or id(tensor) not in starts:
            continue
        units, first, current = [], [], tensor
        while id(current) in links:
            concat, chain, new_first = links[id(current)]
            units.append(chain)
            first.append(new_first)
            current = concat.output
        tail = []
        while id(current) not in outputs and len(consumers.get(id(current), [])) == 1:
            after = consumers[id(current)][0]
            if len(inputs_of(after)) != 1 or _random(after) or isinstance(after, tf.keras.Model):
                break
            tail.append(after)
            current = after.output
        if len(units) >= MIN_LAYERS:
            members = [part for unit in units for part in unit] + tail
            blocks.append(Block(tensor, units, first, tail, current, members))
    return blocks


def _run(layers: Sequence[Any], tensor: Any) -> Any:
    for layer in layers:
        tensor = layer(tensor, training=True)
    return tensor


def input_sizes(block: Block) -> List[Optional[int]]:
    """Per dense layer (the tail last), its input's values per sample (None: not static)."""
    spatial = 1  # type: Optional[int]
    for dim in block.start.shape[1:-1]:
        spatial = None if dim is None or spatial is None else spatial * int(dim)
    channels = [int(block.start.shape[-1])] + [int(unit[-1].output.shape[-1])
                                               for unit in block.units]
    return [None if spatial is None else spatial * sum(channels[:count + 1])
            for count in range(len(channels))]


def dense_block(tf: Any, block: Block, chunk_from: Optional[int] = None) -> Callable[[Any], Any]:
    """``x0 -> end``, computing what the block and its tail compute, with the lean gradient.

    Layers whose input has at least ``chunk_from`` values per sample (None: every layer) take
    their gradient a chunk of channels at a time where they can (``dense_chunks``).
    """
    units, tail = block.units, pool_first(block.tail)
    # Which parts (0: x0, l: layer l's output) each layer's input concatenates, in order; the
    # tail's last.
    orders = [[0]]
    for index, first in enumerate(block.first):
        orders.append([index + 1] + orders[-1] if first else orders[-1] + [index + 1])

    # Per layer (the tail last), its layers split for a gradient a chunk at a time, or None.
    heads = [split_head(layers) if chunk_from is None or size is None or size >= chunk_from
             else None for layers, size in zip(units + [tail], input_sizes(block))]

    @tf.custom_gradient
    def run(start: Any) -> Any:
        parts = [start]
        for unit, order in zip(units, orders):
            parts.append(_run(unit, tf.concat([parts[i] for i in order], -1)
                              if len(order) > 1 else start))
        end = _run(tail, tf.concat([parts[i] for i in orders[-1]], -1))

        def gradient(d_end: Any, variables: Optional[List[Any]] = None) -> Any:
            variables = list(variables or [])
            summed = [None] * len(variables)  # type: List[Any]
            # The running gradient: of the concatenation a layer reads (``d_joined``), or
            # per part while the layers are chunked (``d_parts``, ``d_joined`` None).
            d_parts = [None] * len(parts)  # type: List[Any]
            d_joined = None  # type: Any

            def whole(layers: Sequence[Any], order: Sequence[int], d_out: Any) -> Any:
                """Recompute ``layers`` on the parts in ``order`` once ``d_out`` exists."""
                kept = kept_after(tf, [parts[i] for i in order], [d_out])
                with tf.GradientTape() as tape:
                    joined = tf.concat(kept, -1) if len(kept) > 1 else kept[0]
                    tape.watch(joined)
                    out = _run(layers, joined)
                found = tape.gradient(out, [joined] + variables, output_gradients=d_out)
                accumulate(tf, summed, range(len(variables)), found[1:])
                return found[0]

            def chunked(head: Any, order: Sequence[int], d_out: Any) -> None:
                running = [d_parts[i] for i in order]
                chunk_gradient(tf, head, [parts[i] for i in order], running, summed, d_out,
                               variables, _run)
                for index, grad in zip(order, running):
                    d_parts[index] = grad

            if not tail:
                d_joined = d_end
            elif heads[-1] is not None:
                chunked(heads[-1], orders[-1], d_end)
            else:
                d_joined = whole(tail, orders[-1], d_end)
            for layer in reversed(range(len(units))):
                head, order = heads[layer], orders[layer]
                if d_joined is not None:  # split off the new part's gradient
                    width = int(parts[layer + 1].shape[-1])
                    if block.first[layer]:
                        d_new, d_rest = d_joined[..., :width], d_joined[..., width:]
                    else:
                        d_rest, d_new = d_joined[..., :-width], d_joined[..., -width:]
                    if head is not None:  # to per part
                        widths = [int(parts[i].shape[-1]) for i in order]
                        for index, grad in zip(order, tf.split(d_rest, widths, -1)):
                            d_parts[index] = grad
                        d_joined = None
                else:
                    d_new, d_parts[layer + 1] = d_parts[layer + 1], None
                    if head is None:  # back to the concatenation
                        kept = [d_parts[i] for i in order]
                        d_rest = tf.concat(kept, -1) if len(kept) > 1 else kept[0]
                if head is not None:
                    chunked(head, order, d_new)
                else:
                    d_joined = d_rest + whole(units[layer], order, d_new)
            return (d_parts[0] if d_joined is None else d_joined,
                    [tf.zeros_like(variable) if grad is None else grad
                     for variable, grad in zip(variables, summed)])

        return end, gradient

    return run
