"""``odtd run``: the daemon, and the composition root that builds and wires its parts.

The daemon never imports TensorFlow, and stays small when idle: it owns the schedule, the control
socket, the inbox scan, systemd's notifications and its liveness row (``store.liveness``, the
standard library's sqlite3). What needs the whole store (a session, an ingest, the recovery at
start, a ``status`` request) runs in a child process (``odtd.daemon.tasks``), whose failure is
logged and does not take the daemon down. A session's process starts the trainer worker.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from odtd import __version__
from odtd.config import Config, resolve_home
from odtd.daemon.control import ControlServer
from odtd.daemon.health import DiskHealth
from odtd.daemon.inbox import InboxWatcher
from odtd.daemon.scheduler import Scheduler, missed_fire_time
from odtd.daemon.sdnotify import Notifier, child_environment
from odtd.errors import ConfigError, OdtdError, PolicyError, SessionBusy, StorageError, StoreError
from odtd.home.paths import Home
from odtd.policy import Policy, load_policy
from odtd.store.liveness import utc_now

logger = logging.getLogger(__name__)

_TICK_S = 0.5
EX_CONFIG = 78  # sysexits.h: configuration error; the unit's RestartPreventExitStatus


class Daemon:
    """The long-running service for one ODTD_HOME.

    Args:
        home: the state directory (initialised by ``odtctl init``).
        notifier: systemd notification (a no-op outside systemd).
    """

    def __init__(self, home: Home, notifier: Optional[Notifier] = None) -> None:
        home.require()
        self.home = home
        self.config: Config = home.load_config()
        self.policy: Policy = load_policy(home.policy_path(self.config))
        self.notifier = notifier or Notifier.from_environ()
        self.health = DiskHealth(home)  # owns the liveness row's connection
        self._status_sent: Optional[str] = None
        self._inbox_error: Optional[str] = None
        self.inbox = InboxWatcher(home.inbox)
        self.scheduler = Scheduler(self._scheduled_session, *self._schedule())
        self.control: Optional[ControlServer] = None
        self.paused = False
        self._shutdown = threading.Event()
        self._reload = threading.Event()
        self._session_guard = threading.Lock()
        self._session_thread: Optional[threading.Thread] = None
        self._session_process: Optional[subprocess.Popen] = None
        self._last_session: Optional[dict[str, Any]] = None

    def _schedule(self, config: Optional[Config] = None, policy: Optional[Policy] = None
                  ) -> tuple[str, int, int]:
        """(cron, jitter s, misfire grace s): the policy's ``schedule.cron`` where it sets one."""
        config, policy = config or self.config, policy or self.policy
        cron = policy.schedule.cron or config.schedule.cron
        return cron, config.schedule.jitter_s, config.schedule.misfire_grace_s

    # -- child processes ------------------------------------------------------------------------

    def _task_command(self, task: str, *extra: str) -> list[str]:
        command = [sys.executable, "-m", "odtd.daemon.tasks", task, "--home", str(self.home.root)]
        if self.home.config_path != self.home.root / "odtd.yaml":
            command += ["--config", str(self.home.config_path)]
        return command + list(extra)

    def _spawn(self, task: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(self._task_command(task, *extra), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=child_environment(), text=True)

    def run_task(self, task: str, *extra: str, stdin: str = "") -> Any:
        """Run a task in a child process to its end and return its JSON result.

        Raises:
            OdtdError: the task refused (its message), or its process died without a result.
        """
        process = self._spawn(task, *extra)
        out, _ = process.communicate(stdin)
        return self._result(task, process.returncode, out)

    @staticmethod
    def _result(task: str, returncode: int, out: str) -> Any:
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else None
        if isinstance(result, dict) and "error" in result and returncode != 0:
            raise OdtdError(result["error"])
        if result is None or returncode != 0:
            raise OdtdError(f"the {task} process exited with status {returncode} without a "
                            "result; see the daemon's log")
        return result

    # -- lifecycle ----------------------------------------------------------------------------

    def recover(self) -> list[int]:
        """Mark sessions a crashed daemon left ``running`` as interrupted (samples stay pending).

        On a disk that cannot be written it is logged and left to the first session, which
        recovers before it starts.
        """
        try:
            return self.run_task("recover")["recovered"]
        except OdtdError as exc:
            logger.error("recovery at start not done: %s; the first session does it", exc)
            return []

    def _start_control(self) -> None:
        """Listen on the control socket; on a read-only home, retried at each heartbeat."""
        try:
            self.control = ControlServer(self.home.socket_path, self.handle_request)
        except OSError as exc:
            self.health.write_failed(exc)
            return
        self.control.start()

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; return the exit status."""
        self.recover()
        self._start_control()
        self.scheduler.start()
        self.health.write_daemon(pid=os.getpid(), started_at=utc_now(), heartbeat_at=utc_now(),
                             next_session_at=self._next_session_at(), paused=0, state="running")
        self.notifier.ready()
        self.notifier.status(self.health.status(f"idle; next session {self._next_session_at()}"))
        logger.info("odtd %s running on %s (pid %d); schedule %s; next session %s", __version__,
                    self.home.root, os.getpid(), self._schedule()[0], self._next_session_at())
        self._catch_up_missed_run()
        last_beat = last_scan = 0.0
        while not self._shutdown.is_set():
            now = time.monotonic()
            if self._reload.is_set():
                self._reload.clear()
                try:
                    self.reload()
                except OdtdError:
                    logger.debug("reload rejected; already logged")
            if now - last_scan >= self.config.inbox.scan_interval_s:
                last_scan = now
                self._scan_inbox()
            if now - last_beat >= self.config.heartbeat_interval_s:
                last_beat = now
                self.heartbeat()
            self.notifier.watchdog()
            self._shutdown.wait(_TICK_S)
        return self._stop()

    def _stop(self) -> int:
        logger.info("stopping")
        self.notifier.stopping()
        self.scheduler.shutdown()
        if self.control:
            self.control.stop()
        thread = self._session_thread
        if thread is not None and thread.is_alive():
            self.notifier.status("stopping: waiting for the session to stop at a step boundary")
            while thread.is_alive():
                thread.join(timeout=_TICK_S)
                self.notifier.watchdog()
        self.health.write_daemon(state="stopped", heartbeat_at=utc_now(), next_session_at=None)
        self.health.close()
        logger.info("stopped")
        return 0

    def request_shutdown(self, reason: str) -> None:
        """Stop the daemon (signal handlers call this); a running session ends interrupted."""
        process = self._session_process
        if process is not None and process.poll() is None:
            # The session process stops its worker at the next step boundary, saying why.
            process.send_signal(signal.SIGINT if reason == "SIGINT" else signal.SIGTERM)
        self._shutdown.set()

    def request_reload(self) -> None:
        """Reload config and policy on the main loop's next tick (SIGHUP)."""
        self._reload.set()

    def reload(self) -> dict[str, Any]:
        """Re-read ``odtd.yaml`` and the policy; an invalid file is rejected and the old one stays.

        A changed schedule (the policy's ``schedule.cron`` where it sets one, else odtd.yaml's)
        takes effect at once.
        """
        try:
            config = self.home.load_config()
            policy = load_policy(self.home.policy_path(config))
        except OdtdError as exc:
            logger.error("reload rejected, the previous config and policy stay in force: %s", exc)
            self.health.log_event("reload_rejected", str(exc))
            raise
        schedule = self._schedule(config, policy)
        if schedule != self._schedule():
            self.scheduler.reschedule(*schedule)
        self.config, self.policy = config, policy
        self.health.log_event("reloaded", "config and policy reloaded", schedule=schedule[0])
        logger.info("reloaded config and policy; schedule %s; next session %s", schedule[0],
                    self._next_session_at())
        self.heartbeat()
        return {"reloaded": True, "schedule": schedule[0],
                "next_session_at": self._next_session_at()}

    def heartbeat(self) -> None:
        """Update the liveness row ``odtctl status`` reads, and report the disk's health.

        A heartbeat that cannot be written (a read-only or vanished disk) is reported, not
        fatal: the daemon holds sessions and inbox scans and tries again next time.
        """
        if self.health.write_daemon(heartbeat_at=utc_now(), next_session_at=self._next_session_at(),
                                    paused=int(self.paused), state="running", pid=os.getpid()):
            if self.health.write_succeeded():
                self.health.log_event("storage_recovered", "the home can be written again")
            if self.control is None:
                self._start_control()
        self.health.check_space(self.config.storage)
        line = self.health.status("idle")
        if line != self._status_sent and (self._session_thread is None
                                          or not self._session_thread.is_alive()):
            self._status_sent = line
            self.notifier.status(self.health.status(f"idle; next session {self._next_session_at()}"))

    def _next_session_at(self) -> Optional[str]:
        when = None if self.paused else self.scheduler.next_run_time()
        return when.isoformat(timespec="seconds") if when else None

    def _scan_inbox(self) -> None:
        if self.health.problem:  # reported; the files wait in the inbox
            return
        try:
            files = self.inbox.stable_files()
            if files:
                self.run_task("ingest", stdin=json.dumps([[str(path), label]
                                                          for path, label in files]))
                self._inbox_error = None
        except (OSError, OdtdError) as exc:
            # Logged once: a full disk refuses every scan until space is freed (with other
            # counts and sizes as files arrive).
            again = re.sub(r"[\d.]+", "#", str(exc))
            (logger.debug if again == self._inbox_error else logger.error)(
                "inbox ingest failed: %s", exc)
            self._inbox_error = again

    def _catch_up_missed_run(self) -> None:
        cron, _, grace_s = self._schedule()
        # A run is owed only for fire times after the last scheduled session, and after the
        # home was created: a new install does not train at once for last night.
        liveness = self.health.liveness
        marks = [m for m in (liveness.last_scheduled_start(), liveness.created_at()) if m]
        last = max(datetime.fromisoformat(m) for m in marks).astimezone() if marks else None
        missed = missed_fire_time(cron, last, datetime.now().astimezone(), grace_s)
        if missed is not None:
            logger.info("the scheduled session of %s was missed (board off?); running it now", missed)
            try:
                self.start_session("schedule")
            except StorageError as exc:
                logger.warning("the missed session waits for the next one: %s", exc)

    # -- sessions -------------------------------------------------------------------------------

    def _scheduled_session(self, trigger: str) -> None:
        try:
            thread = self.start_session(trigger)
        except (SessionBusy, StorageError) as exc:
            logger.warning("scheduled session skipped: %s", exc)
            return
        thread.join()

    def start_session(self, trigger: str, force: bool = False,
                      federated: Optional[dict[str, Any]] = None) -> threading.Thread:
        """Start a session's process (one at a time) and return the thread that waits for it.

        ``federated``: a Flower round's request (``odtd.session.federated``; the task checks it).

        Raises:
            SessionBusy: a session is already running.
            StorageError: the home cannot be written (the next scheduled run tries again).
        """
        if self.health.problem:
            raise StorageError(f"no session while the home cannot be written: {self.health.problem}")
        with self._session_guard:
            self._claim_session_slot("a session is already running; wait for it (odtctl status)")
            self._last_session = None
            extra = ["--trigger", trigger] + (["--force"] if force else []) + \
                (["--federated", json.dumps(federated)] if federated is not None else [])
            self._session_process = self._spawn("session", *extra)
            thread = threading.Thread(target=self._session_body, args=(self._session_process,),
                                      name="session", daemon=True)
            self._session_thread = thread
            thread.start()
            return thread

    def _claim_session_slot(self, busy: str) -> None:
        """Check, under ``_session_guard``, that the session's slot is free.

        Free: no session (or evaluation) runs and the daemon is not stopping.

        Raises:
            SessionBusy: ``busy`` when one runs; the daemon is stopping.
        """
        if self._session_thread is not None and self._session_thread.is_alive():
            raise SessionBusy(busy)
        if self._shutdown.is_set():
            raise SessionBusy("the daemon is stopping")

    def evaluate_round(self, args: dict[str, Any]) -> Any:
        """Score a Flower round's weights on the device's set, in the session's slot.

        Never beside a session, and no session starts while it runs.

        Raises:
            SessionBusy: a session is running.
            OdtdError: the task refused (its one line) or died.
        """
        with self._session_guard:
            self._claim_session_slot("a session is running; the evaluation waits for the next round")
            process = self._spawn("federated-evaluate", "--federated", json.dumps(args))
            done: list = []
            thread = threading.Thread(target=lambda: done.append(process.communicate("")),
                                      name="federated-evaluate", daemon=True)
            self._session_thread, self._session_process = thread, process
            thread.start()
        thread.join()
        out = done[0][0] if done else ""
        return self._result("federated-evaluate", process.returncode, out)

    def _session_body(self, process: subprocess.Popen) -> None:
        self.notifier.status("training")
        try:
            out, _ = process.communicate("")
            self._last_session = self._result("session", process.returncode, out)
        except OdtdError as exc:  # a session process that died must not take the daemon down
            logger.error("session not run: %s", exc)
            self.health.log_event("session_process_failed", str(exc), pid=process.pid)
            self._last_session = {"error": str(exc)}
        finally:
            self.notifier.status(f"idle; next session {self._next_session_at()}")

    # -- control socket -------------------------------------------------------------------------

    def handle_request(self, op: str, args: dict[str, Any]) -> Any:
        """Answer one control request (see ``odtd.daemon.control``)."""
        if op == "ping":
            return {"pong": True, "pid": os.getpid(), "version": __version__}
        if op == "status":
            return self.run_task("status", "--limit", str(int(args.get("limit", 10))))
        if op in ("train-now", "federated-session"):
            if op == "train-now":
                thread = self.start_session("socket", force=bool(args.get("force")))
            else:  # a Flower round (docs/fleet.md): the SuperNode's ClientApp waits for it
                thread = self.start_session("fleet", federated=args)
            if not args.get("wait") and op == "train-now":
                return {"started": True}
            thread.join()
            if self._last_session and "error" in self._last_session:
                raise OdtdError(self._last_session["error"])
            return self._last_session
        if op == "federated-evaluate":
            return self.evaluate_round(args)
        if op == "pause":
            self.paused = True
            self.scheduler.pause()
            self.heartbeat()
            return {"paused": True}
        if op == "resume":
            self.paused = False
            self.scheduler.resume()
            self.heartbeat()
            return {"paused": False, "next_session_at": self._next_session_at()}
        if op == "reload":
            return self.reload()
        raise OdtdError(f"unknown operation {op!r}")


def configure_logging(verbose: bool) -> None:
    """Log to stderr (journald adds its own timestamps under systemd)."""
    fmt = "%(levelname)s %(name)s: %(message)s"
    if "JOURNAL_STREAM" not in os.environ:
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=fmt, stream=sys.stderr)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``odtd``."""
    parser = argparse.ArgumentParser(prog="odtd",
                                     description="odtd, the on-device continual-learning daemon.")
    parser.add_argument("--version", action="version", version=f"odtd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run the daemon in the foreground (systemd runs this)",
                         description="Run the daemon in the foreground, logging to stderr.")
    run.add_argument("--home", help="state directory (default: $ODTD_HOME or /var/lib/odtd)")
    run.add_argument("--config", help="odtd.yaml elsewhere than in the home (e.g. /etc/odtd/odtd.yaml)")
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.command != "run":
        parser.print_help()
        return 2
    configure_logging(args.verbose)
    try:
        daemon = Daemon(Home(resolve_home(args.home), Path(args.config) if args.config else None))
    except OdtdError as exc:
        for line in str(exc).splitlines():
            print(f"Error: {line}", file=sys.stderr)
        # A home that is not there (its disk not mounted) is not fixed by a restart either.
        return EX_CONFIG if isinstance(exc, (ConfigError, PolicyError, StoreError)) else 1
    signal.signal(signal.SIGTERM, lambda signum, frame: daemon.request_shutdown("SIGTERM"))
    signal.signal(signal.SIGINT, lambda signum, frame: daemon.request_shutdown("SIGINT"))
    signal.signal(signal.SIGHUP, lambda signum, frame: daemon.request_reload())
    try:
        return daemon.run()
    except OdtdError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
