"""The schedule on a real APScheduler; the clock is controlled through the job's next run time."""

import threading
import time
from datetime import datetime, timedelta

from apscheduler.triggers.interval import IntervalTrigger

from odtd.daemon.scheduler import Scheduler, missed_fire_time, validate_cron


def test_validate_cron():
    assert validate_cron("0 2 * * *") is None
    assert "invalid cron" in validate_cron("0 24 * * *")


def test_missed_run_within_grace_is_owed_once():
    now = datetime(2026, 11, 22, 7, 30).astimezone()
    # Board off at 02:00, back at 07:30, last session yesterday: one run is owed.
    yesterday = datetime(2026, 11, 21, 2, 1).astimezone()
    two_am = datetime(2026, 11, 22, 2, 0).astimezone()
    assert missed_fire_time("0 2 * * *", yesterday, now, 12 * 3600) == two_am
    # Already trained after today's fire time: nothing owed.
    assert missed_fire_time("0 2 * * *", datetime(2026, 11, 22, 2, 5).astimezone(), now, 12 * 3600) is None
    # Beyond the grace period: dropped.
    assert missed_fire_time("0 2 * * *", yesterday, now, 3600) is None
    # Several missed fires (hourly) coalesce into the latest one.
    seven = datetime(2026, 11, 22, 7, 0).astimezone()
    assert missed_fire_time("0 * * * *", yesterday, now, 12 * 3600) == seven


def _collecting_scheduler(grace_s, hold=None):
    fired = []

    def run_session(trigger):
        fired.append((trigger, time.monotonic()))
        if hold:
            hold.wait(5)

    scheduler = Scheduler(run_session, misfire_grace_s=grace_s,
                          trigger=IntervalTrigger(hours=1))
    return scheduler, fired


def test_missed_fires_coalesce_into_one_run():
    scheduler, fired = _collecting_scheduler(grace_s=3600)
    scheduler.start(paused=True)
    try:
        # The clock moves on past three fire times while nothing ran (asleep/busy).
        scheduler.set_next_run_time(datetime.now().astimezone() - timedelta(minutes=150))
        scheduler._scheduler.resume()
        time.sleep(1.5)
        assert [t for t, _ in fired] == ["schedule"]
        assert scheduler.next_run_time() > datetime.now().astimezone()
    finally:
        scheduler.shutdown()


def test_fire_past_grace_is_skipped():
    scheduler, fired = _collecting_scheduler(grace_s=60)
    scheduler.start(paused=True)
    try:
        scheduler.set_next_run_time(datetime.now().astimezone() - timedelta(minutes=10))
        scheduler._scheduler.resume()
        time.sleep(1.5)
        assert fired == []
    finally:
        scheduler.shutdown()


def test_overlapping_fire_does_not_start_a_second_session():
    hold = threading.Event()
    scheduler, fired = _collecting_scheduler(grace_s=3600, hold=hold)
    scheduler.start()
    try:
        scheduler.set_next_run_time(datetime.now().astimezone())
        time.sleep(0.8)
        scheduler.set_next_run_time(datetime.now().astimezone())  # fires while the first runs
        time.sleep(0.8)
        assert len(fired) == 1
    finally:
        hold.set()
        scheduler.shutdown()


def test_pause_hides_next_run_and_resume_restores_it():
    scheduler, _ = _collecting_scheduler(grace_s=60)
    scheduler.start()
    try:
        scheduler.pause()
        assert scheduler.next_run_time() is None
        scheduler.resume()
        assert scheduler.next_run_time() is not None
    finally:
        scheduler.shutdown()
