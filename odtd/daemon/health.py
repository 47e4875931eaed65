"""The home's disk as the daemon sees it: there, writable, above its floor.

An SD card the kernel remounted read-only after I/O errors, a USB disk pulled out, a disk
that filled up: the daemon keeps running through all three (under systemd a crash would only
restart it into the same disk, again and again). Each heartbeat (``Daemon.heartbeat``) writes
the liveness row; `DiskHealth` turns a write that failed into one line naming the path and the
fix, logs it once (and once more when it clears), shows it in systemd's ``STATUS=`` line, and
tells the daemon to hold sessions and inbox scans until a heartbeat writes again. The free
space below ``storage.min_free_mb`` is reported the same way (ingest and sessions then refuse
by themselves, ``home.disk``). Standard library only, as the idle daemon is.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from typing import Any, Optional

from odtd.config import StorageConfig
from odtd.errors import OdtdError, sqlite_storage_error, storage_error
from odtd.home.disk import MB, disk_space, mb, writable_problem
from odtd.home.paths import Home
from odtd.store.liveness import Liveness

logger = logging.getLogger(__name__)


class DiskHealth:
    """What is wrong with a home's disk right now, if anything; the daemon's writes to it.

    Args:
        home: the daemon's state directory.

    Raises:
        StoreError: ``odtd.db`` cannot be opened.
    """

    def __init__(self, home: Home) -> None:
        self.home = home
        self.liveness = Liveness(home.db_path)
        self.problem: Optional[str] = None  # the home cannot be written: sessions wait
        self.low: Optional[str] = None  # below the floor: ingest and sessions refuse
        self._identity = self.db_identity()

    def write_daemon(self, **fields: Any) -> bool:
        """Write the liveness row; False (the problem noted) if the home refuses the write."""
        if not self.home.db_path.exists():  # its disk pulled out: the open file still takes writes
            self.write_failed(FileNotFoundError(errno.ENOENT, "no odtd.db", str(self.home.db_path)))
            return False
        if self.moved():  # the disk came back: the open connection is to the file before
            self.reopen()
        try:
            self.liveness.write_daemon(**fields)
        except (sqlite3.Error, OSError):
            self.reopen()  # one opened read-only, or to a disk since pulled out: a fresh one
            try:
                self.liveness.write_daemon(**fields)
            except (sqlite3.Error, OSError) as exc:
                self.write_failed(exc)
                return False
        return True

    def log_event(self, kind: str, message: str, **data: Any) -> None:
        """Append an event; on a home that refuses it, the problem is noted instead."""
        try:
            self.liveness.log_event(kind, message, **data)
        except (sqlite3.Error, OSError) as exc:
            self.write_failed(exc)

    def reopen(self) -> None:
        """Open ``odtd.db`` again: after a failure, or a disk removed and mounted again."""
        try:
            fresh = Liveness(self.home.db_path)
        except OdtdError as exc:
            logger.debug("cannot reopen %s yet: %s", self.home.db_path, exc)
            return
        self.close()
        self.liveness = fresh

    def close(self) -> None:
        """Close the connection."""
        try:
            self.liveness.close()
        except sqlite3.Error as exc:
            logger.debug("closing %s: %s", self.home.db_path, exc)

    def db_identity(self) -> Optional[tuple[int, int]]:
        """(device, inode) of ``odtd.db``, None if it is gone."""
        try:
            stat = os.stat(self.home.db_path)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino

    def moved(self) -> bool:
        """Whether ``odtd.db`` is another file than the one opened (its disk came back)."""
        identity = self.db_identity()
        if identity is None or identity == self._identity:
            return False
        self._identity = identity
        return True

    def write_failed(self, error: BaseException) -> None:
        """A write to the home failed: find out why (gone, read-only, ...) and say so once."""
        problem = writable_problem(self.home)
        if problem is None:
            reported = sqlite_storage_error(error, str(self.home.db_path)) \
                if isinstance(error, sqlite3.Error) else \
                storage_error(error) if isinstance(error, OSError) else None
            problem = str(reported or f"{self.home.db_path}: cannot write ({error})")
        if problem != self.problem:
            logger.error("%s; sessions and inbox scans wait, the daemon retries every heartbeat",
                         problem)
        self.problem = problem

    def write_succeeded(self) -> bool:
        """A heartbeat was written; True if that ends a problem (logged once)."""
        if self.problem is None:
            return False
        logger.warning("the home can be written again (was: %s); sessions resume", self.problem)
        self.problem = None
        return True

    def check_space(self, storage: StorageConfig) -> None:
        """Note (and log once) whether the free space is below ``storage.min_free_mb``."""
        try:
            space = disk_space(self.home.root)
        except OSError as exc:
            logger.debug("cannot measure %s: %s", self.home.root, exc)
            return
        floor = storage.min_free_mb * MB
        low = None
        if space.free_bytes < floor:
            low = (f"{mb(space.free_bytes)} free on the filesystem of {space.path}, below the "
                   f"{mb(floor)} of storage.min_free_mb: ingest refuses, sessions that do not "
                   "fit are skipped")
        if (low is None) != (self.low is None):
            if low:
                logger.warning("%s; free space on that disk", low)
            else:
                logger.info("the home's disk is above its floor again (%s free)",
                            mb(space.free_bytes))
        self.low = low

    def status(self, idle: str) -> str:
        """Systemd's ``STATUS=`` line: the problem first, else the space, else ``idle``."""
        if self.problem:
            return f"storage: {self.problem}"
        if self.low:
            return f"{idle}; storage: {self.low}"
        return idle
