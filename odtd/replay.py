"""Replay: earlier samples rehearsed beside each day's new ones, so the model does not forget."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from odtd.policy import ReplayPolicy
from odtd.store import Store


def choose_replay(store: Store, policy: ReplayPolicy, new_count: int, seed: int) -> list[dict[str, Any]]:
    """Draw a class-balanced set of already-trained samples to mix into a session.

    The pool is the ``policy.capacity_samples`` most recently trained samples; the draw takes
    ``ratio x new_count`` of them (capped by ``max_samples``), round-robin over classes so a
    class seen on few days is rehearsed as often as a common one.

    Args:
        store: the database.
        policy: the replay settings.
        new_count: how many new samples the session trains on.
        seed: makes the draw reproducible (the session id).
    """
    wanted = min(int(round(policy.ratio * new_count)), policy.max_samples)
    if wanted <= 0 or policy.capacity_samples <= 0:
        return []
    pool = list(store.iter_query(
        "SELECT * FROM samples WHERE status = 'trained' ORDER BY session_id DESC, sha256 LIMIT ?",
        [policy.capacity_samples],
    ))
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in pool:
        by_label[row["label"]].append(row)
    rng = random.Random(seed)
    for rows in by_label.values():
        rng.shuffle(rows)
    chosen: list[dict[str, Any]] = []
    labels = sorted(by_label)
    while len(chosen) < wanted and any(by_label[label] for label in labels):
        for label in labels:
            if by_label[label] and len(chosen) < wanted:
                chosen.append(by_label[label].pop())
    return chosen
