"""Ingest: image files become validated, content-addressed samples, or quarantined inputs.

Images are decoded by ``odtd.home.images`` with Pillow (no TensorFlow in this process), to the
model's channels and input size. A sample is stored twice under ``samples/<aa>/``: the original
bytes (``<sha256>.<ext>``, never modified) and the decoded pixels (``<sha256>.npy``, uint8
height x width x channels) the trainer reads. One bad file never stops a batch: it is
quarantined with its reason.

A file whose label is ``UNLABELLED_FOLDER`` (``inbox/_unlabelled/``, ``odtctl ingest
--unlabelled``) is read, checked and stored alike, as an unlabelled sample (``odtd.store.
samples``): never trained on nor evaluated on. The same image ingested later with a label
becomes a labelled sample (pending, or held out by its hash as any other); one stored with a
label keeps it when it comes again unlabelled (a duplicate).
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from odtd import atomic
from odtd.config import Config, StorageConfig
from odtd.errors import STORAGE_ERRNOS, IngestError, StorageError, storage_error
from odtd.home.disk import check_room_for_ingest
from odtd.home.images import BadImage, check_fit, decode_image
from odtd.home.lock import ingest_lock
from odtd.home.paths import UNLABELLED_FOLDER, Home
from odtd.store.database import Store, utc_now
from odtd.store.schema import UNLABELLED

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"}
# One sample in this many (chosen by content hash, so it is stable) is held out of training to
# measure accuracy on the device's own data.
DEFAULT_HOLDOUT_EVERY = 8


@dataclass
class IngestReport:
    """What one ingest did; ``as_dict`` is the ``--json`` output of ``odtctl ingest``.

    Attributes:
        accepted: samples stored, and unlabelled samples this ingest gave a label.
        duplicates: files whose image was stored already (or pruned), with nothing to add.
        rejected: files quarantined (``rejected_files``: each one's path and reason).
        holdout: of ``accepted``, the labelled samples held out for evaluation.
        unlabelled: of ``accepted``, the samples stored without a label.
        labelled_later: of ``accepted``, samples stored unlabelled before that this ingest
            labelled.
    """

    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    holdout: int = 0
    unlabelled: int = 0
    labelled_later: int = 0
    rejected_files: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Return the JSON contract of ``odtctl ingest --json``."""
        return {"accepted": self.accepted, "duplicates": self.duplicates,
                "rejected": self.rejected, "holdout": self.holdout,
                "unlabelled": self.unlabelled, "labelled_later": self.labelled_later,
                "rejected_files": self.rejected_files}


def discover(path: Path, label: Optional[str]) -> list[tuple[Path, Optional[str]]]:
    """List (file, label) pairs from a file, a ``<label>/<file>`` directory or a CSV manifest.

    Raises:
        IngestError: the path does not exist, cannot be read, or a single file has no label.
    """
    if not path.exists():
        raise IngestError(f"{path}: no such file or directory")
    if not os.access(path, os.R_OK):
        raise IngestError(f"{path}: permission denied")
    if path.is_dir():
        return _discover_dir(path, label)
    if path.suffix.lower() == ".csv":
        return _discover_csv(path)
    if not label:
        raise IngestError(f"{path}: a single file needs --label (one of the model's classes)")
    return [(path, label)]


def discover_unlabelled(path: Path) -> list[tuple[Path, Optional[str]]]:
    """List (file, ``UNLABELLED_FOLDER``) pairs: one image, or a folder's files at any depth.

    Raises:
        IngestError: the path does not exist or cannot be read, or is a CSV manifest (which
            gives labels).
    """
    if not path.exists():
        raise IngestError(f"{path}: no such file or directory")
    if not os.access(path, os.R_OK):
        raise IngestError(f"{path}: permission denied")
    if path.is_file():
        if path.suffix.lower() == ".csv":
            raise IngestError(f"{path}: a CSV manifest gives labels; --unlabelled takes a folder "
                              "of images or one image")
        return [(path, UNLABELLED_FOLDER)]
    try:
        files = sorted(item for item in path.rglob("*") if item.is_file() and not any(
            part.startswith(".") for part in item.relative_to(path).parts))
    except OSError as exc:
        raise IngestError(f"{path}: cannot list directory ({exc.strerror})") from None
    return [(item, UNLABELLED_FOLDER) for item in files]


def _discover_dir(path: Path, label: Optional[str]) -> list[tuple[Path, Optional[str]]]:
    found: list[tuple[Path, Optional[str]]] = []
    try:
        entries = sorted(path.iterdir())
    except OSError as exc:
        raise IngestError(f"{path}: cannot list directory ({exc.strerror})") from None
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            for item in sorted(entry.rglob("*")):
                if item.is_file() and not item.name.startswith("."):
                    found.append((item, entry.name))
        elif entry.is_file():
            # Loose files: they belong to --label, or have none and are quarantined as such.
            found.append((entry, label))
    return found


def _discover_csv(path: Path) -> list[tuple[Path, Optional[str]]]:
    found: list[tuple[Path, Optional[str]]] = []
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise IngestError(f"{path}: cannot read the CSV manifest ({exc})") from None
    for number, row in enumerate(rows, start=1):
        if not row or row[0].startswith("#"):
            continue
        if number == 1 and [c.strip().lower() for c in row[:2]] == ["path", "label"]:
            continue
        if len(row) < 2:
            raise IngestError(f"{path}:{number}: expected 'path,label', got {','.join(row)!r}")
        file_path = Path(row[0].strip())
        if not file_path.is_absolute():
            file_path = path.parent / file_path
        found.append((file_path, row[1].strip() or None))
    return found


class Ingestor:
    """Turns files into samples of one home.

    Args:
        home: the state directory.
        store: its open database.
        classes: the model's class names (any other label is rejected).
        input_size: (width, height) the model takes, in pixels.
        holdout_every: one in N samples (by hash) is held out for evaluation; 0 disables.
        channels: the model's channels, 3 (RGB) or 1 (greyscale).
        resize: ``stretch``, ``crop`` or ``pad``: ``odtd.yaml``'s ``images.resize``.
        antialias: ``odtd.yaml``'s ``images.antialias``.
        storage: ``odtd.yaml``'s ``storage``: an ingest that would take the disk below its
            floor refuses (``home.disk``); None = no floor.

    `for_home` builds one from a home's model and ``odtd.yaml``.

    Raises:
        ValueError: channels other than 1 or 3, or an unknown ``resize``.
    """

    def __init__(
        self,
        home: Home,
        store: Store,
        classes: list[str],
        input_size: tuple[int, int],
        holdout_every: int = DEFAULT_HOLDOUT_EVERY,
        *,
        channels: int = 3,
        resize: str = "stretch",
        antialias: bool = False,
        storage: Optional[StorageConfig] = None,
    ) -> None:
        self.home = home
        self.store = store
        self.classes = set(classes)
        self.class_list = list(classes)
        self.input_size = input_size
        self.input_shape = check_fit((input_size[1], input_size[0], channels), resize)
        self.resize = resize
        self.antialias = antialias
        self.holdout_every = holdout_every
        self.storage = storage

    @classmethod
    def for_home(cls, home: Home, store: Store, config: Optional[Config] = None,
                 holdout_every: int = DEFAULT_HOLDOUT_EVERY) -> Ingestor:
        """Return the ingestor of an initialised home.

        Args:
            home: the state directory.
            store: its open database, whose meta holds the model's classes and input shape.
            config: the home's ``odtd.yaml`` (read from the home when None): ``images``.
            holdout_every: as in `Ingestor`.

        Raises:
            ConfigError: ``odtd.yaml`` is invalid (only when ``config`` is None).
        """
        height, width, channels = store.meta("input_shape")
        config = config or home.load_config()
        return cls(home, store, store.meta("classes"), (width, height), holdout_every,
                   channels=channels, resize=config.images.resize,
                   antialias=config.images.antialias, storage=config.storage)

    def ingest(
        self,
        files: Iterable[tuple[Path, Optional[str]]],
        day: Optional[str] = None,
        move: bool = False,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> IngestReport:
        """Ingest (file, label) pairs stamped with ``day`` (default: today, local time).

        Args:
            files: pairs from ``discover`` or ``discover_unlabelled``.
            day: YYYY-MM-DD the samples belong to.
            move: remove each source after it is stored or quarantined (the inbox);
                otherwise sources are left untouched (``odtctl ingest``).
            progress: called with (done, total) every 100 files.

        Raises:
            StorageError: the disk would go below ``storage.min_free_mb`` (checked first:
                nothing is written), or filled up, or is read-only: every sample stored before
                is whole, the file at hand and the rest are where they were.
        """
        day = day or date.today().isoformat()
        files = list(files)
        if self.storage is not None and files:
            check_room_for_ingest(self.home, self.store, self.storage, [p for p, _ in files],
                                  self.input_shape)
        report = IngestReport()
        with ingest_lock(self.home.ingest_lock):
            for done, (path, label) in enumerate(files, start=1):
                try:
                    self._ingest_one(path, label, day, move, report)
                except OSError as exc:
                    if exc.errno not in STORAGE_ERRNOS:
                        raise
                    raise StorageError(f"{storage_error(exc)}; {report.accepted} of {len(files)} "
                                       "files were stored, the rest were left where they are"
                                       ) from None
                if progress and (done % 100 == 0 or done == len(files)):
                    progress(done, len(files))
        return report

    def _ingest_one(self, path: Path, label: Optional[str], day: str, move: bool,
                    report: IngestReport) -> None:
        try:
            data = path.read_bytes()
        except OSError as exc:
            self._reject(path, f"cannot read ({exc.strerror})", move, report)
            return
        unlabelled = label == UNLABELLED_FOLDER
        if not unlabelled and label not in self.classes:
            known = ", ".join(self.class_list)
            reason = f"unknown label {label!r} (known: {known})" if label else "no label"
            self._reject(path, reason, move, report, data)
            return
        sha = hashlib.sha256(data).hexdigest()
        if self.store.has_sample(sha, labelled=not unlabelled):
            self._stored_before(sha, None if unlabelled else label, report)
            if move:
                path.unlink()
            return
        try:
            pixels = decode_image(data, self.input_shape, self.resize, self.antialias)
        except BadImage as exc:
            self._reject(path, str(exc), move, report, data)
            return
        folder = self.home.samples / sha[:2]
        folder.mkdir(parents=True, exist_ok=True)
        suffix = path.suffix.lower() if path.suffix.lower() in IMAGE_SUFFIXES else ".img"
        stored = folder / f"{sha}{suffix}"
        array = folder / f"{sha}.npy"
        try:
            _write_sample_files(stored, data, array, pixels)
        except OSError as exc:
            # else a concurrent ingest's row owns them
            if not self.store.has_sample(sha, labelled=not unlabelled):
                stored.unlink(missing_ok=True)
                array.unlink(missing_ok=True)
            raise OSError(exc.errno, exc.strerror, exc.filename or str(folder)) from None
        status = UNLABELLED if unlabelled else self._labelled_status(sha)
        added = self.store.add_sample({
            "sha256": sha, "label": None if unlabelled else label, "day": day, "status": status,
            "original_path": str(path), "stored_path": str(stored.relative_to(self.home.root)),
            "array_path": str(array.relative_to(self.home.root)),
            "width": pixels.shape[1], "height": pixels.shape[0], "ingested_at": utc_now(),
        })
        if not added:  # a concurrent ingest stored the same content first
            self._stored_before(sha, None if unlabelled else label, report)
        else:
            report.accepted += 1
            report.holdout += status == "holdout"
            report.unlabelled += status == UNLABELLED
        if move:
            path.unlink()

    def _labelled_status(self, sha: str) -> str:
        """``holdout`` for one labelled sample in ``holdout_every`` (by hash: stable), else pending."""
        held_out = self.holdout_every and int(sha[:8], 16) % self.holdout_every == 0
        return "holdout" if held_out else "pending"

    def _stored_before(self, sha: str, label: Optional[str], report: IngestReport) -> None:
        """Count an image stored before: labelled now, or a duplicate.

        Labelled now when it was stored without a label and ``label`` is a class.
        """
        status = self._labelled_status(sha)
        if label is not None and self.store.label_sample(sha, label, status):
            report.accepted += 1
            report.labelled_later += 1
            report.holdout += status == "holdout"
        else:
            report.duplicates += 1

    def _reject(self, path: Path, reason: str, move: bool, report: IngestReport,
                data: Optional[bytes] = None) -> None:
        self.home.quarantine.mkdir(parents=True, exist_ok=True)
        stamp = utc_now().replace(":", "").replace("+0000", "Z")
        target = self.home.quarantine / f"{stamp}-{report.rejected:04d}-{path.name}"
        try:
            if move:
                shutil.move(str(path), target)
            elif data is not None:
                target.write_bytes(data)
            else:
                target = None
            if target is not None:
                target.with_name(target.name + ".reason.txt").write_text(reason + "\n", encoding="utf-8")
        except OSError as exc:
            logger.warning("could not quarantine %s: %s", path, exc)
            target = None
        self.store.add_quarantine(str(path), str(target) if target else None, reason)
        report.rejected += 1
        report.rejected_files.append({"path": str(path), "reason": reason})
        logger.info("quarantined %s: %s", path, reason)


def _write_sample_files(stored: Path, data: bytes, array: Path, pixels: np.ndarray) -> None:
    """Write a sample's files and flush them, before its row commits.

    Flushed first: the row's commit is durable (``synchronous=FULL``) and, from the inbox,
    the source is deleted once it is; a power cut must not leave a row whose files were still
    in the page cache. Content-addressed names: a killed ingest's leftover is overwritten by
    the same content, or removed by ``repair``.
    """
    with open(stored, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    with open(array, "wb") as handle:
        np.save(handle, pixels, allow_pickle=False)
        handle.flush()
        os.fsync(handle.fileno())
    atomic.fsync(stored.parent)


def load_sample_arrays(
    home: Home, rows: list[dict[str, Any]], classes: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Stack the decoded pixels of sample rows into (x uint8 NHWC, y int64)."""
    index = {name: i for i, name in enumerate(classes)}
    if not rows:
        return np.zeros((0, 0, 0, 3), dtype=np.uint8), np.zeros((0,), dtype=np.int64)
    x = np.stack([np.load(home.root / row["array_path"], allow_pickle=False) for row in rows])
    y = np.array([index[row["label"]] for row in rows], dtype=np.int64)
    return x, y
