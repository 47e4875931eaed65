"""Model versions (rollback, export) and the Prometheus page, through the real CLI."""

import json
import sqlite3

import numpy as np
import pytest
from conftest import odtctl, odtctl_json, write_images
from prometheus_client.parser import text_string_to_metric_families

from odtd.store.records import OUTCOMES


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


def _scalar(home, sql):
    return sqlite3.connect(home / "odtd.db").execute(sql).fetchone()[0]


def test_metrics_page_parses_and_matches_the_database(trained_home, tmp_path):
    text = odtctl("metrics", home=trained_home).stdout
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # Prometheus's conventions, as promtool checks them: a counter's samples end in _total and
    # only a counter's do; every metric says what it is.
    for family in families.values():
        assert family.name.startswith("odtd_") and family.documentation
        names = {sample.name for sample in family.samples}
        if family.type == "counter":
            assert names <= {family.name + "_total", family.name + "_created"}, family.name
        else:
            assert family.type == "gauge" and not any(n.endswith("_total") for n in names), names

    def value(name, **labels):
        (sample,) = [s for s in families[name].samples if s.labels == labels]
        return sample.value

    db = trained_home
    assert families["odtd_sessions"].type == "counter"
    for outcome in OUTCOMES:
        assert value("odtd_sessions", outcome=outcome) == _scalar(
            db, f"SELECT count(*) FROM sessions WHERE outcome = '{outcome}'")
    assert value("odtd_sessions", outcome="promoted") == 1
    assert value("odtd_up") == 0  # no daemon runs this home
    assert value("odtd_samples_pending") == _scalar(
        db, "SELECT count(*) FROM samples WHERE status = 'pending'")
    assert value("odtd_samples_stored") == _scalar(db, "SELECT count(*) FROM samples") > 0
    assert families["odtd_samples_quarantined"].type == "counter"
    assert value("odtd_samples_quarantined") == _scalar(db, "SELECT count(*) FROM quarantine")
    before, after, duration_s, peak_mb = sqlite3.connect(db / "odtd.db").execute(
        "SELECT accuracy_before, accuracy_after, duration_s, peak_memory_mb FROM sessions "
        "WHERE state = 'done' ORDER BY id DESC LIMIT 1").fetchone()
    model = {"model": "tinycnn"}
    assert value("odtd_last_session_accuracy_before_ratio", **model) == pytest.approx(before)
    assert value("odtd_last_session_accuracy_after_ratio", **model) == pytest.approx(after)
    assert value("odtd_model_accuracy_ratio", **model) == pytest.approx(after)  # promoted: kept
    assert value("odtd_last_session_duration_seconds", **model) == pytest.approx(duration_s)
    assert value("odtd_last_session_peak_memory_bytes", **model) == pytest.approx(peak_mb * 2 ** 20)
    assert value("odtd_storage_writable") == 1 and value("odtd_storage_free_bytes") > 0
    assert value("odtd_storage_pruned_samples") == 0

    out = tmp_path / "textfile" / "odtd.prom"
    out.parent.mkdir()
    odtctl("metrics", "--out", str(out), home=trained_home)

    def steady(page):  # the free space moves with whatever else writes to this disk
        return [line for line in page.splitlines() if not line.startswith("odtd_storage_free_bytes ")]
    assert steady(out.read_text()) == steady(text)
    assert len(steady(text)) == len(text.splitlines()) - 1
    assert [p.name for p in out.parent.iterdir()] == ["odtd.prom"]
