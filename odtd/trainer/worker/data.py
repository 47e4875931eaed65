"""The data files a job names: samples ``.npz`` (``x`` uint8 NHWC, ``y`` labels, ``group``).

Read by the worker before TensorFlow is imported, so a bad file fails fast with a ``BadJob``
naming the key, the file and the fix. Standard library and numpy only; Python 3.6-compatible.
"""

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from odtd.trainer.protocol.job import BadJob

REHEARSAL_IMAGES = 1024  # the most rehearsed images BatchNorm adaptation measures
PRIOR_IMAGES = 4096  # the most images without a label the class priors' EM reads


def load_dataset(key: str, path: str, input_shape: List[int], num_classes: int
                 ) -> Tuple[np.ndarray, np.ndarray]:
    """Read a samples ``.npz`` (``x`` uint8 (N, h, w, c), ``y`` integer labels (N,)).

    Args:
        key: The job key naming the file, for messages.
        path: The ``.npz`` file.
        input_shape: The model's (height, width, channels).
        num_classes: Labels must lie in [0, num_classes).

    Returns:
        ``(x, y)`` with ``y`` as int64.

    Raises:
        BadJob: Unreadable file, missing array, wrong dtype or shape, label out of range.
    """
    try:
        with np.load(path, allow_pickle=False) as arrays:
            x, y = arrays["x"], arrays["y"]
    except (OSError, ValueError, KeyError) as error:
        raise BadJob("{}: cannot read x and y from {}: {}".format(key, path, error)) from None
    if x.dtype != np.uint8 or x.shape[1:] != tuple(input_shape) or len(x) == 0:
        raise BadJob("{}: x in {} must be uint8 (N>0, {}), got {} {}".format(
            key, path, ", ".join(map(str, input_shape)), x.dtype, x.shape))
    if y.dtype.kind not in "iu" or y.shape != (len(x),):
        raise BadJob("{}: y in {} must be integers of shape ({},), got {} {}".format(
            key, path, len(x), y.dtype, y.shape))
    if y.min() < 0 or y.max() >= num_classes:
        raise BadJob("{}: labels in {} must lie in [0, {}), got [{}, {}]".format(
            key, path, num_classes, y.min(), y.max()))
    return x, y.astype(np.int64)


def load_groups(path: str, count: int) -> Optional[np.ndarray]:
    """Read the optional ``group`` array of a validation ``.npz`` (one integer per sample)."""
    with np.load(path, allow_pickle=False) as arrays:
        if "group" not in arrays.files:
            return None
        groups = arrays["group"]
    if groups.shape != (count,) or groups.dtype.kind not in "iu":
        raise BadJob("validation_data: group in {} must be {} integers, got {} {}".format(
            path, count, groups.dtype, groups.shape))
    return groups


def _optional_rows(job_key: str, path: str, name: str, count: int) -> Optional[np.ndarray]:
    """The ``.npz``'s optional boolean array ``name``, one per sample (``count``), or None."""
    with np.load(path, allow_pickle=False) as arrays:
        if name not in arrays.files:
            return None
        rows = arrays[name]
    if rows.shape != (count,) or rows.dtype != np.bool_:
        raise BadJob("{}: {} in {} must be {} booleans, got {} {}".format(
            job_key, name, path, count, rows.dtype, rows.shape))
    return rows


def load_device_mask(path: str, count: int) -> Optional[np.ndarray]:
    """A train ``.npz``'s optional ``device`` array: which of its ``count`` images the device saw.

    The others are rehearsed from the original domain (the replay seed): what BatchNorm
    adaptation mixes in and distillation (``distill``) holds to the served model's outputs.
    """
    return _optional_rows("train_data", path, "device", count)


def load_offset_rows(path: str, count: int) -> Optional[np.ndarray]:
    """A validation ``.npz``'s optional ``offset`` array: the rows the logit offset applies to."""
    return _optional_rows("validation_data", path, "offset", count)


