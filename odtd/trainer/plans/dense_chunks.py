"""A dense layer's gradient taken a few input channels at a time, never over its whole input.

In ``dense_blocks``' backward pass each layer recomputes ``f_l`` on its concatenated input and
takes its gradient. The concatenation, the BatchNorm and activation outputs and their gradients
are each as wide as everything before the layer, and four to six of them are alive at once: at
the end of DenseNet40's first block, at batch 64, 39 MB each, which set the step's peak.

Most dense layers start with layers that act on each channel alone (BatchNormalization, an
elementwise activation, pooling) and then one that mixes channels linearly (a Conv2D or a
Dense). That start is a sum over any split of the input's channels:

    mix(per_channel(concat(x_1, ..., x_k))) = sum_i mix_i(per_channel_i(x_i))

with ``mix_i`` the kernel's rows for ``x_i``'s channels and ``per_channel_i`` BatchNorm's
parameters sliced alike (a training BatchNorm's batch statistics are per channel too).
``chunk_gradient`` takes the gradient chunk by chunk (a few of the block's parts each, one chunk
after the other), so one chunk's tensors are alive at a time. Each chunk's gradients are the
slices of the whole layer's: the mixer's gradients for an input channel involve that channel
alone. The rest of ``f_l`` (a bottleneck's second BatchNorm, activation and convolution) runs on
the mixer's output, which is narrow; where there is such a rest (or the mixer has an
activation), the mixer's output is recomputed first, as a float32 sum of the chunks' parts.

BatchNorm here normalises as the layer does when it trains (the fused kernel, the batch's
statistics) or, frozen, by its moving statistics; it moves no statistics (this is a
recomputation).

TensorFlow is passed in. Python 3.6-compatible; tf.keras 2 and Keras 3 alike.
"""

from typing import Any, List, NamedTuple, Optional, Sequence

from odtd.trainer.plans.fused_batchnorm import MIN_EPSILON, train_normalise

CHUNKS = 4  # chunks per layer: one chunk's tensors are about a quarter of the layer's input
# Activations that act on each value alone (not softmax: it mixes the channels).
ELEMENTWISE = ("relu", "relu6", "elu", "selu", "gelu", "silu", "swish", "sigmoid", "tanh",
               "softplus", "softsign", "hard_sigmoid", "hard_silu", "hard_swish", "mish",
               "leaky_relu", "exponential", "linear")
ACTIVATION_LAYERS = ("ReLU", "LeakyReLU", "ELU")
POOLING = ("AveragePooling2D", "MaxPooling2D", "GlobalAveragePooling2D", "GlobalMaxPooling2D")


class Head(NamedTuple):
    """A dense layer's ``f_l`` as per-channel layers, a linear mixer and the rest."""

    per_channel: List[Any]
    mixer: Any
    rest: List[Any]


def _activation_name(layer: Any) -> str:
    return getattr(getattr(layer, "activation", None), "__name__", "")


def _channels_last(layer: Any) -> bool:
    return getattr(layer, "data_format", "channels_last") == "channels_last"


def _last_axis(layer: Any) -> bool:
    axis = layer.axis
    axis = axis[0] if isinstance(axis, (list, tuple)) and len(axis) == 1 else axis
    return axis == -1 or (isinstance(axis, int) and axis == len(layer.input.shape) - 1)


def _per_channel(layer: Any) -> bool:
    name = layer.__class__.__name__
    if name == "BatchNormalization":
        return (_last_axis(layer) and len(layer.input.shape) == 4
                and not getattr(layer, "renorm", False)
                and not getattr(layer, "synchronized", False)
                and getattr(layer, "virtual_batch_size", None) is None
                and getattr(layer, "adjustment", None) is None
                and (not layer.trainable or layer.epsilon >= MIN_EPSILON))
    if name == "Activation":
        return _activation_name(layer) in ELEMENTWISE
    if name in POOLING:
        return _channels_last(layer)
    return name in ACTIVATION_LAYERS


def _plain_weights(layer: Any) -> bool:
    return (not getattr(layer, "lora_enabled", False)
            and getattr(layer, "quantization_mode", None) is None)


def _mixer(layer: Any) -> bool:
    name = layer.__class__.__name__
    if name == "Conv2D":
        return (_channels_last(layer) and getattr(layer, "groups", 1) == 1
                and _plain_weights(layer))
    return name == "Dense" and _plain_weights(layer)


def split_head(layers: Sequence[Any]) -> Optional[Head]:
    """``layers`` as a ``Head``, or None where they do not start per channel, then a mixer."""
    for index, layer in enumerate(layers):
        if _mixer(layer):
            return Head(list(layers[:index]), layer, list(layers[index + 1:]))
        if not _per_channel(layer):
            return None
    return None


def _key(variable: Any) -> int:
    """One key for a variable and every wrapper of it.

    Keras 3's weights, tf.keras 2's AutoCastVariable under mixed precision and the tf.Variable
    a gradient function is given all share the variable's handle.
    """
    return id(getattr(variable, "handle", variable))


