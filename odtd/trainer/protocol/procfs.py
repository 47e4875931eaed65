"""What the trainer's processes read from ``/proc``, and the worker's watch on its parent.

Memory in MB (1024 * 1024 bytes) from ``/proc/meminfo`` and ``/proc/PID/status``, the kernel's
OOM-kill count, the CPU's name and flags, a process's parent, and ``watch_parent``: a worker, or
a child of the daemon, ends when the process that started it is gone. Standard library only,
Python 3.6-compatible: the daemon's children import this and nothing else of the worker.
"""

import logging
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

logger = logging.getLogger(__name__)

EXIT_PARENT_GONE = 3
PARENT_POLL_INTERVAL_S = 0.5


def read_proc_mb(key: str, path: Path = Path("/proc/meminfo")) -> Optional[float]:
    """A ``key: N kB`` field of a /proc file in MB, or None (no such field, or no such file).

    ``/proc/meminfo`` (``MemAvailable``, ``MemTotal``) or a process's ``/proc/PID/status``
    (``VmHWM``, ``RssAnon``; None once the process is gone).
    """
    try:
        with open(str(path), encoding="ascii") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        logger.debug("no %s in %s", key, path)
    return None


def read_oom_kills(vmstat: Path = Path("/proc/vmstat")) -> Optional[int]:
    """The kernel's count of OOM kills (``oom_kill`` in /proc/vmstat, Linux >= 4.13), or None."""
    try:
        for line in vmstat.read_text(encoding="ascii").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        logger.debug("no oom_kill counter in %s", vmstat)
    return None


def watch_parent(parent_pid: int, current_parent: Optional[Callable[[], Optional[int]]] = None
                 ) -> None:
    """Exit with status 3 when the parent process is no longer ``parent_pid``.

    Checks once now, then from a daemon thread every ``PARENT_POLL_INTERVAL_S``. On Linux it also
    asks the kernel for SIGKILL on parent death (``PR_SET_PDEATHSIG``), whichever comes first.
    That "parent" is the thread that spawned us (prctl(2)), so the spawning thread must live as
    long as the worker.

    Args:
        parent_pid: The process that must stay the parent.
        current_parent: Who the parent is now; default ``os.getppid``. A worker forked by the
            fork server (``forkserver``) passes its client's parent instead, and no
            ``PR_SET_PDEATHSIG`` is asked (its parent is the server).
    """
    if current_parent is None and sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
                print("odtd worker: prctl(PR_SET_PDEATHSIG) failed, errno {}; polling only".format(
                    ctypes.get_errno()), file=sys.stderr)
        except (OSError, AttributeError) as error:
            print("odtd worker: no prctl ({}); polling only".format(error), file=sys.stderr)

    def parent_gone() -> bool:
        if (os.getppid() if current_parent is None else current_parent()) == parent_pid:
            return False
        print("odtd worker: parent {} is gone, exiting".format(parent_pid), file=sys.stderr)
        return True

    def poll() -> None:
        while not parent_gone():
            time.sleep(PARENT_POLL_INTERVAL_S)
        os._exit(EXIT_PARENT_GONE)

    if parent_gone():
        sys.exit(EXIT_PARENT_GONE)
    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def peak_rss_mb(status_path: str = "/proc/self/status") -> float:
    """Return this process's peak resident set size in MB (1024 * 1024 bytes).

    The larger of ``getrusage`` ``ru_maxrss`` (KiB on Linux) and ``VmHWM`` from ``status_path``.
    """
    rusage_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return max(rusage_mb, read_proc_mb("VmHWM", Path(status_path)) or 0.0)


def parent_of(pid: int) -> Optional[int]:
    """The parent of process ``pid`` (from ``/proc``), None if it is gone."""
    try:
        with open("/proc/{}/stat".format(pid), "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def cpu_identity(cpuinfo_path: str = "/proc/cpuinfo") -> Tuple[str, frozenset]:
    """The CPU's model name and its cpuinfo flags (``""`` and none when the file is unreadable).

    Also what ``odtctl profile`` names a machine by (``odtd.profiling.sweep.cpu_description``).
    """
    name, flags = "", set()
    try:
        with open(cpuinfo_path) as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "Features"):
                    flags.update(value.split())
                elif key == "model name" and not name:
                    name = value.strip()
    except OSError:
        pass  # no flags: precision auto is fp32, and says why
    return name, frozenset(flags)
