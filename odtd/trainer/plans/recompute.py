"""Gradient checkpointing for any functional Keras model: keep a few activations, recompute the rest.

A training step keeps every layer's activations for the backward pass; at batch 64 they are most
of DenseNet40's memory. Here the model is cut into segments at tensors the rest of the graph
depends on alone (after a dense block's concatenation, a residual addition, a transition), and
each segment but the last runs under ``tf.recompute_grad``: only the segment boundaries are
kept, and a segment's activations are recomputed when its gradient is needed. The cost is one
more forward pass per step, less the last segment's: its activations are needed as soon as the
backward pass starts, so recomputing them would lower no peak, whereas the first segment's,
kept, would stay in memory all step (in a convolutional network the first segments hold the
largest activations).

With a ``share`` below 1 only the segments that end within that share of the layers, counted
from the input, are recomputed and the rest of the network runs as one plain segment: less
memory saved, for a smaller part of a forward pass.

Where the model has dense blocks (DenseNets: ``dense_blocks.find_blocks``), cutting at tensors
saves little, because those tensors are the blocks' growing concatenations; each dense block
then runs with its own gradient (``dense_blocks.dense_block``: only the layers' narrow outputs
kept, memory linear in the block's depth), the layers before and between blocks as recomputed
segments, whatever follows the last block plainly. With a ``share`` below 1, only the blocks
that end within it.

BatchNormalization in a recomputed segment would update its moving statistics twice per step
(once in the forward pass, once in the recomputation). ``Checkpointed.restore_statistics``
puts back what the forward pass left, so they move once per step, as without recomputation.

TensorFlow is passed in. Python 3.6-compatible; tf.keras 2 and Keras 3 alike.
"""

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

from odtd.trainer.models.graph import nested_chain, part_runner, sub_model, valid_cuts
from odtd.trainer.models.imported import leaf_layers
from odtd.trainer.plans.dense_blocks import Block, dense_block, find_blocks, input_sizes

# Dense layers whose input is at least this share of the model's largest dense-layer input take
# their gradient a chunk of channels at a time (``dense_chunks``). The smaller ones peak below
# the largest anyway, and chunking them costs graph: DenseNet121 at 32x32, every layer chunked,
# ran 40% slower and peaked 150 MB higher, its activations a few MB.
CHUNKED_SHARE = 0.5


def _leaves(part: Any) -> List[Any]:
    """The leaf layers of a segment: a sub-model's, or a dense block's own."""
    return list(part.layers) if isinstance(part, Block) else [leaf for _, leaf in leaf_layers(part)]


def choose_cuts(cuts: Sequence[int], layer_count: int, segments: Optional[int] = None) -> List[int]:
    """About ``segments`` (default: the square root of the layer count) evenly spread cuts."""
    if not cuts:
        return []
    wanted = segments or max(2, int(round(math.sqrt(layer_count))))
    chosen = []
    for part in range(1, wanted):
        target = layer_count * part / float(wanted)
        best = min(cuts, key=lambda k: abs(k - target))
        if best not in chosen:
            chosen.append(best)
    return sorted(chosen)


