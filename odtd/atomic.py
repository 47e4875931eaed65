"""Staged writes: a file is either its old content or its new one, never half of either.

Every file odtd replaces (model weights, the ``current`` pointer, manifests, exports, policies,
caches) is written under a hidden temporary name in the directory it goes to, flushed,
renamed over its target, and the directory flushed: a crash or a power cut leaves the old file
or the new one, and a full disk or a read-only filesystem fails the write before anything is
replaced, the temporary file removed. The temporary name sits beside the target because a
rename cannot cross filesystems (a home on a data disk of its own: ``EXDEV``); `move` copies
across when a file must come from elsewhere.

Temporary names are ``.STEM.PID.tmpSUFFIX`` (``.weights.812.tmp.npz``): hidden, so an inbox
scan skips them; per process, so two writers never share one; and ending in the target's
suffix, which writers that choose a format by name (numpy, Keras) need. `is_temporary` tells
them apart for the clean-up after a crash.

Standard library only and Python 3.6-compatible: the trainer worker uses it too.
"""

import contextlib
import errno
import os
import re
import shutil
import tempfile
from typing import Dict, Iterator, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]
_TEMPORARY = re.compile(r"^\..+\.(\d+)\.tmp(\.[^.]*)?$")


def temporary_name(path: PathLike) -> str:
    """The hidden, per-process name ``path`` is staged under, in its own directory."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    stem, suffix = os.path.splitext(name)
    if not stem:  # a dot-file such as ".env": no suffix to keep
        stem, suffix = name, ""
    return os.path.join(directory, f".{stem}.{os.getpid()}.tmp{suffix}")


def is_temporary(name: str) -> bool:
    """Whether a file name is one `temporary_name` gives (a crashed writer's leftover)."""
    return _TEMPORARY.match(name) is not None


def is_abandoned(name: str) -> bool:
    """Whether ``name`` is a temporary file of a process that is gone (a killed writer's)."""
    match = _TEMPORARY.match(name)
    return bool(match) and not pid_alive(int(match.group(1)))


def pid_alive(pid: Optional[int]) -> bool:
    """Whether a process with this pid exists (another user's counts; a zombie is gone)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return True


def fsync(path: PathLike) -> None:
    """Flush a file's content, or a directory's entries (a rename, a new or removed file), to disk.

    Through a read-only descriptor, which Linux flushes as well.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path: PathLike) -> None:
    """Remove a file or directory tree if it exists; a failure is left for the next clean-up."""
    path = os.fspath(path)
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:  # read-only or gone: whoever cleans up after a crash removes it later
        pass


@contextlib.contextmanager
def staged(path: PathLike, durable: bool = True) -> Iterator[str]:
    """Yield the temporary path to write ``path``'s new content to; replace ``path`` at the end.

    On a clean exit the file is flushed (``durable``), renamed over ``path`` and its directory
    flushed. On an exception (``ENOSPC``, ``EROFS``, a bug) the temporary file is removed and
    ``path`` is as it was.

    Args:
        path: the file to replace (or create).
        durable: flush file and directory, for state that must survive a power cut; False for
            files that only need readers never to see them half-written (metrics).
    """
    path = os.fspath(path)
    temporary = temporary_name(path)
    try:
        yield temporary
        if durable:
            fsync(temporary)
        os.replace(temporary, path)
    except BaseException:
        remove_quietly(temporary)
        raise
    if durable:
        fsync(os.path.dirname(os.path.abspath(path)))


def write_bytes(path: PathLike, data: bytes, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (see `staged`)."""
    with staged(path, durable) as temporary:
        with open(temporary, "wb") as handle:
            handle.write(data)


def write_text(path: PathLike, text: str, durable: bool = True) -> None:
    """Replace ``path`` with UTF-8 ``text`` (see `staged`)."""
    write_bytes(path, text.encode("utf-8"), durable)


def copy(source: PathLike, path: PathLike, durable: bool = True) -> None:
    """Replace ``path`` with a copy of ``source``, which may be on another filesystem."""
    with staged(path, durable) as temporary:
        shutil.copyfile(os.fspath(source), temporary)


def move(source: PathLike, path: PathLike, durable: bool = True) -> None:
    """Move the file ``source`` to ``path``: a rename, or across filesystems a copy, then removal.

    Raises:
        OSError: whatever the rename or the copy met (``ENOSPC``, ``EROFS``, ...); ``source``
            is then still there and ``path`` as it was.
    """
    try:
        os.replace(os.fspath(source), os.fspath(path))
    except OSError as error:
        if error.errno != errno.EXDEV:
            raise
        copy(source, path, durable)
        os.unlink(os.fspath(source))
        return
    if durable:
        fsync(os.path.dirname(os.path.abspath(os.fspath(path))))


@contextlib.contextmanager
def staged_directory(path: PathLike) -> Iterator[str]:
    """Yield a hidden directory to assemble the new directory ``path`` in; rename it there at the end.

    A directory appears whole or not at all (a model version: its weights and manifest). On a
    clean exit every file in it and the directory itself are flushed, it is renamed to ``path``
    (which must not exist, or be an empty directory) and the parent flushed; on an exception it
    is removed and ``path`` is as it was. Named as `temporary_name` names a file, so the
    clean-up after a crash (`is_abandoned`) finds a killed writer's.
    """
    path = os.fspath(path)
    temporary = temporary_name(path)
    os.mkdir(temporary)
    try:
        yield temporary
        for entry in os.scandir(temporary):
            if entry.is_file(follow_symlinks=False):
                fsync(entry.path)
        fsync(temporary)
        os.replace(temporary, path)
    except BaseException:
        remove_quietly(temporary)
        raise
    fsync(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def staging_dir(parent: PathLike, prefix: str) -> Iterator[str]:
    """A hidden directory under ``parent`` (created if missing), removed with its content at the end.

    Work staged here renames into ``parent``'s filesystem without a copy.
    """
    os.makedirs(os.fspath(parent), exist_ok=True)
    directory = tempfile.mkdtemp(prefix="." + prefix, dir=os.fspath(parent))
    try:
        yield directory
    finally:
        remove_quietly(directory)


@contextlib.contextmanager
def undone_on_failure(directory: PathLike) -> Iterator[None]:
    """Remove, when the block fails, every entry it created or replaced in ``directory``.

    An entry that was there before (the same inode) stays, and so does ``directory`` if it
    existed; one the block created is removed with its content, and ``directory`` too if the
    block created it. For work that makes many files (a new home) and must leave none half-made.
    """
    directory = os.fspath(directory)
    existed = os.path.exists(directory)
    before = _inodes(directory)
    try:
        yield
    except BaseException:
        for name, inode in _inodes(directory).items():
            if before.get(name) != inode:
                remove_quietly(os.path.join(directory, name))
        if not existed:
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise


def _inodes(directory: str) -> Dict[str, int]:
    try:
        return {entry.name: entry.inode() for entry in os.scandir(directory)}
    except OSError:  # missing, or unreadable: nothing in it is the block's to remove
        return {}
