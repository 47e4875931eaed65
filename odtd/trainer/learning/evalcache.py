"""Per-sample evaluation results of one model, kept between sessions (job key ``eval_cache``).

Every session scores the served model on the same validation images before it trains, and that
model changes only on a promotion. The cache holds, for one weights file (by sha256) run at one
precision, each scored sample's correctness and loss under a digest of its pixels and label, so
the next session runs only the samples it has not seen (the day's new held-out images) and a
larger validation set costs one evaluation per session instead of two.

Standard library and numpy only; Python 3.6-compatible (the worker imports it).
"""

import hashlib
from typing import Optional, Tuple

import numpy as np

from odtd import atomic

KEY_BYTES = 16


def sample_keys(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """One 16-byte digest per sample of its pixels and its label (``S16`` array)."""
    labels = np.asarray(y, dtype=np.int64)
    return np.array([hashlib.blake2b(x[i].tobytes() + labels[i].tobytes(),
                                     digest_size=KEY_BYTES).digest() for i in range(len(labels))],
                    dtype="S{}".format(KEY_BYTES))


def lookup(path: str, weights_sha256: Optional[str], precision: str, keys: np.ndarray
           ) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The cached results for ``keys`` under this weights file and precision, or None.

    ``weights_sha256`` None takes the cache's model as it is: the home's first model's results,
    kept once (``origin_eval_cache``), whose weights file may since have been pruned.

    Returns:
        ``(known, correct, losses)``, one entry per key: ``known`` says which samples were found;
        ``correct`` and ``losses`` are filled in for those. A missing or unreadable cache, or one
        of another model or precision (a float16 run can call an image differently), is simply
        not used.
    """
    try:
        with np.load(path, allow_pickle=False) as cache:
            if str(cache["precision"]) != precision or (
                    weights_sha256 is not None and str(cache["weights_sha256"]) != weights_sha256):
                return None
            cached_keys, cached_correct, cached_losses = cache["keys"], cache["correct"], cache["losses"]
    except (OSError, ValueError, KeyError):
        return None
    position = {key: i for i, key in enumerate(cached_keys.tolist())}
    found = np.array([position.get(key, -1) for key in keys.tolist()], dtype=np.int64)
    known = found >= 0
    correct = np.zeros(len(keys), dtype=bool)
    losses = np.zeros(len(keys), dtype=np.float64)
    correct[known] = cached_correct[found[known]]
    losses[known] = cached_losses[found[known]]
    return known, correct, losses


def save(path: str, weights_sha256: str, precision: str, keys: np.ndarray, correct: np.ndarray,
         losses: np.ndarray) -> None:
    """Replace the cache with these results (written to a temporary name, then renamed)."""
    with atomic.staged(path, durable=False) as partial:  # a cache: lost, it is scored again
        np.savez(partial, weights_sha256=np.array(weights_sha256), precision=np.array(precision),
                 keys=keys,
                 correct=np.asarray(correct, dtype=bool), losses=np.asarray(losses, dtype=np.float64))