class _Pieces:
    """The head's parameters split once by the chunks' channels, and their gradients.

    A chunk watches its pieces of the trainable ones; the pieces' gradients, concatenated, are
    the variables' (one split and one concatenation per layer instead of a slice and its
    gradient per chunk).
    """

    def __init__(self, tf: Any, head: Head, widths: Sequence[int], variables: Sequence[Any]):
        self.tf = tf
        self.position = {_key(variable): index for index, variable in enumerate(variables)}
        self.pieces = []  # type: List[List[Any]]  # per split weight, its chunks' pieces
        self.targets = []  # type: List[Any]  # per split weight: (variable index or None, axis)
        self.of_layer = {}  # type: Dict[int, List[int]]  # id(layer) -> its weights' entries
        for layer in head.per_channel:
            if layer.__class__.__name__ != "BatchNormalization":
                continue
            channels = sum(widths)
            gamma = layer.gamma if layer.scale else None
            beta = layer.beta if layer.center else None
            weights = [(gamma, tf.ones([channels])), (beta, tf.zeros([channels]))]
            if not layer.trainable:
                weights += [(layer.moving_mean, None), (layer.moving_variance, None)]
            self.of_layer[id(layer)] = [self._split(weight, fill, widths, 0, tf.float32)
                                        for weight, fill in weights]
        mixer = head.mixer
        axis = 2 if mixer.__class__.__name__ == "Conv2D" else 0
        self.of_layer[id(mixer)] = [self._split(mixer.kernel, None, widths, axis, None)]
        # The mixer's bias joins the first chunk's part of its output.
        self.bias = None  # type: Any
        self.bias_position = None  # type: Optional[int]
        if getattr(mixer, "use_bias", False):
            self.bias = tf.convert_to_tensor(mixer.bias)
            self.bias_position = self.position.get(_key(mixer.bias))

    def _split(self, weight: Any, fill: Any, widths: Sequence[int], axis: int,
               dtype: Any) -> int:
        tf = self.tf
        if weight is None:
            self.pieces.append(tf.split(fill, list(widths), axis))
            self.targets.append((None, axis))
        else:
            value = tf.convert_to_tensor(weight)
            value = tf.cast(value, dtype) if dtype is not None else value
            self.pieces.append(tf.split(value, list(widths), axis))
            self.targets.append((self.position.get(_key(weight)), axis))
        return len(self.pieces) - 1

    def of(self, layer: Any, chunk: int) -> List[Any]:
        """``layer``'s pieces for ``chunk``, in the order ``_Pieces`` split them."""
        return [self.pieces[entry][chunk] for entry in self.of_layer[id(layer)]]

    def watched(self, chunk: int) -> List[Any]:
        """The pieces of ``chunk`` whose variables take a gradient (the bias last, in chunk 0)."""
        bias = [self.bias] if chunk == 0 and self.bias_position is not None else []
        return [pieces[chunk] for pieces, target in zip(self.pieces, self.targets)
                if target[0] is not None] + bias

    def gradients(self, found: Sequence[Sequence[Any]]) -> List[Any]:
        """``(variable index, gradient)`` from each chunk's gradients of ``watched``."""
        tf = self.tf
        result = []
        if self.bias_position is not None and found[0][-1] is not None:
            result.append((self.bias_position, found[0][-1]))
        trained = [target for target in self.targets if target[0] is not None]
        for k, (index, axis) in enumerate(trained):
            grads = [chunk[k] for chunk in found]
            if any(grad is None for grad in grads):
                continue
            result.append((index, tf.concat(grads, axis) if len(grads) > 1 else grads[0]))
        return result


def _batchnorm(tf: Any, layer: Any, x: Any, pieces: Sequence[Any]) -> Any:
    """``layer`` on the chunk ``x`` of its input, as it computes it in training."""
    x32 = tf.cast(x, tf.float32)
    if layer.trainable:
        gamma, beta = pieces
        y, _, _ = train_normalise(tf, layer, x32, gamma, beta)
    else:  # frozen: normalised by the moving statistics, in inference mode
        gamma, beta, mean, variance = pieces
        y = tf.nn.batch_normalization(x32, mean, variance, beta, gamma, layer.epsilon)
    return tf.cast(y, x.dtype)


def _mix(tf: Any, layer: Any, z: Any, kernel: Any, bias: Any) -> Any:
    """The mixer's output from the chunk ``z`` and its ``kernel`` rows (and ``bias``, or None)."""
    kernel = tf.cast(kernel, z.dtype)
    if layer.__class__.__name__ == "Conv2D":
        out = tf.nn.conv2d(z, kernel, strides=list(layer.strides),
                           padding=layer.padding.upper(), dilations=list(layer.dilation_rate))
    elif len(z.shape) == 2:
        out = tf.matmul(z, kernel)
    else:
        out = tf.tensordot(z, kernel, [[len(z.shape) - 1], [0]])
    if bias is not None:
        out = out + tf.cast(bias, out.dtype)
    return out


