"""``odtd run``: the daemon, and the composition root that builds and wires its parts.

The daemon never imports TensorFlow. It owns the store, the schedule, the inbox, telemetry and
the control socket; all training happens in a worker subprocess that exits after each session.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from odtd import __version__
from odtd.config import Config, resolve_home
from odtd.daemon.control import ControlServer
from odtd.daemon.inbox import InboxWatcher
from odtd.daemon.scheduler import Scheduler, missed_fire_time
from odtd.daemon.sdnotify import Notifier
from odtd.errors import ConfigError, OdtdError, PolicyError, SessionBusy
from odtd.home.ingest import Ingestor
from odtd.home.paths import Home
from odtd.policy import Policy, load_policy
from odtd.report.metrics import prometheus_text, write_textfile
from odtd.report.status import status as build_status
from odtd.session.gates import StopRequest
from odtd.session.runner import SessionLock, SessionRunner, recover_stale_sessions
from odtd.store.database import Store, utc_now
from odtd.telemetry.meter import SessionEnergyMeter, make_sampler

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
        self.store = home.open_store()
        shape = self.store.meta("input_shape")
        self.inbox = InboxWatcher(home.inbox, Ingestor(home, self.store, self.store.meta("classes"),
                                                       (shape[1], shape[0])))
        schedule = self.config.schedule
        self.scheduler = Scheduler(self._scheduled_session, schedule.cron, schedule.jitter_s,
                                   schedule.misfire_grace_s)
        self.control: Optional[ControlServer] = None
        self.sampler = make_sampler(self.config.telemetry)
        self.telemetry_backend = self.sampler.backend
        self.paused = False
        self._shutdown = threading.Event()
        self._reload = threading.Event()
        self._session_guard = threading.Lock()
        self._session_thread: Optional[threading.Thread] = None
        self._session_stop: Optional[StopRequest] = None
        self._last_session: Optional[dict[str, Any]] = None

    # -- lifecycle ----------------------------------------------------------------------------

    def recover(self) -> list[int]:
        """Mark sessions a crashed daemon left ``running`` as interrupted (samples stay pending)."""
        with SessionLock(self.home.session_lock):
            return recover_stale_sessions(self.store)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; return the exit status."""
        self.recover()
        self.sampler.start()
        logger.info("telemetry: %s every %.0f ms", self.telemetry_backend.source,
                    self.sampler.interval_s * 1000)
        self.control = ControlServer(self.home.socket_path, self.handle_request)
        self.control.start()
        self.scheduler.start()
        self.store.write_daemon(pid=os.getpid(), started_at=utc_now(), heartbeat_at=utc_now(),
                                next_session_at=self._next_session_at(), paused=0, state="running")
        self.notifier.ready()
        self.notifier.status(f"idle; next session {self._next_session_at()}")
        logger.info("odtd %s running on %s (pid %d); next session %s", __version__, self.home.root,
                    os.getpid(), self._next_session_at())
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
            if self._session_stop is not None:
                self._session_stop.request("daemon stopping")
            self.notifier.status("stopping: waiting for the session to stop at a step boundary")
            while thread.is_alive():
                thread.join(timeout=_TICK_S)
                self.notifier.watchdog()
        self.sampler.stop()
        self.telemetry_backend.close()
        self.store.write_daemon(state="stopped", heartbeat_at=utc_now(), next_session_at=None)
        self.store.close()
        logger.info("stopped")
        return 0

    def request_shutdown(self, reason: str) -> None:
        """Stop the daemon (signal handlers call this); a running session ends interrupted."""
        if self._session_stop is not None:
            self._session_stop.request(f"daemon stopping ({reason})")
        self._shutdown.set()

    def request_reload(self) -> None:
        """Reload config and policy on the main loop's next tick (SIGHUP)."""
        self._reload.set()

    def reload(self) -> dict[str, Any]:
        """Re-read ``odtd.yaml`` and the policy; an invalid file is rejected and the old one stays."""
        try:
            config = self.home.load_config()
            policy = load_policy(self.home.policy_path(config))
        except OdtdError as exc:
            logger.error("reload rejected, the previous config and policy stay in force: %s", exc)
            self.store.log_event("reload_rejected", str(exc))
            raise
        if config.schedule != self.config.schedule:
            self.scheduler.reschedule(config.schedule.cron, config.schedule.jitter_s,
                                      config.schedule.misfire_grace_s)
        self.config, self.policy = config, policy
        self.store.log_event("reloaded", "config and policy reloaded")
        logger.info("reloaded config and policy; next session %s", self._next_session_at())
        self.heartbeat()
        return {"reloaded": True, "next_session_at": self._next_session_at()}

    def heartbeat(self) -> None:
        """Update the liveness row ``odtctl status`` reads."""
        self.store.write_daemon(heartbeat_at=utc_now(), next_session_at=self._next_session_at(),
                                paused=int(self.paused), state="running", pid=os.getpid())

    def _next_session_at(self) -> Optional[str]:
        when = None if self.paused else self.scheduler.next_run_time()
        return when.isoformat(timespec="seconds") if when else None

    def _scan_inbox(self) -> None:
        try:
            self.inbox.scan()
        except OSError as exc:
            logger.error("inbox scan failed: %s", exc)

    def _catch_up_missed_run(self) -> None:
        schedule = self.config.schedule
        rows = list(self.store.iter_query(
            "SELECT started_at FROM sessions WHERE trigger = 'schedule' ORDER BY id DESC LIMIT 1"))
        # A run is owed only for fire times after the last scheduled session, and after the
        # home was created: a new install does not train at once for last night.
        marks = [rows[0]["started_at"]] if rows else []
        marks += [self.store.meta("created_at")] if self.store.meta("created_at") else []
        last = max(datetime.fromisoformat(m) for m in marks).astimezone() if marks else None
        missed = missed_fire_time(schedule.cron, last, datetime.now().astimezone(),
                                  schedule.misfire_grace_s)
        if missed is not None:
            logger.info("the scheduled session of %s was missed (board off?); running it now", missed)
            self.start_session("schedule")

    # -- sessions -------------------------------------------------------------------------------

    def _scheduled_session(self, trigger: str) -> None:
        try:
            thread = self.start_session(trigger)
        except SessionBusy as exc:
            logger.warning("scheduled session skipped: %s", exc)
            return
        thread.join()

    def start_session(self, trigger: str, force: bool = False) -> threading.Thread:
        """Start a session in its own thread (one at a time) and return the thread.

        Raises:
            SessionBusy: a session is already running.
        """
        with self._session_guard:
            if self._session_thread is not None and self._session_thread.is_alive():
                raise SessionBusy("a session is already running; wait for it (odtctl status)")
            if self._shutdown.is_set():
                raise SessionBusy("the daemon is stopping")
            stop = StopRequest()
            self._session_stop = stop
            self._last_session = None
            thread = threading.Thread(target=self._session_body, args=(trigger, force, stop),
                                      name="session", daemon=True)
            self._session_thread = thread
            thread.start()
            return thread

    def _session_body(self, trigger: str, force: bool, stop: threading.Event) -> None:
        store = Store(self.home.db_path)  # a connection of this thread's own
        self.notifier.status(f"training ({trigger})")
        try:
            runner = SessionRunner(self.home, store, self.config, self.policy,
                                   energy_meter=SessionEnergyMeter(self.sampler),
                                   heartbeat=self.notifier.watchdog)
            self._last_session = runner.run(trigger=trigger, stop=stop, force=force).to_dict()
        except OdtdError as exc:
            logger.error("session not run: %s", exc)
            self._last_session = {"error": str(exc)}
        except Exception:  # a session must never take the daemon down with it
            logger.exception("session crashed in the daemon")
            self._last_session = {"error": "session crashed in the daemon; see its log"}
        finally:
            self._write_metrics(store)
            store.close()
            self.notifier.status(f"idle; next session {self._next_session_at()}")

    def _write_metrics(self, store: Store) -> None:
        path = self.config.metrics.textfile
        if not path:
            return
        try:
            write_textfile(Path(path), prometheus_text(self.home, store))
        except OSError as exc:
            logger.error("cannot write metrics to %s: %s", path, exc)

    # -- control socket -------------------------------------------------------------------------

    def handle_request(self, op: str, args: dict[str, Any]) -> Any:
        """Answer one control request (see ``odtd.daemon.control``)."""
        if op == "ping":
            return {"pong": True, "pid": os.getpid(), "version": __version__}
        if op == "status":
            store = Store(self.home.db_path)
            try:
                return build_status(self.home, store, limit=int(args.get("limit", 10)))
            finally:
                store.close()
        if op == "train-now":
            thread = self.start_session("socket", force=bool(args.get("force")))
            if not args.get("wait"):
                return {"started": True}
            thread.join()
            return self._last_session
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
        return EX_CONFIG if isinstance(exc, (ConfigError, PolicyError)) else 1
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
