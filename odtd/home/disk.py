"""The home's disk: free space, the floor odtd keeps, what a write needs, and room made by pruning.

A device's disk fills up (a camera keeps writing, nobody is watching). odtd keeps
``storage.min_free_mb`` free on the home's filesystem (``odtd.yaml``, ``config.StorageConfig``):
an ingest that would go below it refuses, with the free and the needed space, before it writes
anything; a session predicts what it will write (its job data, the candidate) and is skipped
with that reason when it does not fit, instead of failing half-way through the night.

Before refusing, odtd prunes what ``storage.prune`` allows, in this order, until the write
fits: ``runs`` (the oldest ``runs/`` folders: job files and worker logs of finished sessions
and profiles), ``unlabelled`` (the oldest unlabelled samples beyond the newest
``store.samples.UNLABELLED_READ`` a session reads), ``versions`` (model versions beyond the
policy's ``models.keep_versions``), ``samples`` (the oldest trained samples that neither the
replay buffer nor a session's BatchNorm adaptation reads). Never the served model, its parent,
a pending or held-out sample, an unlabelled one a session reads, or the replay buffer. Pruning
holds the session lock: it never runs beside a session.
Each pruning is an event (``kind = 'pruned'``) that ``odtctl status`` and the metrics show.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from odtd import atomic
from odtd.config import PRUNE_ORDER, StorageConfig
from odtd.errors import OdtdError, SessionBusy, StorageError, storage_error
from odtd.home.lock import SessionLock
from odtd.home.paths import Home
from odtd.store.samples import DEVICE_READ, UNLABELLED_READ

if TYPE_CHECKING:  # the daemon measures its disk without loading the store (sqlite-utils, numpy)
    from odtd.store.database import Store

logger = logging.getLogger(__name__)

MB = 1024 * 1024
# What a session writes besides its data and candidate: job.json, the worker's log, the eval
# cache, its rows and the WAL's growth. Measured below 0.3 MB for tinycnn; DenseNet40's eval
# cache adds 17 bytes per evaluation image.
SESSION_MARGIN_BYTES = 2 * MB
NPY_HEADER_BYTES = 128
VERSION_BYTES = 8192  # a version's directory and manifest, in 4 KB blocks
# A runs/ folder younger than this may belong to a profile or an export still at work.
RUNS_MIN_AGE_S = 3600.0


@dataclass(frozen=True)
class DiskSpace:
    """Free and total bytes of the filesystem that holds a path (for a non-root user)."""

    path: Path
    free_bytes: int
    total_bytes: int


def disk_space(path: Path) -> DiskSpace:
    """Measure the filesystem of ``path`` (of its nearest existing parent, if it is missing)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stat = os.statvfs(probe)
    return DiskSpace(probe, stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize)


def mb(size_bytes: float) -> str:
    """Bytes as '12.3 MB' (1024 * 1024 bytes), or '31 KB' below a tenth of a MB."""
    return f"{size_bytes / MB:.1f} MB" if size_bytes >= MB / 10 else f"{size_bytes / 1024:.0f} KB"


@dataclass
class Need:
    """What a write will add to the disk, by part (bytes)."""

    parts: dict[str, int]

    @property
    def total_bytes(self) -> int:
        """The sum of the parts."""
        return sum(self.parts.values())

    def describe(self) -> str:
        """'15.1 MB (job data 13.9 MB, candidate 1.2 MB)'."""
        parts = ", ".join(f"{name} {mb(size)}" for name, size in self.parts.items() if size)
        return f"{mb(self.total_bytes)} ({parts})"


def ingest_need(files: Sequence[Path], input_shape: Sequence[int], block_bytes: int = 4096) -> Need:
    """An ingest's writes: each file's bytes as given, and its decoded pixels (uint8 ``.npy``).

    Each file takes whole blocks of the filesystem (``block_bytes``): a 12.5 KB PNG takes
    16 KB of a 4 KB-block filesystem, and a 32x32 image's 3.2 KB of pixels 4 KB.
    """
    given = 0
    for path in files:
        try:
            given += _blocks(path.stat().st_size, block_bytes)
        except OSError:  # unreadable: it is quarantined, not stored
            continue
    pixels = len(files) * _blocks(math.prod(input_shape) + NPY_HEADER_BYTES, block_bytes)
    return Need({"images": given, "decoded pixels": pixels})


