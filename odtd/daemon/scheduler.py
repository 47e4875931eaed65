"""The nightly schedule, on APScheduler 3.x (the only module that imports apscheduler).

Missed runs are coalesced, not dropped: while the daemon runs, APScheduler's ``coalesce`` and
``misfire_grace_time`` cover a late wake-up; across a power-off (the in-memory job store
forgets), ``missed_fire_time`` finds the last fire time within the grace period that no
session answered, and the daemon runs one session for it on start.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any, Callable, Optional

from apscheduler.triggers.cron import CronTrigger

logger = logging.getLogger(__name__)

JOB_ID = "nightly-session"


def validate_cron(expression: str) -> Optional[str]:
    """Return None if ``expression`` is a valid five-field crontab, else the problem."""
    try:
        CronTrigger.from_crontab(expression)
    except ValueError as exc:
        return f"invalid cron expression ({exc}); expected e.g. '0 2 * * *'"
    return None


def make_trigger(expression: str, jitter_s: int = 0, timezone: Any = None) -> CronTrigger:
    """Build the cron trigger (local time unless ``timezone`` is given)."""
    trigger = CronTrigger.from_crontab(expression, timezone=timezone)
    trigger.jitter = jitter_s or None
    return trigger


def missed_fire_time(
    expression: str, last_session_at: Optional[datetime], now: datetime, grace_s: int
) -> Optional[datetime]:
    """Return the latest fire time in ``(now - grace_s, now]`` after ``last_session_at``, if any.

    This is the run a board that was switched off at 02:00 still owes when it comes back.
    """
    trigger = CronTrigger.from_crontab(expression, timezone=now.tzinfo)
    start = now - timedelta(seconds=grace_s)
    if last_session_at is not None and last_session_at > start:
        start = last_session_at
    fire = trigger.get_next_fire_time(None, start)
    latest = None
    while fire is not None and fire <= now:
        latest = fire
        fire = trigger.get_next_fire_time(fire, fire + timedelta(seconds=1))
    if latest is not None and last_session_at is not None and latest <= last_session_at:
        return None
    return latest


class Scheduler:
    """Fires ``run_session`` on the cron schedule, one session at a time.

    Args:
        run_session: called in a scheduler thread with the trigger name ``"schedule"``; it
            blocks for the whole session, so ``max_instances=1`` makes an overlapping fire wait
            for the next period instead of starting a second session.
        expression: five-field crontab (local time).
        jitter_s: random delay added to each fire.
        misfire_grace_s: how late a fire may still run.
        trigger: a ready trigger instead of ``expression`` (tests use second-resolution ones).
    """

    def __init__(
        self,
        run_session: Callable[[str], Any],
        expression: str = "0 2 * * *",
        jitter_s: int = 0,
        misfire_grace_s: int = 12 * 3600,
        trigger: Any = None,
    ) -> None:
        # Imported here: every odtctl command validates the schedule (``validate_cron``), and
        # the scheduler's modules are most of apscheduler's import time, which only the daemon
        # needs.
        from apscheduler.schedulers.background import BackgroundScheduler

        self._run_session = run_session
        self._misfire_grace_s = misfire_grace_s
        self._scheduler = BackgroundScheduler(daemon=True)
        self._scheduler.add_job(
            self._fire, trigger or make_trigger(expression, jitter_s), id=JOB_ID,
            coalesce=True, max_instances=1, misfire_grace_time=misfire_grace_s,
        )

    def _fire(self) -> None:
        logger.info("scheduled session starting")
        self._run_session("schedule")

    def start(self, paused: bool = False) -> None:
        """Start the scheduler thread."""
        self._scheduler.start(paused=paused)

    def shutdown(self) -> None:
        """Stop firing; a running session is stopped by the daemon, not here."""
        if self._scheduler.running:
            self._scheduler.shutdown(wait=False)

    def pause(self) -> None:
        """Hold scheduled sessions (fires during the pause are dropped, as documented)."""
        self._scheduler.pause_job(JOB_ID)

    def resume(self) -> None:
        """Resume scheduled sessions."""
        self._scheduler.resume_job(JOB_ID)

    def reschedule(self, expression: str, jitter_s: int = 0, misfire_grace_s: Optional[int] = None) -> None:
        """Replace the cron expression (after a reload)."""
        if misfire_grace_s is not None:
            self._scheduler.modify_job(JOB_ID, misfire_grace_time=misfire_grace_s)
        self._scheduler.reschedule_job(JOB_ID, trigger=make_trigger(expression, jitter_s))

    def next_run_time(self) -> Optional[datetime]:
        """When the next session is due (None while paused)."""
        job = self._scheduler.get_job(JOB_ID)
        return job.next_run_time if job else None

    def set_next_run_time(self, when: datetime) -> None:
        """Move the next fire (tests use it to simulate a board that was asleep)."""
        self._scheduler.modify_job(JOB_ID, next_run_time=when)