class Checkpointed:
    """``model`` as segments, all but the last recomputed in the backward pass.

    Call it like the model (``forward(images, training=True)``) inside a GradientTape; after
    ``tape.gradient`` call ``restore_statistics(saved)`` with what ``save_statistics`` returned
    right after the forward pass.

    Args:
        tf: TensorFlow.
        model: A functional Keras model.
        segments: How many segments (default: the square root of the layer count).
        share: Recompute the segments that end within this share (0 to 1) of the layers, from
            the input (at least the first); 1: every segment but the last.

    Attributes:
        cuts: The indices of ``model.layers`` after which the model is cut (empty: no valid cut,
            the model runs whole and nothing is recomputed); for a chain around nested models,
            the nested models' cuts. With dense blocks, where the blocks start and end.
        dense_blocks: How many dense blocks run with their own gradient (0: none found, the
            model is cut into segments).
    """

    def __init__(self, tf: Any, model: Any, segments: Optional[int] = None,
                 share: float = 1.0) -> None:
        self.tf = tf
        self.model = model
        keras = tf.keras
        layers = list(model.layers)
        cuts = valid_cuts(model)
        self.chain = None  # type: Optional[List[Any]]
        self.steps: List[Callable[[Any], Any]] = []
        self.dense_blocks = 0
        chain = nested_chain(tf, model, cuts)
        if chain is not None:
            # Layer by layer, each nested model checkpointed inside itself.
            self.chain = [Checkpointed(tf, layer, segments, share)
                          if isinstance(layer, keras.Model) else layer for layer in chain]
            nested = [part for part in self.chain if isinstance(part, Checkpointed)]
            self.cuts = [cut for part in nested for cut in part.cuts]
            self.batchnorm = [layer for part in nested for layer in part.batchnorm]
            self.dense_blocks = sum(part.dense_blocks for part in nested)
            return
        # Never cut right after a nested model elsewhere either: its ``output`` is a tensor of
        # its own graph, not of this one.
        cuts = [k for k in cuts if not isinstance(layers[k], keras.Model)]
        position = {id(layer.output): k for k, layer in enumerate(layers)
                    if not isinstance(layer.output, (list, tuple))}
        ends = {id(layers[k].output) for k in cuts} | {id(model.outputs[0])}
        blocks = [block for block in find_blocks(tf, model)
                  if (block.start is model.inputs[0] or id(block.start) in ends)
                  and id(block.end) in ends
                  and position.get(id(block.end), len(layers)) <= max(share * len(layers), 1)]
        if blocks:
            # Dense blocks (DenseNets): each runs with its own lean gradient, the layers
            # between them as recomputed segments, whatever follows the last one plainly.
            self.dense_blocks = len(blocks)
            recomputed = []  # type: List[Any]
            start = model.inputs[0]
            sizes = [size for block in blocks for size in input_sizes(block)]
            chunk_from = (None if None in sizes
                          else int(max(sizes) * CHUNKED_SHARE))  # type: Optional[int]
            for block in blocks:
                if block.start is not start:
                    recomputed.append(sub_model(tf, start, block.start))
                    self.steps.append(tf.recompute_grad(part_runner(recomputed[-1])))
                self.steps.append(dense_block(tf, block, chunk_from))
                recomputed.append(block)
                start = block.end
            self.cuts = sorted({position[id(t)] for b in blocks for t in (b.start, b.end)
                                if id(t) in position and t is not model.outputs[0]})
            if start is not model.outputs[0]:
                self.steps.append(part_runner(sub_model(tf, start, model.outputs[0])))
        else:
            chosen = choose_cuts(cuts, len(layers), segments)
            self.cuts = [k for k in chosen if k <= share * len(layers)] or chosen[:1]
            boundaries = ([model.inputs[0]] + [layers[k].output for k in self.cuts]
                          + [model.outputs[0]])
            parts = [sub_model(tf, start, end) for start, end in zip(boundaries, boundaries[1:])]
            recomputed = parts[:-1]
            self.steps = [tf.recompute_grad(part_runner(part)) for part in recomputed]
            self.steps.append(part_runner(parts[-1]))
        self.batchnorm = [layer for part in recomputed for layer in _leaves(part)
                          if isinstance(layer, keras.layers.BatchNormalization)
                          and layer.trainable]

    def __call__(self, images: Any, training: bool = True) -> Any:
        """The model's output; with ``training`` False, the plain model (nothing to recompute)."""
        if not training or not self.cuts:
            return self.model(images, training=training)
        if self.chain is not None:
            hidden = images
            for part in self.chain:
                hidden = part(hidden, training=True)
            return hidden
        hidden = images
        for step in self.steps:
            hidden = step(hidden)
        return hidden

    def save_statistics(self) -> List[Tuple[Any, Any]]:
        """The recomputed BatchNorm layers' moving statistics as the forward pass left them."""
        tf = self.tf
        return [(tf.identity(tf.convert_to_tensor(layer.moving_mean)),
                 tf.identity(tf.convert_to_tensor(layer.moving_variance)))
                for layer in self.batchnorm]

    def restore_statistics(self, saved: List[Tuple[Any, Any]]) -> None:
        """Undo the recomputation's second moving-average update."""
        for layer, (mean, variance) in zip(self.batchnorm, saved):
            layer.moving_mean.assign(mean)
            layer.moving_variance.assign(variance)
