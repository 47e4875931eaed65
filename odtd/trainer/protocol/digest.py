"""The hash a weights file is known by on both sides of the worker protocol.

A version's manifest (``home.versions``) records its weights' sha256, and the worker's
evaluation cache (``learning.evalcache``) is keyed by the same digest of the weights it scored:
one definition, so the two always agree. Standard library only; Python 3.6-compatible.
"""

import hashlib
import os
from typing import Union


def file_sha256(path: Union[str, os.PathLike]) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
