"""One session at a time per home: the lock, and recovery of sessions a dead process left.

``SessionLock`` is held by every process that trains or profiles (``SessionRunner``,
``odtctl profile``; it lives in ``home.lock``); ``recover_stale_sessions`` runs under it when a
session starts, and repairs what a crash left in the home's files.
"""

from __future__ import annotations

import logging
from typing import Optional

from odtd.home.lock import SessionLock
from odtd.home.paths import Home
from odtd.home.repair import repair_home
from odtd.store.database import Store

__all__ = ["SessionLock", "recover_stale_sessions"]  # SessionLock lives in home.lock

logger = logging.getLogger(__name__)


def recover_stale_sessions(store: Store, home: Optional[Home] = None) -> list[int]:
    """Mark sessions left ``running`` by a dead process as interrupted; return their ids.

    Call it only while holding the session lock: then no live process can own such a row.
    Their samples were never marked trained, so they stay pending. With ``home``, what a crash
    left in its files is repaired too (``home.repair.repair_home``).
    """
    stale = store.running_sessions()
    for record in stale:
        record.outcome = "interrupted"
        record.reason = ("the process running this session died (crash, kill or power loss); "
                         "its samples stay pending")
        store.finish_session(record)
        store.log_event("recovered", f"session {record.id} marked interrupted", session_id=record.id)
        logger.warning("session %d was left running by a dead process: marked interrupted", record.id)
    if home is not None:
        repair_home(home, store)
    return [record.id for record in stale]
