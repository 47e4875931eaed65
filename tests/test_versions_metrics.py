"""Model versions (rollback, export) and the Prometheus page, through the real CLI."""

import json
import sqlite3

import numpy as np
import pytest
from conftest import odtctl, odtctl_json, write_images


@pytest.fixture
def trained_home(home, tmp_path):
    """A tinycnn home with v0 and one promoted session (v1)."""
    write_images(tmp_path / "imgs", per_class=7)
    odtctl("ingest", str(tmp_path / "imgs"), home=home)
    session = odtctl_json("train-now", "--foreground", home=home)
    assert session["outcome"] == "promoted" and session["model_version_after"] == 1
    return home


def _events(home, kind):
    rows = sqlite3.connect(home / "odtd.db").execute(
        "SELECT data FROM events WHERE kind = ? ORDER BY id", [kind]).fetchall()
    return [json.loads(data) for (data,) in rows]


def _current(home):
    return {row["version"] for row in odtctl_json("models", "versions", home=home) if row["current"]}


def test_rollback_and_export_are_verified_and_recorded(trained_home, tmp_path):
    home = trained_home
    assert _current(home) == {1}
    odtctl("models", "rollback", "0", home=home)
    assert (home / "models" / "tinycnn" / "current").read_text() == "v0\n"
    assert _current(home) == {0}
    assert _events(home, "rollback") == [{"previous": 1, "version": 0}]

    missing = odtctl("models", "rollback", "7", home=home, check=False)
    assert missing.returncode != 0 and len(missing.stderr.strip().splitlines()) == 1
    assert missing.stderr.startswith("Error:") and _current(home) == {0}

    out = tmp_path / "export" / "v1.npz"
    exported = odtctl_json("models", "export", "1", "--out", str(out), home=home)
    manifest = json.loads((home / "models" / "tinycnn" / "v1" / "manifest.json").read_text())
    assert exported["sha256"] == manifest["sha256"]
    with np.load(out, allow_pickle=False) as weights:
        assert len(weights.files) > 0
    assert _events(home, "export") == [{"out": str(out), "version": 1}]
    # Atomic writes leave no temporary files behind.
    assert not [p for p in (home / "models").rglob("*") if p.name.endswith(".tmp")]
    assert not [p for p in out.parent.iterdir() if p != out]


def test_metrics_page_and_textfile(trained_home, tmp_path):
    text = odtctl("metrics", home=trained_home).stdout
    lines = set(text.splitlines())
    assert 'odtd_sessions_total{outcome="promoted"} 1' in lines
    assert "odtd_up 0" in lines and "odtd_samples_pending 0" in lines
    assert "# TYPE odtd_sessions_total counter" in lines
    out = tmp_path / "textfile" / "odtd.prom"
    out.parent.mkdir()
    odtctl("metrics", "--out", str(out), home=trained_home)

    def steady(page):  # the free space moves with whatever else writes to this disk
        return [line for line in page.splitlines() if not line.startswith("odtd_storage_free_bytes ")]
    assert steady(out.read_text()) == steady(text)
    assert len(steady(text)) == len(text.splitlines()) - 1
    assert [p.name for p in out.parent.iterdir()] == ["odtd.prom"]
