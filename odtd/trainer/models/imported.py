"""The user's model in the worker's own Keras: built from its screened configuration, exported back.

The weights are copied from the user's file, layer by layer.

``load_model`` is never called on the user's file (see ``model_file``): the screened
configuration is translated to this process's dialect (``keras_dialects``) and built, then
each weight-holding layer's arrays are copied from the file with h5py and checked for shape.

Runs only in the worker (TensorFlow is passed in). Python 3.6-compatible; tf.keras 2 (TF 2.7 to
2.15) and Keras 3 alike.
"""
import io
import json
import re
import shutil
import zipfile
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np

from odtd import atomic
from odtd.trainer.modelfile import keras_dialects, model_config, model_file
from odtd.trainer.models import graph


def keras_version(tf: Any) -> str:
    """The version of the Keras that ``tf.keras`` is (tf.keras 2.15 has no ``__version__``)."""
    version = getattr(tf.keras, "__version__", None)
    if version is None:
        try:
            import keras as _keras  # the keras package beside tf.keras 2.x
            version = _keras.__version__
        except ImportError:
            version = tf.__version__  # TF 2.7's tf.keras carries TensorFlow's version
    return version


def keras_major(tf: Any) -> int:
    """The major version of the Keras that ``tf.keras`` is (2 or 3)."""
    return 3 if keras_version(tf).startswith("3.") else 2


def _tf_minor(tf: Any) -> Tuple[int, int]:
    major, minor = tf.__version__.split(".")[:2]
    return int(major), int(minor)


def build_from_config(tf: Any, config: Dict[str, Any]) -> Any:
    """Screen ``config`` again, translate it to this Keras's dialect and build it (no weights).

    Random augmentation layers are built as identity layers (``model_config.without_augmentation``).

    Raises:
        model_file.ModelFileError: the screen refuses it (never expected: ``init`` screened it).
        keras_dialects.ConversionError: a setting this Keras has no equivalent for.
    """
    for layer, reason in model_file.screen(config):
        raise model_file.ModelFileError("layer {!r}: {}".format(layer, reason))
    config = model_config.without_augmentation(config)  # a copy: the deserializers consume it
    if keras_major(tf) == 3:
        import keras
        if model_config.dialect(config) == "keras2":
            config = keras_dialects.to_keras3(config)
        if "module" in config:  # .keras (v3 format) config: the public deserializer
            # safe_mode=True also refuses a Lambda should the screen ever miss one
            return keras.saving.deserialize_keras_object(config, safe_mode=True)
        # legacy (.h5-style) config, as Keras 3's own .h5 loader builds it
        from keras.src.legacy.saving import saving_utils
        from keras.src.saving import serialization_lib
        with serialization_lib.SafeModeScope(True):
            return saving_utils.model_from_config(config)
    target = keras_dialects.to_keras2(config, _tf_minor(tf)) \
        if model_config.dialect(config) == "keras3" else keras_dialects._strip_meta(config)
    return tf.keras.models.model_from_json(json.dumps(target))


# ----------------------------------------------------------------- weights from the file
def leaf_layers(model: Any, prefix: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], Any]]:
    """(names from the outer model down, layer) for every leaf layer, nested models walked."""
    for layer in model.layers:
        if hasattr(layer, "layers") and layer.__class__.__name__ in (
                "Functional", "Sequential", "Model"):
            for item in leaf_layers(layer, prefix + (layer.name,)):
                yield item
        else:
            yield prefix + (layer.name,), layer


def batchnorm_layers(tf: Any, model: Any) -> List[Any]:
    """The model's BatchNormalization layers, in nested models too (freeze_bn, recalibrate_bn)."""
    return [layer for _, layer in leaf_layers(model)
            if isinstance(layer, tf.keras.layers.BatchNormalization)]


def _leaf_keys(model: Any) -> Dict[Tuple[str, str], Tuple[Tuple[str, ...], Any]]:
    """Every leaf layer by (top-level name, leaf name), each as Keras 3 names it (no "/").

    A tf.keras 2 file's names may hold "/" (MobileNetV3's ``Conv/BatchNorm``): Keras 3 builds
    those layers as ``Conv_BatchNorm`` (``keras_dialects.keras3_name``); tf.keras 2 keeps them.
    Keyed so, a file's names match the model's under either.
    """
    keys = {}  # type: Dict[Tuple[str, str], Tuple[Tuple[str, ...], Any]]
    for names, layer in leaf_layers(model):
        key = (keras_dialects.keras3_name(names[0]), keras_dialects.keras3_name(names[-1]))
        if key in keys:
            raise ValueError("layers {} and {} have one name once '/' is '_'".format(
                "/".join(keys[key][0]), "/".join(names)))
        keys[key] = (names, layer)
    return keys


