"""What a home remembers of sessions that ran out of memory, and what to try after one.

A session whose worker ran out of memory (``trainer.protocol.launch.worker_ran_out_of_memory``) records
its batch size; later sessions of that model start below it (``admission.admit_session``), and
the failing session retries at the size ``batch.on_oom`` says.
"""

from __future__ import annotations

import logging
from typing import Optional

from odtd.policy import BatchPolicy
from odtd.store.database import Store

logger = logging.getLogger(__name__)


def learned_oom_limit(store: Store, model: str) -> Optional[int]:
    """The smallest batch size that ran out of memory in a session of ``model``, or None."""
    return store.meta(f"oom_limit_{model}")


def record_oom(store: Store, model: str, batch_size: int) -> int:
    """Remember that ``batch_size`` ran out of memory; return the (possibly lower) limit."""
    known = learned_oom_limit(store, model)
    limit = batch_size if known is None else min(known, batch_size)
    store.set_meta(**{f"oom_limit_{model}": limit})
    logger.warning("%s: batch %d ran out of memory; later sessions stay below batch %d",
                   model, batch_size, limit)
    return limit


def oom_retry_batch(batch: BatchPolicy, failed_batch_size: int) -> Optional[int]:
    """The batch size to retry at after an OOM at ``failed_batch_size``, or None to stop.

    ``on_oom: halve`` retries at half (at least 1; a failure at batch 1 stops); ``skip`` stops.
    """
    if batch.on_oom == "halve" and failed_batch_size > 1:
        return failed_batch_size // 2
    return None
