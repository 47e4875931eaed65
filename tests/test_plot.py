"""``odtctl plot``: a home's sessions, and a reproduction's arms from its summary."""

import json

import pytest
from conftest import odtctl, odtctl_json

from odtd.store.database import Store
from odtd.store.records import SessionRecord

PNG = b"\x89PNG\r\n\x1a\n"


def test_sessions_are_drawn_from_the_home(home, tmp_path):
    store = Store(home / "odtd.db")
    for day, outcome, after in (("2026-11-23", "promoted", 0.55), ("2026-11-24", "rolled_back", 0.50)):
        record = SessionRecord(day=day, trigger="cli", outcome=outcome, accuracy_before=0.52,
                               accuracy_after=after, energy_j=120.0, peak_memory_mb=600.0)
        record.id = store.start_session(record)
        record.state = "done"
        store.finish_session(record)
    store.close()
    out = tmp_path / "sessions.png"
    assert odtctl_json("plot", "--out", str(out), home=home) == {"out": str(out), "sessions": 2}
    assert out.read_bytes()[:8] == PNG


def _summary(days=2, seeds=(0, 1)):
    """A reproduction summary of two arms, shaped as scripts/reproduce_tx2_daily.py --json's."""
    def arm(day, gain):
        return {"shifted": 0.30 + gain * day, "clean": 0.50, "energy_j_total": 100.0 * day or None,
                "energy_source": "estimate"}
    runs = [{"seed": seed, "rows": [{"day": day, "arms": {"odtd": arm(day, 0.02), "none": arm(day, 0.0)}}
                                    for day in range(days + 1)]} for seed in seeds]
    return {"arms": ["odtd", "none"], "arm_descriptions": {"odtd": "odtd as configured"},
            "days": days, "seeds": list(seeds), "shift": "dusk", "model": "tinycnn", "per_day": 64,
            "test_images": {"all": 100, "daily": 50, "domains": ["shifted", "clean"]}, "runs": runs}


def test_a_reproductions_arms_are_drawn_from_its_summary(tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(_summary()))
    out = tmp_path / "arms.png"
    assert odtctl_json("plot", "--arms", str(summary), "--out", str(out)) == {
        "out": str(out), "arms": ["odtd", "none"]}
    assert out.read_bytes()[:8] == PNG


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read a reproduction summary from"),
    ('{"sessions": []}', "is not a reproduction summary (scripts/reproduce_tx2_daily.py --json"),
])
def test_a_file_that_is_no_summary_is_one_line(tmp_path, content, message):
    summary = tmp_path / "summary.json"
    summary.write_text(content)
    proc = odtctl("plot", "--arms", str(summary), "--out", str(tmp_path / "x.png"), check=False)
    assert proc.returncode == 1 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.png").exists()