def _chunk_output(tf: Any, head: Head, pieces: _Pieces, x: Any, chunk: int) -> Any:
    for layer in head.per_channel:
        if layer.__class__.__name__ == "BatchNormalization":
            x = _batchnorm(tf, layer, x, pieces.of(layer, chunk))
        else:
            x = layer(x, training=True)
    return _mix(tf, head.mixer, x, pieces.of(head.mixer, chunk)[0],
                pieces.bias if chunk == 0 else None)


def chunk_spans(widths: Sequence[int], chunks: int = CHUNKS) -> List[List[int]]:
    """Consecutive positions of ``widths`` in at most ``chunks`` groups of about equal width."""
    total, spans, current, done = sum(widths), [], [], 0
    for position, width in enumerate(widths):
        current.append(position)
        done += width
        if done * chunks >= total * (len(spans) + 1) and position < len(widths) - 1:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def accumulate(tf: Any, running: List[Any], positions: Sequence[int],
               found: Sequence[Any]) -> List[Any]:
    """Add ``found[k]`` to ``running[positions[k]]``; return the sums made.

    Each sum waits on the gradients it adds (a control dependency, not only data): Grappler
    would otherwise fold a chain of same-shaped additions into one AddN that holds every
    addend until the last exists, a part's gradient from every layer at once.
    """
    made = []
    with tf.control_dependencies([grad for grad in found if grad is not None]):
        for position, grad in zip(positions, found):
            if grad is None:
                continue
            running[position] = (tf.identity(grad) if running[position] is None
                                 else running[position] + grad)
            made.append(running[position])
    return made


def kept_after(tf: Any, tensors: Sequence[Any], barrier: Sequence[Any]) -> List[Any]:
    """``tensors`` read again once everything in ``barrier`` exists (a recomputation's inputs)."""
    with tf.control_dependencies(list(barrier)):
        return [tf.identity(tensor) for tensor in tensors]


def chunk_gradient(tf: Any, head: Head, parts: Sequence[Any], running: List[Any],
                   summed: List[Any], d_out: Any, variables: Sequence[Any], run: Any) -> None:
    """Add ``f(concat(parts))``'s gradients to ``running`` and ``summed``, a chunk at a time.

    Args:
        tf: TensorFlow.
        head: ``f`` (``split_head``).
        parts: The tensors ``f``'s input concatenates, in order.
        running: Per part, the gradient summed so far (None: none yet); updated in place.
        summed: Per variable, the gradient summed so far (None: none yet); updated in place.
        d_out: The gradient at ``f``'s output; nothing starts before it exists.
        variables: The variables to take gradients for.
        run: ``run(layers, tensor)``: the layers in training mode.
    """
    widths = [int(part.shape[-1]) for part in parts]
    spans = chunk_spans(widths)
    variables = list(variables)
    with tf.control_dependencies([d_out]):
        pieces = _Pieces(tf, head, [sum(widths[p] for p in span) for span in spans],
                         variables)
    activation = getattr(head.mixer, "activation", None)
    d_mixed, barrier = d_out, [d_out]
    if head.rest or _activation_name(head.mixer) not in ("linear", ""):
        # The mixer's output, recomputed as a float32 sum over the chunks, then the rest.
        mixed = None  # type: Any
        for chunk, span in enumerate(spans):
            kept = kept_after(tf, [parts[p] for p in span], barrier)
            x = tf.concat(kept, -1) if len(kept) > 1 else kept[0]
            part = tf.cast(_chunk_output(tf, head, pieces, x, chunk), tf.float32)
            mixed = part if mixed is None else mixed + part
            barrier = [mixed]
        mixed = tf.cast(mixed, d_out.dtype)
        with tf.GradientTape() as tape:
            tape.watch(mixed)
            out = run(head.rest, activation(mixed) if activation is not None else mixed)
        found = tape.gradient(out, [mixed] + variables, output_gradients=d_out)
        d_mixed = found[0]
        accumulate(tf, summed, range(len(variables)), found[1:])
        barrier = [d_mixed]
    piece_gradients = []  # type: List[List[Any]]
    for chunk, span in enumerate(spans):
        kept = kept_after(tf, [parts[p] for p in span], barrier)
        watched = pieces.watched(chunk)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(kept + watched)
            x = tf.concat(kept, -1) if len(kept) > 1 else kept[0]
            part = _chunk_output(tf, head, pieces, x, chunk)
        found = tape.gradient(part, kept + watched, output_gradients=d_mixed)
        barrier = accumulate(tf, running, span, found[:len(kept)])
        piece_gradients.append(found[len(kept):])
    for index, grad in pieces.gradients(piece_gradients):
        accumulate(tf, summed, [index], [grad])
