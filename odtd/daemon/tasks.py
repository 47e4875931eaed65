"""``python -m odtd.daemon.tasks TASK``: the daemon's work that needs the whole store, one child each.

The daemon itself stays small (no numpy, no sqlite-utils, no Pillow, no telemetry: about 30 MB
idle) and a bug in session code cannot take it down: each session, each inbox ingest, the
recovery at start and a ``status`` request run in a child process of the daemon, which prints
one JSON line on stdout and exits.

    session --trigger T [--force]   one session, as `odtctl train-now --foreground` runs it; then
                                    the Prometheus textfile (metrics.textfile). Prints the
                                    session object. SIGTERM/SIGINT stop it at a step boundary.
            [--federated JSON]      a Flower round's session (odtd.session.federated).
    ingest [--day D]                the inbox files named on stdin (JSON [[path, label], ...]),
                                    moved into the store or quarantine. Prints the ingest report.
    recover                         sessions a dead process left running become interrupted.
    status [--limit N]              the `odtctl status --json` object.
    federated-evaluate --federated JSON
                                    a Flower evaluate round: the round's weights scored on the
                                    device's evaluation set (odtd.session.federated_evaluation).

A child dies with the daemon (PR_SET_PDEATHSIG, as the trainer worker does with its parent).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any, Optional

from odtd.config import resolve_home
from odtd.errors import OdtdError, as_odtd_error
from odtd.home.paths import Home

logger = logging.getLogger(__name__)


def _session(home: Home, args: argparse.Namespace) -> dict[str, Any]:
    from odtd.report.metrics import write_textfile
    from odtd.session.federated import EXCHANGE_DIR, FederatedRound
    from odtd.session.process import run_session_here

    federated = FederatedRound.from_args(json.loads(args.federated), home.run / EXCHANGE_DIR) \
        if args.federated else None
    try:
        session = run_session_here(home, trigger=args.trigger, force=args.force,
                                   progress=lambda message: logger.info("%s", message),
                                   stop_reason="daemon stopping ({signal})", federated=federated)
        return session.to_dict()
    finally:
        textfile = home.load_config().metrics.textfile
        if textfile:
            store = home.open_store()
            try:
                write_textfile(Path(textfile), home, store)
            except OSError as exc:
                logger.error("cannot write metrics to %s: %s", textfile, exc)
            finally:
                store.close()


def _ingest(home: Home, args: argparse.Namespace) -> dict[str, Any]:
    from odtd.home.ingest import Ingestor

    files = [(Path(path), label) for path, label in json.load(sys.stdin)]
    store = home.open_store()
    try:
        report = Ingestor.for_home(home, store).ingest(files, day=args.day, move=True)
    finally:
        store.close()
    logger.info("inbox: accepted %d (%d unlabelled), duplicates %d, rejected %d", report.accepted,
                report.unlabelled, report.duplicates, report.rejected)
    return report.as_dict()


def _recover(home: Home, args: argparse.Namespace) -> dict[str, Any]:
    from odtd.session.lock import SessionLock, recover_stale_sessions

    store = home.open_store()
    try:
        with SessionLock(home.session_lock):
            return {"recovered": recover_stale_sessions(store, home)}
    finally:
        store.close()


def _status(home: Home, args: argparse.Namespace) -> dict[str, Any]:
    from odtd.report.status import status

    store = home.open_store()
    try:
        return status(home, store, limit=args.limit)
    finally:
        store.close()


def _federated_evaluate(home: Home, args: argparse.Namespace) -> dict[str, Any]:
    from odtd.session.federated_evaluation import evaluate_round

    if not args.federated:
        raise OdtdError("federated-evaluate needs --federated JSON")
    store = home.open_store()
    try:
        return evaluate_round(home, store, home.load_config(), json.loads(args.federated))
    finally:
        store.close()


TASKS = {"session": _session, "ingest": _ingest, "recover": _recover, "status": _status,
         "federated-evaluate": _federated_evaluate}


def main(argv: Optional[list[str]] = None) -> int:
    """Run one task; print its JSON result (or ``{"error": ...}``) on stdout."""
    parser = argparse.ArgumentParser(prog="python -m odtd.daemon.tasks",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--home", required=True)
    parser.add_argument("--config", help="odtd.yaml elsewhere than in the home")
    parser.add_argument("--trigger", default="schedule")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--federated", help="a federated round's request (JSON)")
    parser.add_argument("--day")
    parser.add_argument("--limit", type=int, default=10)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s[task " + args.task + "]: %(message)s")
    parent = os.getppid()
    if parent > 1:
        from odtd.trainer.protocol.procfs import watch_parent

        watch_parent(parent)  # the daemon died: so does this (and, in turn, its worker)
    home = Home(resolve_home(args.home), Path(args.config) if args.config else None)
    try:
        result = TASKS[args.task](home, args)
    except (OdtdError, OSError, sqlite3.Error) as exc:
        reported = as_odtd_error(exc, home.db_path)  # a full, read-only or vanished disk
        if reported is None:
            raise
        print(json.dumps({"error": str(reported)}), flush=True)
        return 1
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
