"""The fixed image sets a home keeps beside its samples: the validation set, the reference set.

``odtctl init`` decodes them once from ``<label>/<file>`` directories (``--validation``, the
reference share of ``--replay``), at the model's input shape and as ingest prepares samples
(``odtd.home.images``), and stores them as ``.npz`` arrays in the home.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import numpy as np

from odtd.errors import IngestError
from odtd.home.images import BadImage, decode_image
from odtd.home.ingest import discover

logger = logging.getLogger(__name__)


def load_validation_dir(
    path: Path, classes: list[str], input_shape: tuple[int, ...], resize: str = "stretch",
    antialias: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode a ``<label>/<file>`` directory into the fixed validation arrays.

    Images are prepared as ingest prepares samples (``odtd.home.images``); one that cannot be
    decoded is skipped with a warning.

    Args:
        path: the directory.
        classes: the model's classes, in output order.
        input_shape: the model's (height, width, channels).
        resize: ``odtd.yaml``'s ``images.resize``.
        antialias: ``odtd.yaml``'s ``images.antialias``.

    Returns:
        x uint8 (n, height, width, channels) and y int64 class indices.

    Raises:
        IngestError: the path is unusable, holds a label outside ``classes``, or no images.
    """
    if not path.is_dir():
        raise IngestError(f"--validation {path}: not a directory of <label>/<image> files")
    return decode_labelled(list(discover(path, None)), classes, input_shape,
                           f"--validation {path}", resize, antialias)


def decode_labelled(files: list[tuple[Path, Optional[str]]], classes: list[str],
                    input_shape: tuple[int, ...], what: str, resize: str = "stretch",
                    antialias: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Decode labelled image files (from ``discover``) into x uint8 NHWC and y class indices.

    An image that cannot be decoded is skipped with a warning; a label outside ``classes`` or
    no readable image at all is an error naming ``what`` (the option and its directory).
    """
    option = what.split()[0]
    index = {name: i for i, name in enumerate(classes)}
    xs, ys = [], []
    for file, label in files:
        if label not in index:
            raise IngestError(f"{option} {file}: label {label!r} is not one of the classes {classes}")
        try:
            xs.append(decode_image(file.read_bytes(), input_shape, resize, antialias))
        except (BadImage, OSError) as exc:
            logger.warning("%s image %s skipped: %s", option.lstrip("-"), file, exc)
            continue
        ys.append(index[label])
    if not xs:
        raise IngestError(f"{what}: no readable images under <label>/ folders")
    return np.stack(xs), np.array(ys, dtype=np.int64)
