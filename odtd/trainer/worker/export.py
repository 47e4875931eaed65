"""The worker's ``export`` mode: a version's weights as a full Keras model file.

``export_model`` writes the file (a built-in network with pixels in and probabilities out, an
imported model natively, or the weights written into a copy of the user's own file); a version
with the device's class priors carries them in it (``fold_offset``, ``offset_layer``).
Python 3.6-compatible; tf.keras 2 and Keras 3 alike.
"""

from typing import Any, Dict, List

import numpy as np

from odtd.trainer.protocol.job import BadJob


def export_model(tf: Any, job: Dict[str, Any], model: Any) -> Dict[str, Any]:
    """Write the loaded weights as a full Keras model at ``export_to`` (``.keras`` or ``.h5``).

    This worker's Keras writes the model: it opens with a Keras of the same major version. With
    ``model_file`` (an imported model's file as the user gave it, of the format asked for), the
    weights are written into a copy of that file instead: the Keras that wrote it opens it, even
    where that is another major version than the device's. A built-in network is exported as a
    classifier any Keras image pipeline can call: 0..255 pixels in (a Rescaling layer in front),
    softmax probabilities out.

    A version with the device's class priors (``logit_offset``: ``training.prior_correction``)
    is exported with them: added to the bias of the model's last layer where that is a Dense
    layer (``fold_offset``), else as a last layer of its own where the model's output is logits
    (``offset_layer``); otherwise the export is without them. The result says which
    (``logit_offset``).
    """
    from odtd.trainer.modelfile import model_file
    from odtd.trainer.models import imported

    out = job["export_to"]
    suffix = ".h5" if out.endswith(".h5") else ".keras"
    offset = job["logit_offset"]
    folded = offset is not None and fold_offset(model, offset)
    said = None if offset is None else "in the last layer's bias" if folded else "not in the file"
    if job["architecture"] is not None:
        original = job["model_file"]
        if original is not None:
            if model_file.read_config(original)["format"] != suffix.lstrip("."):
                raise BadJob("export_to {}: the original file is {}; name the export the same "
                             "way to write into a copy of it".format(out, original))
            imported.export_like_original(model, original, out)
            return {"export": "as_given", "logit_offset": said}
    if suffix not in imported.native_formats(tf):
        raise BadJob("the Keras of TensorFlow {} writes no {} files (tf.keras 2.13 and later "
                     "do); export as {}".format(tf.__version__, suffix,
                                                " or ".join(imported.native_formats(tf))))
    appended = offset is not None and not folded and job["output"] == "logits"
    if appended:
        said = "a last layer"
    if job["architecture"] is not None:
        if appended:
            inputs = tf.keras.Input(shape=tuple(model.input_shape[1:]), name="inputs")
            model = tf.keras.Model(inputs, offset_layer(tf, offset)(model(inputs)), name=model.name)
        imported.export_native(tf, model, out)
        return {"export": "native", "logit_offset": said}
    inputs = tf.keras.Input(shape=tuple(job["input_shape"]), name="pixels")
    scaled = tf.keras.layers.Rescaling(1.0 / 255.0, name="to_unit_range")(inputs)
    logits = model(scaled)
    if appended:
        logits = offset_layer(tf, offset)(logits)
    probabilities = tf.keras.layers.Activation("softmax", dtype="float32", name="probabilities")(logits)
    imported.export_native(tf, tf.keras.Model(inputs, probabilities, name=model.name), out)
    return {"export": "native", "logit_offset": said}


def fold_offset(model: Any, offset: List[float]) -> bool:
    """Add ``offset`` to the bias of the model's last layer, if it is a Dense layer with one.

    Its output is the logits, or their softmax: ``softmax(z + offset)`` is the corrected
    distribution whether ``z`` is the logits or the log-probabilities (they differ by a
    constant per image). Returns whether it did.
    """
    last = model.layers[-1]
    activation = getattr(getattr(last, "activation", None), "__name__", None)
    if type(last).__name__ != "Dense" or not last.use_bias or len(offset) != last.units or \
            activation not in ("linear", "softmax"):
        return False
    kernel, bias = last.get_weights()
    last.set_weights([kernel, bias + np.asarray(offset, bias.dtype)])
    return True


def offset_layer(tf: Any, offset: List[float]) -> Any:
    """The offset as a last layer of its own, for a model whose output is logits.

    A Dense layer of identity kernel, the offset its bias: any Keras loads it without odtd.
    """
    classes = len(offset)
    layer = tf.keras.layers.Dense(classes, dtype="float32", name="prior_offset")
    layer.build((None, classes))
    layer.set_weights([np.eye(classes, dtype=np.float32), np.asarray(offset, np.float32)])
    layer.trainable = False
    return layer
