"""Average pooling before a 1x1 convolution: the same output for a quarter of the work.

A 1x1, stride-1 Conv2D without an activation is one affine map applied to each pixel alone;
average pooling takes averages of pixels, with weights that sum to one (at the borders too). The
two commute, so pooling first computes the same, up to rounding, with the convolution, its output
and its gradient on the pooled image. A DenseNet's transition (BatchNorm, ReLU, 1x1 convolution,
2x2 average pooling: the built-in DenseNet-40, keras.applications' DenseNets, a user's own) is
written convolution first, and so convolves four times the pixels it needs.

``pool_first`` swaps such pairs in a chain of layers (a dense block's tail, which
``dense_blocks`` runs by hand under recomputation). ``PoolFirst`` runs a whole model that way:
the model is cut where its graph allows (``graph.valid_cuts``) before and after every such pair,
the parts between run as sub-models of the same layers, and each pair runs pooling first. The
same weights train and the same BatchNorm statistics move. The train step of the plans without
recomputation runs it (``step.make_forward``), and so do the passes outside a step
(``pooling_first``): scoring, BatchNorm's statistics, distillation's targets.

TensorFlow is passed in. Python 3.6-compatible; tf.keras 2 and Keras 3 alike.
"""

from typing import Any, Callable, List, Optional, Sequence

from odtd.trainer.models.graph import consumers, inputs_of, nested_chain, part_runner, sub_model, valid_cuts


def swaps(conv: Any, pool: Any) -> bool:
    """Whether ``pool`` right after ``conv`` can run first.

    So it can after a 1x1, stride-1 Conv2D without an activation (an affine map of each pixel
    alone), when ``pool`` is an AveragePooling2D on the same layout.
    """
    return (conv.__class__.__name__ == "Conv2D" and pool.__class__.__name__ == "AveragePooling2D"
            and tuple(conv.kernel_size) == (1, 1) and tuple(conv.strides) == (1, 1)
            and getattr(conv.activation, "__name__", "") == "linear"
            and getattr(conv, "data_format", None) == getattr(pool, "data_format", None))


def pool_first(layers: Sequence[Any]) -> List[Any]:
    """``layers`` (a chain) with each such convolution and the pooling right after it swapped."""
    ordered = list(layers)
    for index in range(len(ordered) - 1):
        if swaps(ordered[index], ordered[index + 1]):
            ordered[index], ordered[index + 1] = ordered[index + 1], ordered[index]
    return ordered


def _pooled(pool: Any, conv: Any) -> Callable[..., Any]:
    def run(tensor: Any, training: bool = True) -> Any:
        return conv(pool(tensor, training=training), training=training)
    return run


class PoolFirst:
    """A model run with every (1x1 convolution, average pooling) pair swapped.

    Build one with ``PoolFirst.of``; call it like the model (``forward(images, training=True)``,
    or ``training=False`` for inference).

    Attributes:
        model: The model (its layers, weights and BatchNorm statistics are the ones trained).
        swapped: The names of the convolutions that run after their pooling, nested models'
            included.
    """

    def __init__(self, model: Any, steps: List[Callable[[Any], Any]], swapped: List[str]) -> None:
        self.model = model
        self.steps = steps
        self.swapped = swapped

    @classmethod
    def of(cls, tf: Any, model: Any) -> Optional["PoolFirst"]:
        """``model`` run pooling first, or None where no pair can be (nothing to gain).

        A Sequential model, or a functional chain around nested models (an exported model's
        rescaling and softmax around its network), runs layer by layer, each nested model
        pooling first inside itself. Any other functional model with one input and one output
        runs as sub-models between the pairs; a pair counts where the graph can be cut right
        before and right after it (nothing else reads the convolution's input or output). A
        model with a layer called twice (a shared layer) is left as it is.
        """
        keras = tf.keras
        layers = list(model.layers)
        if model.__class__.__name__ == "Sequential":
            return cls._chain(tf, model, [layer for layer in layers
                                          if layer.__class__.__name__ != "InputLayer"])
        if len(model.inputs) != 1 or len(model.outputs) != 1 or consumers(model) is None:
            return None
        cuts = valid_cuts(model)
        chain = nested_chain(tf, model, cuts)
        if chain is not None:
            return cls._chain(tf, model, chain)
        cut, output = set(cuts), model.outputs[0]
        pairs = [k for k in range(2, len(layers) - 1)
                 if swaps(layers[k], layers[k + 1]) and k - 1 in cut
                 and (k + 1 in cut or layers[k + 1].output is output)
                 and not isinstance(layers[k - 1], keras.Model)
                 and inputs_of(layers[k])[0] is layers[k - 1].output
                 and inputs_of(layers[k + 1])[0] is layers[k].output]
        if not pairs:
            return None
        steps = []  # type: List[Callable[[Any], Any]]
        start = model.inputs[0]
        for k in pairs:
            if layers[k - 1].output is not start:
                steps.append(part_runner(sub_model(tf, start, layers[k - 1].output)))
            steps.append(_pooled(layers[k + 1], layers[k]))
            start = layers[k + 1].output
        if start is not output:
            steps.append(part_runner(sub_model(tf, start, output)))
        return cls(model, steps, [layers[k].name for k in pairs])

    @classmethod
    def _chain(cls, tf: Any, model: Any, chain: List[Any]) -> Optional["PoolFirst"]:
        parts, swapped = [], []  # type: List[Any], List[str]
        for layer in chain:
            inner = cls.of(tf, layer) if isinstance(layer, tf.keras.Model) else None
            if inner is not None:
                swapped.extend(inner.swapped)
            parts.append(inner or layer)
        ordered = pool_first(parts)
        swapped.extend(part.name for before, part in zip(parts, ordered)
                       if before is not part and part.__class__.__name__ == "Conv2D")
        if not swapped:
            return None
        return cls(model, [part_runner(part) for part in ordered], swapped)

    def __call__(self, images: Any, training: bool = True) -> Any:
        """The model's output, in training (``training``) or inference."""
        hidden = images
        for step in self.steps:
            hidden = step(hidden, training=training)
        return hidden


def pooling_first(tf: Any, model: Any) -> Any:
    """``PoolFirst.of(tf, model)``, or the model itself where no pair swaps: what a pass calls.

    The train step without recomputation (``step.make_forward``) and the passes outside a step
    (scoring, BatchNorm's statistics, distillation's targets) call it; build it before tracing
    them.
    """
    return PoolFirst.of(tf, model) or model