def _h5_leaf(top: str, weight: str, leaves: Any) -> str:
    """The leaf layer a legacy .h5 weight name belongs to, among ``leaves`` (keys of the top).

    "<layer>/<variable>", where a layer's own name may hold "/" (tf.keras 2's MobileNetV3:
    "Conv/BatchNorm/gamma:0"); a nested model's weights are "<leaf>/<variable>", the leaf's
    name perhaps with "/" too, perhaps under the nested model's scope.
    """
    parts = weight.split("/")
    if len(parts) < 2 or "/".join(parts[:-1]) == top:
        return top
    for start in range(len(parts) - 1):  # the longest name the model has
        candidate = "/".join(parts[start:-1])
        if keras_dialects.keras3_name(candidate) in leaves:
            return candidate
    return parts[-2]


def _h5_weight_names(group: Any, keys: Any) -> Iterator[Tuple[str, Tuple[str, str], List[str]]]:
    """Each leaf layer's weights in a legacy .h5 (Keras 2 and Keras 3 writers).

    Yields:
        The layer's top-level group, its key (as ``_leaf_keys``'s), its weights' names in order.
    """
    leaves = {}  # type: Dict[str, set]
    for top, leaf in keys:
        leaves.setdefault(top, set()).add(leaf)
    for top in [n.decode() if isinstance(n, bytes) else n for n in group.attrs["layer_names"]]:
        names = [n.decode() if isinstance(n, bytes) else n
                 for n in group[top].attrs["weight_names"]]
        per_leaf = {}  # type: Dict[str, List[str]]
        known = leaves.get(keras_dialects.keras3_name(top), set())
        for name in names:
            per_leaf.setdefault(_h5_leaf(top, name, known), []).append(name)
        for leaf, weights in per_leaf.items():
            yield top, (keras_dialects.keras3_name(top), keras_dialects.keras3_name(leaf)), weights


_SNAKE1 = re.compile("(.)([A-Z][a-z]+)")
_SNAKE2 = re.compile("([a-z])([A-Z])")


def _snake(name: str) -> str:
    name = _SNAKE2.sub(r"\1_\2", _SNAKE1.sub(r"\1_\2", name)).lower()
    return name


