"""Real filesystems for the tests: a small tmpfs, an ext4 image on a loop device, bind mounts.

Mounting needs root (CI runs as root). Each context manager unmounts however the test ends
(lazily if a process of a failed test still holds the mount); where the machine refuses the
mount, the test is skipped with one line.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

MB = 1024 * 1024


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60)


def _mount_or_skip(what: str, *args: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"mounting {what} needs root (CI runs as root)")
    done = _run("mount", *args)
    if done.returncode:
        pytest.skip(f"cannot mount {what} here: {done.stderr.strip()}")


def unmount(path: Path) -> None:
    """Unmount ``path``; lazily when busy (a process of a failed test still holds it)."""
    if _run("umount", str(path)).returncode:
        _run("umount", "-l", str(path))


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: float) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` at ``path`` (a filesystem other than the temporary directory's)."""
    path.mkdir(parents=True, exist_ok=True)
    _mount_or_skip("a tmpfs", "-t", "tmpfs", "-o", f"size={int(size_mb * 1024)}k", "tmpfs", str(path))
    try:
        yield path
    finally:
        unmount(path)


@contextlib.contextmanager
def ext4_image(path: Path, size_mb: int) -> Iterator[Path]:
    """An ext4 filesystem in a file, on a loop device at ``path``, remounted read-only on errors.

    As an SD card's root or data filesystem is (``errors=remount-ro``): `fs_error` makes the
    kernel do it, as after an I/O error.
    """
    image = path.with_name(path.name + ".img")
    with open(image, "wb") as handle:
        handle.truncate(size_mb * MB)
    made = _run("mkfs.ext4", "-q", "-F", str(image))
    if made.returncode:
        pytest.skip(f"cannot make an ext4 image here: {made.stderr.strip()}")
    path.mkdir(parents=True, exist_ok=True)
    _mount_or_skip("an ext4 image on a loop device", "-o", "loop,errors=remount-ro", str(image),
                   str(path))
    try:
        yield path
    finally:
        unmount(path)  # the loop device goes with it (mount -o loop sets autoclear)
        image.unlink(missing_ok=True)


def fs_error(path: Path) -> None:
    """Make the kernel record an ext4 error on ``path``'s filesystem: it goes read-only."""
    source = _run("findmnt", "-n", "-o", "SOURCE", "--target", str(path)).stdout.strip()
    trigger = Path("/sys/fs/ext4") / Path(source).name / "trigger_fs_error"
    if not trigger.exists():
        pytest.skip(f"{trigger}: this kernel cannot inject an ext4 error")
    trigger.write_text("odtd test: as after an I/O error\n")


def remount(path: Path, options: str) -> None:
    """``mount -o remount,OPTIONS path`` (``ro``, ``rw``)."""
    done = _run("mount", "-o", f"remount,{options}", str(path))
    assert done.returncode == 0, done.stderr


@contextlib.contextmanager
def bind(source: Path, target: Path) -> Iterator[Path]:
    """``source`` bind-mounted at ``target``: unmounting it is a disk pulled out."""
    target.mkdir(parents=True, exist_ok=True)
    _mount_or_skip("a bind mount", "--bind", str(source), str(target))
    try:
        yield target
    finally:
        if os.path.ismount(target):
            unmount(target)


def free_bytes(path: Path) -> int:
    """Bytes free on ``path``'s filesystem, for a non-root user, as odtd measures them."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def fill(path: Path, leave_bytes: int) -> Path:
    """Write a ballast file on ``path``'s filesystem so that about ``leave_bytes`` stay free."""
    ballast = path / "ballast"
    size = max(0, free_bytes(path) - leave_bytes)
    with open(ballast, "wb") as handle:
        handle.write(b"\0" * size)
    return ballast
