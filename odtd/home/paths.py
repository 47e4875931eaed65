"""The state directory (ODTD_HOME) and what lives where in it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from odtd.config import CONFIG_NAME, Config, load_config
from odtd.errors import StoreError

if TYPE_CHECKING:  # the daemon reads paths without loading the store (sqlite-utils, numpy)
    from odtd.store.database import Store


REFERENCE_EVERY = 10
"""``odtctl init --replay``: every 10th image is held out as the reference set (default)."""

UNLABELLED_FOLDER = "_unlabelled"
"""The folder of images without a label, beside the ``<label>/`` folders: ``inbox/_unlabelled/``
(and in a directory ``odtctl ingest`` reads). As every folder's name, it is the label its files
carry in ``(file, label)`` pairs, which ingest stores as unlabelled samples; never a class
(``init`` refuses the name)."""

class Home:
    """Paths of one ODTD_HOME; nothing is created or opened until asked.

    Args:
        root: the state directory.
        config_path: ``odtd.yaml`` elsewhere (``odtd run --config /etc/odtd/odtd.yaml``).
    """

    def __init__(self, root: Path, config_path: Optional[Path] = None) -> None:
        self.root = Path(root)
        self.config_path = Path(config_path) if config_path else self.root / CONFIG_NAME
        self.db_path = self.root / "odtd.db"
        self.inbox = self.root / "inbox"
        self.unlabelled_inbox = self.inbox / UNLABELLED_FOLDER
        self.samples = self.root / "samples"
        self.quarantine = self.root / "quarantine"
        self.models = self.root / "models"
        self.validation = self.root / "validation"
        self.runs = self.root / "runs"
        # precision ``auto``'s measured verdict (odtd.trainer.plans.precision); delete to measure again
        self.precision_probe = self.root / "precision.json"
        self.run = self.root / "run"
        self.socket_path = self.run / "odtd.sock"
        self.session_lock = self.run / "session.lock"
        self.ingest_lock = self.run / "ingest.lock"

    def directories(self) -> list[Path]:
        """Return every directory an initialised home has."""
        return [self.root, self.inbox, self.samples, self.quarantine, self.models,
                self.validation, self.runs, self.run]

    def is_initialised(self) -> bool:
        """Whether ``odtctl init`` has run here."""
        return self.db_path.exists()

    def require(self) -> None:
        """Raise StoreError with the fix when this home was never initialised."""
        if not self.root.exists():
            raise StoreError(
                f"{self.root}: not an odtd home (no such directory): if the home lives on a data "
                "disk, mount it; else run `odtctl init --model NAME` (or --model-file FILE), or "
                "pass --home / set ODTD_HOME"
            )
        if not self.is_initialised():
            raise StoreError(
                f"{self.root}: not an odtd home (no odtd.db); run `odtctl init --model NAME` (or "
                "--model-file FILE), or pass --home / set ODTD_HOME"
            )

    def open_store(self) -> Store:
        """Open the database of an initialised home."""
        from odtd.store.database import Store

        self.require()
        return Store(self.db_path)

    def load_config(self) -> Config:
        """Load ``odtd.yaml`` (defaults when absent)."""
        return load_config(self.config_path)

    def policy_path(self, config: Config) -> Path:
        """Resolve the config's policy path (relative paths are relative to the home)."""
        path = Path(config.policy)
        return path if path.is_absolute() else self.root / path

    def validation_file(self) -> Path:
        """The fixed validation set supplied with the base model (``.npz``: x, y)."""
        return self.validation / "validation.npz"

    def reference_file(self) -> Path:
        """The reference set: base training images held out of ``--replay`` (``.npz``: x, y).

        Images of the original domain no session trains on: the guard checks that a candidate
        does not forget what the server taught (``acceptance.reference_tolerance``).
        """
        return self.validation / "reference.npz"
