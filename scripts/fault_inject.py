"""Run one of odtd's commands and stop it at its N-th write, as a power cut or a failing disk would.

    python scripts/fault_inject.py --root DIR [--at N [--fail enospc|eio]] [--kill-after-s S]
        [--count FILE] [--within promotion] [--stdin FILE] -- -m MODULE ARGS

The process counts every write it makes under ``--root``: a file opened for writing, a rename,
a removal, a new directory (Python's audit events, so whatever library makes them) and each
SQL statement that writes (through ``odtd.store``'s connection class). At the ``--at``-th it
SIGKILLs itself (nothing runs after a power cut). With ``--fail`` the N-th write that a disk
can fail fails instead, as on a full (``ENOSPC``, SQLite's "database or disk is full") or
failing disk (``EIO``, "disk I/O error"): a file opened for writing, a rename, a new directory,
a statement that changes rows, a commit (not a removal, a savepoint or a lock).
``--kill-after-s`` SIGKILLs it after that long, wherever it is (its trainer worker dies with
it); with ``--at N``, that long after its N-th write: a moment between two writes, or inside
the next. ``--within promotion`` counts only inside ``Promotion.conclude``. ``--count`` writes
``{"writes": N, "failable": M, "within_s": S}`` to FILE at the end (S: the seconds spent inside,
with ``--within``). scripts/power_loss.py drives it.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import json
import os
import runpy
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

FILE_WRITES = ("open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree",
               "shutil.copyfile", "os.truncate")
FILE_FAILABLE = ("open", "os.rename", "os.mkdir", "shutil.copyfile")  # what a full disk fails
SQL_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "BEGIN", "COMMIT", "SAVEPOINT",
              "RELEASE", "CREATE", "ALTER", "DROP")
SQL_FAILABLE = ("INSERT", "UPDATE", "DELETE", "REPLACE", "COMMIT", "CREATE", "ALTER")


class Injector:
    """Counts the writes a process makes under ``root``; acts at the ``at``-th."""

    def __init__(self, root: str, at: Optional[int], fail: Optional[str], active: bool,
                 delay_s: Optional[float] = None) -> None:
        self.root, self.at, self.fail, self.active = root, at, fail, active
        self.delay_s = delay_s
        self.count = self.failable = 0

    def point(self, what: str, failable: bool, sql: bool = False) -> None:
        """One write: the ``at``-th is killed; or the ``at``-th that can fail fails."""
        if not self.active:
            return
        self.count += 1
        self.failable += failable
        if self.fail is None:
            if self.count == self.at and self.delay_s:
                kill_after(self.delay_s)
            elif self.count == self.at:
                os.kill(os.getpid(), signal.SIGKILL)  # the power goes: nothing runs after this
            return
        if not failable or self.failable != self.at:
            return
        code = errno.ENOSPC if self.fail == "enospc" else errno.EIO
        if sql:
            raise sqlite3.OperationalError("database or disk is full" if code == errno.ENOSPC
                                           else "disk I/O error")
        raise OSError(code, f"{os.strerror(code)} (injected)", what)

    def audit(self, event: str, args: tuple) -> None:
        """The audit hook: file writes under ``root``."""
        if event not in FILE_WRITES or not args or not isinstance(args[0], str):
            return
        if not os.path.abspath(args[0]).startswith(self.root):
            return
        if event == "open" and not (args[2] or 0) & (os.O_WRONLY | os.O_RDWR):
            return
        self.point(args[0], event in FILE_FAILABLE)

    def statements(self, method: Callable) -> Callable:
        """``method`` (a connection's execute) with each writing statement counted first."""
        def execute(connection, sql, *rest):
            verb = str(sql).lstrip().split(" ", 1)[0].upper()
            if verb in SQL_WRITES:
                self.point(f"odtd.db: {str(sql)[:40]}", verb in SQL_FAILABLE, sql=True)
            return method(connection, sql, *rest)
        return execute


def kill_after(delay_s: float) -> None:
    """SIGKILL this process ``delay_s`` from now, whatever it is doing then."""
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="fault_inject.py", description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--at", type=int)
    parser.add_argument("--fail", choices=["enospc", "eio"])
    parser.add_argument("--kill-after-s", type=float)
    parser.add_argument("--count")
    parser.add_argument("--within", choices=["promotion"])
    parser.add_argument("--stdin")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    after_write = args.at is not None and args.fail is None
    injector = Injector(os.path.abspath(args.root), args.at, args.fail, args.within is None,
                        args.kill_after_s if after_write else None)
    from odtd.store import database

    database._SavepointConnection.execute = injector.statements(sqlite3.Connection.execute)
    database._SavepointConnection.executemany = injector.statements(sqlite3.Connection.executemany)
    within = [0.0]
    if args.within == "promotion":
        from odtd.session import promotion

        conclude = promotion.Promotion.conclude

        def concluding(self, *rest, **kwargs):
            injector.active = True
            started = time.monotonic()
            try:
                return conclude(self, *rest, **kwargs)
            finally:
                within[0] += time.monotonic() - started

        promotion.Promotion.conclude = concluding
    if args.kill_after_s is not None and not after_write:
        kill_after(args.kill_after_s)
    sys.addaudithook(injector.audit)
    if args.count:
        atexit.register(lambda: Path(args.count).write_text(json.dumps(
            {"writes": injector.count, "failable": injector.failable,
             "within_s": round(within[0], 4)})))
    if args.stdin:
        sys.stdin = open(args.stdin)
    sys.argv = [command[1], *command[2:]]
    runpy.run_module(command[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
