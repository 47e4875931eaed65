"""The ``none`` backend: always available, measures nothing.

Sessions still run and record time and memory; their energy is None with coverage 0, which is
the truth, rather than a made-up number.
"""

import logging
from pathlib import Path
from typing import Optional

from odtd.telemetry.base import Backend, PowerSample

logger = logging.getLogger(__name__)


class NullBackend(Backend):
    """No power readings at all; every window reports ``energy_j = None``."""

    name = "none"
    source = "none"
    measures_energy = False

    def __init__(self, root: Path = Path("/")) -> None:
        """Store ``root`` (unused; kept for a uniform constructor)."""
        self.root = root

    @classmethod
    def probe(cls, root: Path = Path("/")) -> Optional[str]:
        """Always available."""
        return None

    def open(self) -> None:
        """Nothing to open."""

    def read(self) -> Optional[PowerSample]:
        """Return None: there is never a sample."""
        return None