def _blocks(size_bytes: int, block_bytes: int) -> int:
    return -(-size_bytes // block_bytes) * block_bytes


def session_need(home: Home, store: Store, samples: int, weights: Path,
                 device_images: int = 0, unlabelled: bool = False,
                 copies_weights: bool = False) -> Need:
    """A session's writes: its job data, the candidate, the version and the rest.

    Args:
        home: the state directory.
        store: its database (the input shape, the held-out samples).
        samples: the samples it trains on (new and rehearsed).
        weights: the current version's weights file (the candidate is the same size; promoted,
            it becomes the new version by a rename, not a copy).
        device_images: the device's earlier images the train file adds for BatchNorm
            adaptation, distillation, the class priors (at most ``DEVICE_READ``).
        unlabelled: whether it adds the images without a label (the class priors' EM, the
            pseudo-labels: the newest ``UNLABELLED_READ``).
        copies_weights: whether a new version may be a copy of the served weights (the class
            priors estimated anew where the candidate is refused: ``prior_correction``).
    """
    pixels = math.prod(store.meta("input_shape"))
    counts = store.sample_counts()
    unlabelled_images = min(counts["unlabelled"], UNLABELLED_READ) if unlabelled else 0
    # uint8 pixels, an int64 label and a bool device flag per training sample; the device's
    # earlier images with their labels.
    train = samples * (pixels + 9) + device_images * (pixels + 8) + unlabelled_images * pixels
    evaluation = sum(_size(path) for path in (home.validation_file(), home.reference_file()))
    evaluation += counts["holdout"] * (pixels + 16)
    # Promoted, the candidate becomes the version by a rename: a new version adds its
    # directory and manifest, not a second copy of the weights.
    # ...unless it is the served weights with another offset: a copy, the candidate kept.
    version = VERSION_BYTES + (_size(weights) if copies_weights else 0)
    return Need({"job data": train + evaluation, "candidate": _size(weights),
                 "version": version, "logs and records": SESSION_MARGIN_BYTES})


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@dataclass
class Pruned:
    """What one pruning deleted."""

    runs: int = 0
    versions: list[int] = field(default_factory=list)
    samples: int = 0
    unlabelled: int = 0
    freed_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.runs or self.versions or self.samples or self.unlabelled)

    def describe(self) -> str:
        """'3 runs/ folders, 900 unlabelled samples, versions v2 v3, 120 trained samples: 14.2 MB freed'."""
        parts = [f"{self.runs} runs/ folder{'s' * (self.runs != 1)}"] if self.runs else []
        if self.unlabelled:
            parts.append(f"{self.unlabelled} unlabelled sample{'s' * (self.unlabelled != 1)}")
        if self.versions:
            parts.append("versions " + " ".join(f"v{v}" for v in self.versions))
        if self.samples:
            parts.append(f"{self.samples} trained sample{'s' * (self.samples != 1)}")
        return f"{', '.join(parts) or 'nothing'}: {mb(self.freed_bytes)} freed"

    def to_dict(self) -> dict[str, Any]:
        """The event's data."""
        return {"runs": self.runs, "versions": self.versions, "samples": self.samples,
                "unlabelled": self.unlabelled, "freed_bytes": self.freed_bytes}


def make_room(home: Home, store: Store, storage: StorageConfig, need_bytes: int,
              keep_versions: Optional[int]) -> Pruned:
    """Prune what ``storage.prune`` allows, in `PRUNE_ORDER`, until ``need_bytes`` fit above the floor.

    The caller holds the session lock. ``keep_versions`` is the policy's ``models.keep_versions``
    (None: versions are not pruned). Records a ``pruned`` event when anything went.
    """
    floor = storage.min_free_mb * MB
    start = disk_space(home.root).free_bytes

    def shortfall() -> int:
        return int(max(0, floor + need_bytes - disk_space(home.root).free_bytes))

    def fits() -> bool:
        return shortfall() == 0

    pruned = Pruned()
    for kind in PRUNE_ORDER:
        if fits():
            break
        if kind not in storage.prune:
            continue
        if kind == "runs":
            pruned.runs = _prune_runs(home, store, fits)
        elif kind == "versions" and keep_versions is not None and store.meta("model"):
            from odtd.home.versions import prune

            pruned.versions = prune(home, store, keep=keep_versions)
        elif kind == "unlabelled":
            pruned.unlabelled = _prune_samples(
                home, store, shortfall, lambda limit: store.prunable_unlabelled(UNLABELLED_READ, limit))
        elif kind == "samples":
            pruned.samples = _prune_samples(
                home, store, shortfall, lambda limit: store.prunable_samples(DEVICE_READ, limit))
    pruned.freed_bytes = max(0, disk_space(home.root).free_bytes - start)
    if pruned:
        store.log_event("pruned", f"pruned {pruned.describe()} (storage.min_free_mb "
                        f"{storage.min_free_mb:g})", **pruned.to_dict())
        logger.info("pruned %s", pruned.describe())
    return pruned


