"""A session measured by the playback backend: energy per session, per rail and per step."""

import sqlite3

from conftest import REPO, odtctl, odtctl_json, write_images

TX2_LOG = REPO / "tests" / "fixtures" / "telemetry" / "tegrastats_tx2_jp46_train_1000.log"


def test_session_records_energy_from_played_back_tx2_log(home, tmp_path):
    (home / "odtd.yaml").write_text(
        f"telemetry:\n  backend: playback\n  playback_file: {TX2_LOG}\n"
        "  playback_interval_ms: 100\n")
    write_images(tmp_path / "imgs", per_class=7)
    odtctl("ingest", str(tmp_path / "imgs"), home=home)
    session = odtctl_json("train-now", "--foreground", home=home)
    assert session["energy_source"] == "playback"  # a recording played back, labelled so
    assert session["energy_j"] > 0 and 0.9 <= session["energy_coverage"] <= 1.0
    rails = session["energy_by_rail_j"]
    assert {"VDD_IN", "VDD_SYS_GPU", "VDD_SYS_CPU"} <= set(rails)
    # The board total is the input rail, never the sum of the input rail and its sub-rails.
    assert abs(session["energy_j"] - rails["VDD_IN"]) < 1e-6
    assert session["energy_j"] < sum(rails.values())
    energy = session["details"]["energy"]
    assert energy["total_rail"] == "VDD_IN" and energy["baseline_power_w"] > 0
    steps = sqlite3.connect(home / "odtd.db").execute(
        "SELECT count(energy_j) FROM steps WHERE session_id = ?", [session["id"]]).fetchone()[0]
    assert steps == session["steps"]
    text = odtctl("status", home=home).stdout
    assert f"{session['energy_j']:.1f} J" in text and "playback" in text and "VDD_IN" in text
