"""The replay buffer's reservoir and each session's draw from it, on a real SQLite store."""

from collections import Counter

import pytest

from odtd.home.replay_buffer import choose_replay, update_buffer
from odtd.policy import ReplayPolicy
from odtd.store.database import Store

CLASSES = ("cat", "dog", "ship")


def _add(store, tmp_path, prefix, count, session_id):
    """``count`` samples, classes in turn, trained by ``session_id`` (0: the replay seed)."""
    rows = []
    for i in range(count):
        sha = f"{prefix}{i:04d}"
        (tmp_path / f"{sha}.png").write_bytes(b"x" * 10)
        row = {"sha256": sha, "label": CLASSES[i % len(CLASSES)], "status": "pending", "day": "d",
               "original_path": f"/in/{sha}.png", "stored_path": f"{sha}.png",
               "array_path": f"{sha}.npy", "width": 32, "height": 32, "ingested_at": "t"}
        store.add_sample(row)
        rows.append(row)
    store.mark_trained([row["sha256"] for row in rows], session_id)
    return rows


@pytest.fixture
def store(tmp_path):
    """A buffer of 300 seed images and 30 the device's sessions trained on."""
    store = Store(tmp_path / "odtd.db")
    policy = ReplayPolicy(capacity_samples=1000)
    update_buffer(store, policy, _add(store, tmp_path, "s", 300, 0), 0, tmp_path)
    for session_id in (1, 2, 3):
        update_buffer(store, policy, _add(store, tmp_path, f"d{session_id}", 10, session_id),
                      session_id, tmp_path)
    yield store
    store.close()


def test_a_full_buffer_keeps_a_rare_class_and_balances_the_common_ones(tmp_path):
    store = Store(tmp_path / "odtd.db")
    rows = _add(store, tmp_path, "c", 90, 0)
    rare = _add(store, tmp_path, "r", 1, 1)[0]
    rare["label"] = "frog"  # offered last, when the buffer is full of the three others
    result = update_buffer(store, ReplayPolicy(capacity_samples=30), rows + [rare], 1, tmp_path)
    labels = Counter(entry["label"] for entry in store.replay_buffer())
    assert result["size"] == 30 and sum(labels.values()) == 30 and labels["frog"] == 1
    common = [labels[label] for label in CLASSES]
    assert max(common) - min(common) <= 1
    store.close()


def test_the_draw_is_class_balanced_and_mostly_the_seed_by_default(store):
    drawn = choose_replay(store, ReplayPolicy(ratio=3, max_samples=60), new_count=20, seed=7)
    assert len(drawn) == 60
    assert set(Counter(row["label"] for row in drawn).values()) == {20}
    assert drawn == choose_replay(store, ReplayPolicy(ratio=3, max_samples=60), 20, seed=7)
    # 30 of 330 buffered images are the device's: a uniform draw of 60 has about 5 of them.
    assert sum(row["session_id"] > 0 for row in drawn) < 15


def test_device_share_draws_the_devices_earlier_images_first(store):
    policy = ReplayPolicy(ratio=3, max_samples=60, device_share=0.25)
    drawn = choose_replay(store, policy, new_count=20, seed=7)
    assert len(drawn) == 60 and len({row["sha256"] for row in drawn}) == 60
    assert all(row["session_id"] > 0 for row in drawn[:15])
    assert {row["session_id"] for row in drawn[:15]} == {1, 2, 3}  # a random sample of every day
    # More share than the device has: all 30 of its images, the rest from the whole buffer.
    drawn = choose_replay(store, policy.model_copy(update={"device_share": 1.0}), 20, seed=7)
    assert len(drawn) == 60 and sum(row["session_id"] > 0 for row in drawn) >= 30
    assert {row["sha256"] for row in drawn[:30]} == \
        {row["sha256"] for row in store.device_samples(100)}