def _prune_runs(home: Home, store: Store, fits: Callable[[], bool]) -> int:
    """Delete the oldest runs/ folders of finished work until ``fits()``; return how many."""
    running = {f"session-{record.id}" for record in store.running_sessions()}
    now = time.time()
    try:
        entries = [entry for entry in home.runs.iterdir() if entry.name not in running]
    except OSError:
        return 0
    stamped = []
    for entry in entries:
        try:
            age_s = now - entry.stat().st_mtime
        except OSError:
            continue
        if entry.name.startswith("session-") or age_s > RUNS_MIN_AGE_S:
            stamped.append((now - age_s, entry))
    removed = 0
    for _, entry in sorted(stamped):
        if fits():
            break
        atomic.remove_quietly(entry)
        removed += 1
    return removed


def _prune_samples(home: Home, store: Store, shortfall: Callable[[], int],
                   prunable: Callable[[int], list[dict[str, Any]]], batch: int = 500) -> int:
    """Delete the samples ``prunable(limit)`` gives, in its order, until ``shortfall()`` is 0.

    Returns how many went. The rows move first (one transaction per round), the files go after
    the commit: a crash in between leaves files without rows, which ``home.repair`` removes.
    """
    removed = 0
    while (missing := shortfall()) > 0:
        rows = prunable(batch)
        if not rows:
            break
        chosen, sizes, files, total = [], {}, [], 0
        for row in rows:  # the oldest first, as many as the shortfall takes
            paths = [home.root / row["stored_path"], home.root / row["array_path"]]
            sizes[row["sha256"]] = sum(_size(path) for path in paths)
            chosen.append(row)
            files += paths
            total += sizes[row["sha256"]]
            if total >= missing:
                break
        store.move_to_pruned(chosen, sizes)
        for path in files:
            path.unlink(missing_ok=True)
        removed += len(chosen)
    return removed


def refusal(space: DiskSpace, need: Need, storage: StorageConfig, what: str,
            pruned: Optional[Pruned]) -> str:
    """Why a write does not fit, with the free and needed space and the fix (one line)."""
    done = f"; pruned {pruned.describe()}" if pruned else ""
    more = "" if set(PRUNE_ORDER) <= set(storage.prune) else \
        ", allow odtd to prune more (storage.prune)"
    return (f"not enough disk space for {space.path}: {mb(space.free_bytes)} free, {what} "
            f"needs ~{need.describe()} above the {mb(storage.min_free_mb * MB)} that "
            f"storage.min_free_mb keeps free{done}; free space on that disk{more}, or lower "
            "storage.min_free_mb in odtd.yaml")


def room_for(home: Home, store: Store, storage: StorageConfig, need: Need, what: str,
             keep_versions: Callable[[], Optional[int]], locked: bool) -> Optional[str]:
    """None if ``need`` fits above the floor (after pruning if it must), else the refusal.

    Args:
        home: the state directory.
        store: its database.
        storage: ``odtd.yaml``'s ``storage``.
        need: what the write adds.
        what: the write, for the message ('this session', 'ingesting 120 files').
        keep_versions: gives the policy's ``models.keep_versions`` (None: versions stay),
            asked only if pruning is needed.
        locked: the caller holds the session lock; otherwise it is taken for the pruning
            (a session that holds it meanwhile prunes for itself: nothing is pruned here).
    """
    floor = storage.min_free_mb * MB
    space = disk_space(home.root)
    if space.free_bytes - need.total_bytes >= floor:
        return None
    pruned = None
    if storage.prune:
        try:
            if locked:
                pruned = make_room(home, store, storage, need.total_bytes, keep_versions())
            else:
                with SessionLock(home.session_lock):
                    pruned = make_room(home, store, storage, need.total_bytes, keep_versions())
        except SessionBusy:
            logger.info("not pruning: a session holds the lock")
        space = disk_space(home.root)
        if space.free_bytes - need.total_bytes >= floor:
            return None
    return refusal(space, need, storage, what, pruned)


