"""Replay: earlier samples rehearsed beside each day's new ones, so the model does not forget.

The buffer holds references to stored samples (never copies), chosen by class-balanced
reservoir sampling (Chrysakis and Moens, "Online Continual Learning from Imbalanced Data",
ICML 2020): while there is room every trained sample goes in; when full, a sample of a class
that is not among the largest in the buffer replaces a random sample of the largest class, and
a sample of a largest class replaces a random one of its own class with probability
(its class's buffer share / samples of the class seen). Rare classes keep their place; common
ones are a uniform sample of everything seen. The buffer lives in SQLite, so it survives restarts.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from odtd.policy import ReplayPolicy
from odtd.store.database import Store


def update_buffer(store: Store, policy: ReplayPolicy, trained: list[dict[str, Any]],
                  session_id: int, root: Path) -> dict[str, int]:
    """Offer a session's trained samples to the reservoir; return {"added", "removed", "size"}.

    Args:
        store: the database.
        policy: capacity in samples (``capacity_samples``) and MB (``capacity_mb``).
        trained: the session's new sample rows (sha256, label, stored_path).
        session_id: recorded with each entry.
        root: the home, which ``stored_path`` is relative to (file sizes, for the MB cap).
    """
    rng = random.Random(session_id)
    buffer: dict[str, list[str]] = defaultdict(list)
    entries = {row["sha256"]: row for row in store.replay_buffer()}
    for sha, row in entries.items():
        buffer[row["label"]].append(sha)
    seen = store.replay_seen()
    added: dict[str, dict[str, Any]] = {}
    removed: list[str] = []
    capacity = policy.capacity_samples

    def evict_from_largest() -> None:
        largest = max(len(shas) for shas in buffer.values())
        label = rng.choice(sorted(lab for lab, shas in buffer.items() if len(shas) == largest))
        victim = buffer[label].pop(rng.randrange(len(buffer[label])))
        if victim in added:
            del added[victim]
        else:
            removed.append(victim)

    for row in trained:
        label, sha = row["label"], row["sha256"]
        if sha in entries or sha in added or capacity <= 0:
            continue
        seen[label] = seen.get(label, 0) + 1
        entry = {"sha256": sha, "label": label, "size_bytes": _stored_size(root, row),
                 "added_session": session_id}
        total = sum(len(shas) for shas in buffer.values())
        if total < capacity:
            buffer[label].append(sha)
            added[sha] = entry
            continue
        largest = max(len(shas) for shas in buffer.values())
        if len(buffer[label]) < largest:
            evict_from_largest()
            buffer[label].append(sha)
            added[sha] = entry
        elif rng.random() < len(buffer[label]) / seen[label]:
            victim = buffer[label].pop(rng.randrange(len(buffer[label])))
            if victim in added:
                del added[victim]
            else:
                removed.append(victim)
            buffer[label].append(sha)
            added[sha] = entry
    if policy.capacity_mb is not None:
        size_of = {**{s: r["size_bytes"] for s, r in entries.items()},
                   **{s: r["size_bytes"] for s, r in added.items()}}
        limit = policy.capacity_mb * 1024 * 1024
        while buffer and sum(size_of[s] for shas in buffer.values() for s in shas) > limit:
            evict_from_largest()
    store.update_replay(list(added.values()), removed, seen)
    return {"added": len(added), "removed": len(removed),
            "size": sum(len(shas) for shas in buffer.values())}


def _stored_size(root: Path, row: dict[str, Any]) -> int:
    try:
        return (root / row["stored_path"]).stat().st_size
    except OSError:  # gone since ingest: it counts nothing against the MB cap
        return 0


def choose_replay(store: Store, policy: ReplayPolicy, new_count: int, seed: int) -> list[dict[str, Any]]:
    """Draw the buffered samples to mix into a session.

    The draw takes ``ratio x new_count`` samples, capped by ``max_samples`` so sessions do
    not grow with the buffer: first ``device_share`` of them from the device's own earlier
    images (buffered samples a session trained on, not the replay seed's), at random; the rest
    round-robin over classes from the whole buffer.

    Args:
        store: the database.
        policy: the replay settings.
        new_count: how many new samples the session trains on.
        seed: makes the draw reproducible (the session id).
    """
    wanted = min(int(round(policy.ratio * new_count)), policy.max_samples)
    if wanted <= 0:
        return []
    rows = store.samples_by_sha(entry["sha256"] for entry in store.replay_buffer())
    rng = random.Random(seed)
    chosen: list[dict[str, Any]] = []
    if policy.device_share > 0:  # the device's: trained by a session, not the seed's session 0
        own = sorted((row for row in rows if row["session_id"]), key=lambda r: r["sha256"])
        rng.shuffle(own)
        chosen = own[:int(round(policy.device_share * wanted))]
    taken = {row["sha256"] for row in chosen}
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["sha256"] not in taken:
            by_label[row["label"]].append(row)
    for group in by_label.values():
        group.sort(key=lambda r: r["sha256"])
        rng.shuffle(group)
    labels = sorted(by_label)
    while len(chosen) < wanted and any(by_label[label] for label in labels):
        for label in labels:
            if by_label[label] and len(chosen) < wanted:
                chosen.append(by_label[label].pop())
    return chosen