def load_prior_data(path: str, x: np.ndarray, y: np.ndarray, mask: np.ndarray
                    ) -> Dict[str, Any]:
    """What ``prior_correction`` estimates the device's class priors from, in a train ``.npz``.

    Returns:
        ``labels``: the labels of the device's images, the session's (``mask``) and, where the
        file has ``device_y``, the earlier days' (``device_x``); ``session_labelled``: how
        many are the session's; ``unlabelled``: its images counted by the model's posteriors
        instead, the ones without a label (``unlabelled_x``) and earlier days' that came
        without ``device_y``, at most ``PRIOR_IMAGES``, the file's order; ``unlabelled_x``
        alone (pseudo-labels'); ``calibration``: the rehearsed images of the original domain
        and their labels, at most ``REHEARSAL_IMAGES``, evenly spaced.
    """
    with np.load(path, allow_pickle=False) as arrays:  # each array read once: an npz decompresses per read
        earlier = arrays["device_x"] if "device_x" in arrays.files else x[:0]
        earlier_y = arrays["device_y"].astype(np.int64) if "device_y" in arrays.files else None
        without = arrays["unlabelled_x"] if "unlabelled_x" in arrays.files else x[:0]
    for part in (earlier, without):
        if part.dtype != np.uint8 or part.shape[1:] != x.shape[1:]:
            raise BadJob("train_data: device_x and unlabelled_x in {} must be uint8 (N, {}), got "
                         "{} {}".format(path, ", ".join(map(str, x.shape[1:])), part.dtype,
                                        part.shape))
    labels = y[mask].astype(np.int64)
    if earlier_y is not None and earlier_y.shape == (len(earlier),):
        # A label is better evidence of the device's mix than the model's posterior of it.
        labels, earlier = np.concatenate([labels, earlier_y]), earlier[:0]
    unlabelled = np.concatenate([earlier, without])[:PRIOR_IMAGES]
    rehearsed = np.flatnonzero(~mask)
    if len(rehearsed) > REHEARSAL_IMAGES:
        rehearsed = rehearsed[np.linspace(0, len(rehearsed) - 1, REHEARSAL_IMAGES).astype(np.int64)]
    return {"labels": labels, "session_labelled": int(mask.sum()), "unlabelled": unlabelled,
            "unlabelled_x": without[:PRIOR_IMAGES], "calibration": (x[rehearsed], y[rehearsed])}


def load_device_split(path: str, x: np.ndarray, mask: np.ndarray, y: Optional[np.ndarray] = None
                      ) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """Split a train ``.npz`` into the device's images and the rehearsed ones (``bn_device_share``).

    ``mask`` is the file's ``device`` array (``load_device_mask``): which of ``x`` the device
    saw; the file's optional ``device_x`` holds more of the device's images that are not
    trained on this time (earlier days'), uint8 like ``x``, and ``device_y`` their labels.

    Returns:
        ``(device images, rehearsed images, device labels)``: the labels with ``y`` (``x``'s,
        for ``bn_class_balanced``) where the file has ``device_y`` or no ``device_x``, else None.
        At most ``REHEARSAL_IMAGES`` rehearsed images, evenly spaced through the file's order
        (the replay draw is class-balanced, round-robin): enough for their statistics.
    """
    with np.load(path, allow_pickle=False) as arrays:
        extra = arrays["device_x"] if "device_x" in arrays.files else x[:0]
        extra_y = arrays["device_y"].astype(np.int64) if "device_y" in arrays.files else \
            (np.zeros(0, np.int64) if not len(extra) else None)
    if extra_y is not None and extra_y.shape != (len(extra),):
        raise BadJob("train_data: device_y in {} must be {} labels, got {}".format(
            path, len(extra), extra_y.shape))
    if extra.dtype != np.uint8 or extra.shape[1:] != x.shape[1:]:
        raise BadJob("train_data: device_x in {} must be uint8 (N, {}), got {} {}".format(
            path, ", ".join(map(str, x.shape[1:])), extra.dtype, extra.shape))
    rehearsed = np.flatnonzero(~mask)
    if len(rehearsed) > REHEARSAL_IMAGES:
        rehearsed = rehearsed[np.linspace(0, len(rehearsed) - 1, REHEARSAL_IMAGES).astype(np.int64)]
    labels = None if y is None or extra_y is None else np.concatenate([y[mask], extra_y])
    return np.concatenate([x[mask], extra]), x[rehearsed], labels
