"""The device's evaluation set: what every candidate, and a fleet's global model, is scored on.

One ``.npz`` of images, labels and groups: the home's validation set (group 0), its held-out
samples (group 1: the device's own images and class mix) and the reference set (group 2: the
original domain). A session's acceptance judges on group 0 where it exists, else group 1;
group 2 guards the original domain (``odtd.session.acceptance``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from odtd.home.ingest import load_sample_arrays
from odtd.home.paths import Home
from odtd.session.result import GROUP_HOLDOUT, GROUP_REFERENCE, GROUP_VALIDATION
from odtd.store.database import Store


def write_evaluation_set(home: Home, store: Store, classes: list[str], job_dir: Path
                         ) -> tuple[str, Optional[Path]]:
    """Write the evaluation ``.npz``: validation, held-out samples, reference set.

    Groups 0, 1 and 2. Acceptance uses group 0 when it exists, else group 1; group 2 guards
    the original domain.

    Returns:
        What acceptance judges on (``validation``, ``holdout`` or ``none``) and the file (None
        when the home has neither a validation set nor held-out samples).
    """
    parts = []
    if home.validation_file().exists():
        with np.load(home.validation_file(), allow_pickle=False) as data:
            parts.append((data["x"], data["y"], GROUP_VALIDATION))
    holdout = store.samples("holdout")
    if holdout:
        hx, hy = load_sample_arrays(home, holdout, classes)
        parts.append((hx, hy, GROUP_HOLDOUT))
    if parts and home.reference_file().exists():
        with np.load(home.reference_file(), allow_pickle=False) as data:
            parts.append((data["x"], data["y"], GROUP_REFERENCE))
    if not parts:
        return "none", None
    path = job_dir / "evaluation.npz"
    np.savez(path, x=np.concatenate([p[0] for p in parts]),
             y=np.concatenate([p[1] for p in parts]),
             group=np.concatenate([np.full(len(p[1]), p[2], dtype=np.int64) for p in parts]))
    return ("validation" if parts[0][2] == GROUP_VALIDATION else "holdout"), path
