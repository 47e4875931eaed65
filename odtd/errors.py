"""The errors odtd raises, and filesystem errors as one line each.

The library raises; only the ``odtd.cli`` package and ``odtd.daemon.service`` print, translating an
``OdtdError`` into one ``Error: ...`` line and a non-zero exit status.
"""

import errno
import os
import sqlite3


class OdtdError(Exception):
    """Base of every error odtd reports to a person.

    The message says what failed, the offending value, and the fix.
    """


class ConfigError(OdtdError):
    """The daemon configuration (``odtd.yaml``) or a command-line value is invalid."""


class PolicyError(OdtdError):
    """A policy file is invalid or a session is not admissible under it."""


class StoreError(OdtdError):
    """The state directory or its SQLite database cannot be used."""


class IngestError(OdtdError):
    """An ingest source cannot be read at all (single bad files are quarantined instead)."""


class ModelError(OdtdError):
    """A model name, weights file or model version is unknown or damaged."""


class StorageError(OdtdError):
    """The home's filesystem is full, read-only, gone, or refuses access (``odtd.home.disk``)."""


class TelemetryUnavailable(OdtdError):
    """A telemetry backend cannot run on this machine; the message says why and the fix."""


class TrainerFailed(OdtdError):
    """The trainer worker crashed, was killed, timed out or reported an error.

    Attributes:
        oom: the worker ran out of memory (TensorFlow's ResourceExhausted, MemoryError, or the
            kernel's OOM killer), so a smaller batch may succeed.
    """

    def __init__(self, message: str, oom: bool = False) -> None:
        super().__init__(message)
        self.oom = oom


class SessionBusy(OdtdError):
    """Another session already holds the session lock."""


class DaemonUnavailable(OdtdError):
    """No daemon answers on the control socket."""


# What each filesystem error means for a home, and its fix (`storage_error`).
_STORAGE_FIXES = {
    errno.ENOSPC: "free space on that disk, or let odtd prune more (storage.prune in odtd.yaml); "
                  "`odtctl status` shows the free space and what was pruned",
    errno.EDQUOT: "raise the disk quota of the user odtd runs as, or free space under it",
    errno.EROFS: "the filesystem is read-only (an SD card or disk is remounted so after I/O "
                 "errors): check the disk (dmesg), repair it (fsck) and mount it read-write",
    errno.EIO: "the disk failed or was removed: check that it is mounted and healthy (dmesg)",
    errno.ENODEV: "the disk was removed: mount it again",
    errno.EXDEV: "a rename crossed filesystems; this is a bug in odtd, please report it",
    errno.EACCES: "give the user odtd runs as read and write access (docs/jetson.md, Groups "
                  "and permissions), or run odtctl as that user",
    errno.EPERM: "give the user odtd runs as read and write access (docs/jetson.md, Groups "
                 "and permissions), or run odtctl as that user",
}
STORAGE_ERRNOS = frozenset(_STORAGE_FIXES)


def storage_error(error: OSError) -> StorageError:
    """One line for a filesystem error: the path, what happened and the fix.

    ``[Errno 28] No space left on device: '/data/odtd/runs/session-4/train.npz'`` becomes
    ``/data/odtd/runs/session-4/train.npz: no space left on device (ENOSPC); free space on that
    disk, ...``.
    """
    where = error.filename if error.filename is not None else "the home"
    if error.filename2 is not None:
        where = f"{where} -> {error.filename2}"
    code = errno.errorcode.get(error.errno or 0, f"errno {error.errno}")
    what = (error.strerror or str(error)).lower()
    fix = _STORAGE_FIXES.get(error.errno, "check the disk and the permissions of the home")
    return StorageError(f"{where}: {what} ({code}); {fix}")


def as_odtd_error(error: BaseException, database: "os.PathLike[str] | str | None" = None
                  ) -> "OdtdError | None":
    """The `OdtdError` to report for ``error``: itself, a filesystem error's one line, or None.

    SQLite's errors for a full, read-only or failing disk outside a transaction (a read that
    meets a disk I/O error) carry no path: they are judged and named by ``database``, the
    home's ``odtd.db`` (without it, one in the working directory).
    """
    if isinstance(error, OdtdError):
        return error
    if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
        return storage_error(error)
    if isinstance(error, sqlite3.OperationalError):
        return sqlite_storage_error(error, os.fspath(database) if database else "odtd.db")
    return None


def failure_reason(error: BaseException, doing: str = "",
                   database: "os.PathLike[str] | str | None" = None) -> str:
    """Why a session failed, for its record: an odtd error's line, else ``internal error: ...``.

    ``doing`` names the step (``accepting the candidate``): ``internal error while accepting
    the candidate: ...``; ``database`` is ``as_odtd_error``'s.
    """
    reported = as_odtd_error(error, database)
    during = f" while {doing}" if doing else ""
    if reported is not None:
        return f"{reported}{f' ({during.strip()})' if doing else ''}"
    return f"internal error{during}: {error!r}"


# SQLite's messages for a home whose disk is full, read-only or gone (sqlite3 in Python 3.8 has
# no error codes on its exceptions): the filesystem error each stands for.
_SQLITE_STORAGE = (("database or disk is full", errno.ENOSPC),
                   ("attempt to write a readonly database", errno.EROFS),
                   ("disk I/O error", errno.EIO), ("unable to open database file", errno.EIO))


# Below this, SQLite cannot grow its ``-shm`` index (32 KiB at a time) nor append to its log.
FULL_DISK_BYTES = 1 << 20


def disk_full(path: str) -> bool:
    """Whether the filesystem that holds ``path`` has less than `FULL_DISK_BYTES` free."""
    try:
        stats = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < FULL_DISK_BYTES


def sqlite_storage_error(error: Exception, path: str) -> "StorageError | None":
    """The `storage_error` a SQLite error on ``path`` stands for, or None if it is none of those.

    A database SQLite may not write is either on a read-only filesystem or the user's lacks
    write access: the message says which it is. On a disk with no room left, SQLite reports
    "disk I/O error" (it could not extend its ``-shm`` file) or, for a database it opened for
    reading only, "readonly database": both are the full disk.
    """
    for text, code in _SQLITE_STORAGE:
        if text in str(error):
            if disk_full(path):
                code = errno.ENOSPC
            if code == errno.EROFS and not os.access(path, os.W_OK) and \
                    not os.statvfs(os.path.dirname(path) or ".").f_flag & os.ST_RDONLY:
                code = errno.EACCES if os.path.exists(path) else code
            return storage_error(OSError(code, os.strerror(code), path))
    return None