def _keras_v3_paths(model: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """Paths the .keras format (Keras 2.13+ and 3) stores each leaf layer's variables under."""
    used = {}
    for layer in model.layers:
        base = _snake(layer.__class__.__name__)
        if base in used:
            used[base] += 1
            base = "{}_{}".format(base, used[base])
        else:
            used[base] = 0
        path = prefix + "layers/" + base
        if layer.__class__.__name__ in ("Functional", "Sequential", "Model"):
            for item in _keras_v3_paths(layer, path + "/"):
                yield item
        else:
            yield path + "/vars", layer


def copy_weights(model: Any, path: str, fmt: str) -> int:
    """Assign every leaf layer's weights from the user's file; shapes must match exactly.

    Returns:
        How many layers got weights.

    Raises:
        ValueError: a layer without weights in the file, weights of unknown layers, a shape
            that differs.
    """
    import h5py
    assigned = 0
    if fmt == "h5":
        keys = _leaf_keys(model)
        stored = {}
        with h5py.File(path, "r") as handle:
            group = handle["model_weights"] if "model_weights" in handle else handle
            for top, key, weights in _h5_weight_names(group, keys):
                stored.setdefault(key, []).extend(np.asarray(group[top][w]) for w in weights)
        for key, (names, layer) in keys.items():
            if not layer.weights:
                continue
            arrays = stored.pop(key, None)
            if arrays is None:
                raise ValueError("no weights for layer {} in {}".format("/".join(names), path))
            _assign(layer, arrays, "/".join(names))
            assigned += 1
        leftover = [k for k, v in stored.items() if v]
        if leftover:
            raise ValueError("weights in the file for unknown layers: {}".format(leftover))
        return assigned
    with zipfile.ZipFile(path) as archive:
        data = io.BytesIO(archive.read("model.weights.h5"))
    with h5py.File(data, "r") as handle:
        for vars_path, layer in _keras_v3_paths(model):
            if not layer.weights:
                continue
            if vars_path not in handle:
                raise ValueError("no {} in {} (layer {})".format(vars_path, path, layer.name))
            group = handle[vars_path]
            arrays = [np.asarray(group[str(i)]) for i in range(len(group.keys()))]
            _assign(layer, arrays, layer.name)
            assigned += 1
    return assigned


def _assign(layer: Any, arrays: List[np.ndarray], label: str) -> None:
    current = layer.get_weights()
    if len(current) != len(arrays) or any(
            c.shape != a.shape for c, a in zip(current, arrays)):
        raise ValueError("layer {}: file has {} for {}".format(
            label, [a.shape for a in arrays], [c.shape for c in current]))
    layer.set_weights(arrays)
    if hasattr(layer, "finalize_state"):
        # Normalization (Keras 2 and 3) caches mean/variance computed from its variables;
        # set_weights alone leaves the cache at the build-time values (seen: outputs off by 0.67)
        layer.finalize_state()


def load_user_model(tf: Any, path: str) -> Any:
    """Build the model of a user's file (screened) with the file's weights."""
    info = model_file.read_config(path)
    model = build_from_config(tf, info["config"])
    copy_weights(model, path, info["format"])
    return model


# ----------------------------------------------------------------- export
def native_formats(tf: Any) -> Tuple[str, ...]:
    """The files this process's Keras writes (``export_native``).

    ``.h5``, and ``.keras`` from tf.keras 2.13 on (before, ``save("x.keras")`` writes a
    SavedModel directory of that name).
    """
    if keras_major(tf) == 2 and _tf_minor(tf) < (2, 13):
        return (".h5",)
    return (".h5", ".keras")


def export_native(tf: Any, model: Any, out_path: str) -> None:
    """This process's Keras writes .keras or .h5 (by suffix; one of ``native_formats``).

    A ``.keras`` file opens with the same Keras major. tf.keras 2 writes an ``.h5`` of one flat
    graph (``graph.flattened``), which Keras 3 opens too.
    """
    if out_path.endswith(".h5"):
        flat = graph.flattened(tf, model) if keras_major(tf) == 2 else model
        flat.save(out_path, include_optimizer=False)
    else:
        model.save(out_path)


def export_like_original(model: Any, original_path: str, out_path: str) -> None:
    """Write the trained weights into a copy of the user's own file.

    Same format, configuration and Keras dialect as they gave: their own Keras opens it with a
    plain ``load_model``, whatever Keras the device runs. An ``.h5`` file's stale optimizer
    state and training configuration are dropped.
    """
    import h5py

    fmt = model_file.read_config(original_path)["format"]
    if fmt == "h5":
        with atomic.staged(out_path) as tmp:
            shutil.copyfile(original_path, tmp)
            with h5py.File(tmp, "r+") as handle:
                _write_h5_weights(model, handle, original_path)
        return
    with zipfile.ZipFile(original_path) as archive:
        members = dict((name, archive.read(name)) for name in archive.namelist())
    # A scratch file beside the export rather than in the system's temporary directory: the
    # same disk, not a small RAM-backed /tmp, and a killed worker's leftover is found there.
    scratch = atomic.temporary_name(out_path + ".weights.h5")
    try:
        with open(scratch, "wb") as handle:
            handle.write(members["model.weights.h5"])
        with h5py.File(scratch, "r+") as handle:
            for vars_path, layer in _keras_v3_paths(model):
                for i, value in enumerate(layer.get_weights()):
                    handle[vars_path][str(i)][...] = value
        with open(scratch, "rb") as handle:
            members["model.weights.h5"] = handle.read()
    finally:
        atomic.remove_quietly(scratch)
    with atomic.staged(out_path) as tmp:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as archive:
            for name, data in members.items():
                archive.writestr(name, data)


def _write_h5_weights(model: Any, handle: Any, original_path: str) -> None:
    """Write ``model``'s weights into ``handle``, an open copy of the user's ``.h5`` file."""
    group = handle["model_weights"]
    if "optimizer_weights" in handle:
        del handle["optimizer_weights"]
    if "training_config" in handle.attrs:
        del handle.attrs["training_config"]
    keys = _leaf_keys(model)
    for top, key, wnames in list(_h5_weight_names(group, keys)):
        if key not in keys:
            raise ValueError("layer {} of {}: not in the model".format(
                "/".join(key), original_path))
        values = keys[key][1].get_weights()
        if len(values) != len(wnames):
            raise ValueError("layer {}: {} weights in the model, {} in {}".format(
                "/".join(key), len(values), len(wnames), original_path))
        for wname, value in zip(wnames, values):
            group[top][wname][...] = value