def room_for_session(home: Home, store: Store, storage: StorageConfig, policy: Any,
                     rows: Sequence[dict[str, Any]], weights: Path) -> Optional[str]:
    """None if tonight's session fits on the disk (after pruning if it must), else why not.

    Called under the session lock, before the worker starts, so no night goes to a session
    that could not have written its candidate.

    Args:
        home: the state directory.
        store: its database.
        storage: ``odtd.yaml``'s ``storage``.
        policy: the active policy (``models.keep_versions``; what the train file carries:
            ``training.reads_device_images``, ``training.reads_unlabelled``; whether a
            version may copy the weights: ``training.prior_correction``).
        rows: the sample rows it trains on (new and rehearsed).
        weights: the current version's weights file.
    """
    training = policy.training
    need = session_need(home, store, len(rows), weights,
                        DEVICE_READ if training.reads_device_images else 0, training.reads_unlabelled,
                        training.prior_correction)
    return room_for(home, store, storage, need, "this session",
                    lambda: policy.models.keep_versions, locked=True)


def check_room_for_ingest(home: Home, store: Store, storage: StorageConfig,
                          files: Sequence[Path], input_shape: Sequence[int]) -> None:
    """Raise StorageError before an ingest that would take the disk below its floor.

    Raises:
        StorageError: the free and the needed space, and the fix; nothing was written and
            the files are where they were.
    """
    need = ingest_need(files, input_shape, os.statvfs(disk_space(home.root).path).f_bsize)
    reason = room_for(home, store, storage, need, f"ingesting {len(files)} files",
                      lambda: _keep_versions(home), locked=False)
    if reason:
        raise StorageError(f"{reason}; the files were left where they are")


def _keep_versions(home: Home) -> Optional[int]:
    """The policy's ``models.keep_versions``, or None (no version pruning) if it cannot be read."""
    from odtd.policy import load_policy

    try:
        return load_policy(home.policy_path(home.load_config())).models.keep_versions
    except OdtdError as exc:
        logger.debug("versions are not pruned: %s", exc)
        return None


def writable_problem(home: Home) -> Optional[str]:
    """None if the home can be written, else one line: gone, read-only or not ours.

    Creates and removes a small file in ``run/``: a filesystem the kernel remounted read-only
    after I/O errors still reports itself writable in ``statvfs``.
    """
    if not home.db_path.exists():
        return (f"{home.root}: no odtd home there (no odtd.db): if it lives on a data disk, "
                "mount it; else run `odtctl init`")
    probe = home.run / f".write-probe.{os.getpid()}"
    try:
        home.run.mkdir(exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"odtd")
        probe.unlink()
    except OSError as exc:  # named after the home, not the probe
        return str(storage_error(OSError(exc.errno, exc.strerror, str(home.root))))
    return None


def storage_status(home: Home, store: Store, storage: StorageConfig) -> dict[str, Any]:
    """The ``storage`` section of ``odtctl status``: free space, the floor, problems, pruning."""
    space = disk_space(home.root)
    floor = int(storage.min_free_mb * MB)
    events = store.events(limit=10_000, kind="pruned")
    totals = store.pruned_totals()
    last = events[0] if events else None
    freed = sum(json.loads(event["data"] or "{}").get("freed_bytes", 0) for event in events)
    return {
        "path": str(space.path), "free_bytes": space.free_bytes,
        "total_bytes": space.total_bytes, "min_free_bytes": floor,
        "below_floor": space.free_bytes < floor, "problem": writable_problem(home),
        "prune": list(storage.prune),
        "pruned": {"times": len(events), "freed_bytes": freed, "samples": totals["samples"],
                   "last_at": last["at"] if last else None,
                   "last": last["message"] if last else None},
    }

