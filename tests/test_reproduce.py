"""scripts/reproduce_tx2_daily.py end to end on a sliver of the real CIFAR-10 archive (tinycnn: the
same path as densenet40, in a tenth of the time): a camera shift and the arms, two days.

Every TensorFlow worker costs 5-7 s here, so the sliver is one run with what it must show: odtd
(a), its session controls (b, c) and the base model (f); the arms that are one worker job a day,
plain fine-tuning (d) and BatchNorm re-estimation (e), are tested on their own in test_arms.py.
The base model is not pre-trained (0 epochs): the test is about the path, not the accuracy.
"""

import json
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
from conftest import CIFAR, REPO

from odtd.policy import load_policy
from odtd.session.acceptance import refusal_reason
from odtd.sim.scoring import per_validation_point

SCRIPT = str(REPO / "scripts" / "reproduce_tx2_daily.py")
SLIVER = ["--model", "tinycnn", "--days", "2", "--per-day", "10", "--pretrain-images", "60",
          "--pretrain-max-epochs", "0", "--validation-images", "50", "--test-images", "100",
          "--daily-test-images", "50"]


def sample_arrays(home, where):
    db = sqlite3.connect(home / "odtd.db")
    rows = db.execute(f"SELECT array_path, label FROM samples WHERE {where} ORDER BY sha256").fetchall()
    return [np.load(home / path) for path, _ in rows], sorted(label for _, label in rows)


@pytest.mark.trains
@pytest.mark.skipif(not CIFAR.exists(), reason=f"CIFAR-10 archive not at {CIFAR} (set ODTD_CIFAR10)")
def test_two_days_of_the_arms_with_a_camera_shift_on_an_imported_model(tmp_path):
    work, plot = tmp_path / "work", tmp_path / "plot.png"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--cifar", str(CIFAR), *SLIVER, "--shift", "dusk",
         "--arms", "a,b,c,f", "--work", str(work), "--plot", str(plot), "--json", "--import-model"],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    arms = ["odtd", "replay", "clean", "none"]
    assert summary["arms"] == arms and summary["shift"] == "dusk" and summary["seeds"] == [0]
    # The base model reached odtd as a user's Keras file: every home serves the imported model.
    assert summary["imported"] and (work / "base.keras").is_file()
    assert list((work / "homes" / "s0-odtd" / "models").glob("*/architecture.json"))
    assert summary["test_images"] == {"all": 100, "daily": 50, "domains": ["shifted", "clean"]}
    shipped = load_policy(REPO / "policies" / "densenet40.yaml").acceptance  # the default --policy
    assert summary["acceptance"] == shipped.model_dump()
    run = summary["runs"][0]
    rows = run["rows"]
    assert [r["day"] for r in rows] == [0, 1, 2]
    base = summary["pretrain"]
    for arm in arms:  # every arm starts from the same base model, scored once
        assert rows[0]["arms"][arm]["validation"] == base["validation_accuracy"]
    assert rows[0]["arms"]["odtd"]["shifted"] == rows[0]["arms"]["none"]["shifted"]
    day0 = rows[0]["arms"]["none"]  # the log's day-0 line, before day 1's
    assert (f"seed 0 day 0: every arm {100 * day0['shifted']:.2f} / {100 * day0['clean']:.2f} on the "
            "daily test images (shifted / clean)") in proc.stderr.split("seed 0 day 1:")[0]
    energy = {arm: 0.0 for arm in arms}
    for row in rows[1:]:
        day = row["arms"]
        # The base model every day; its scores are the day-0 ones.
        assert (day["none"]["shifted"], day["none"]["clean"], day["none"]["energy_j"]) == (
            rows[0]["arms"]["none"]["shifted"], rows[0]["arms"]["none"]["clean"], 0.0)
        for arm in ("odtd", "replay", "clean"):
            assert day[arm]["outcome"] in ("promoted", "rolled_back")
            assert day[arm]["energy_j"] > 0 and day[arm]["peak_memory_mb"] > 100
            kept = "validation_after" if day[arm]["outcome"] == "promoted" else "validation_before"
            assert day[arm]["validation"] == day[arm][kept]
        # odtd holds one in eight out of training; its controls train on as many new images.
        assert day["odtd"]["ingested"] == 10 and day["odtd"]["samples_new"] <= 10
        assert day["replay"]["samples_new"] == day["clean"]["samples_new"] == day["odtd"]["samples_new"]
        for arm in arms:
            energy[arm] += day[arm]["energy_j"]
            assert day[arm]["energy_j_total"] == pytest.approx(energy[arm], abs=0.1)
            gain = day[arm]["validation"] - base["validation_accuracy"]
            assert day[arm]["joules_per_point"] == per_validation_point(day[arm]["energy_j_total"], gain)
        # The paired differences are the accuracies' differences, with their standard errors.
        assert set(row["differences"]) == {f"odtd-{arm}" for arm in arms[1:]}
        for arm in arms[1:]:
            for domain in ("shifted", "clean"):
                difference = row["differences"][f"odtd-{arm}"][domain]
                assert difference["points"] == pytest.approx(100 * (day["odtd"][domain] - day[arm][domain]))
                assert difference["se"] >= 0 and difference["seeds"] == 1
    final = summary["final"]
    assert set(final["arms"]) == set(arms) and final["seeds"] == [0]
    assert final["arms"]["none"]["gain_points"] == {"shifted": 0.0, "clean": 0.0}
    assert final["differences"]["odtd-none"]["shifted"]["points"] == pytest.approx(
        final["arms"]["odtd"]["gain_points"]["shifted"])

    homes = work / "homes"
    # The device's validation set is the shifted check set; pre-training's stays clean.
    with np.load(work / "check.npz") as check, \
            np.load(homes / "s0-odtd" / "validation" / "validation.npz") as device:
        assert np.array_equal(check["y"], device["y"]) and device["x"].mean() < 0.7 * check["x"].mean()
    # (a) learns from the shifted camera, (c) from the same images unshifted, (b) from images
    # of its replay seed: pre-training images it already had.
    odtd_x, odtd_labels = sample_arrays(homes / "s0-odtd", "session_id > 0")
    clean_x, clean_labels = sample_arrays(homes / "s0-clean", "session_id > 0")
    replay_x, _ = sample_arrays(homes / "s0-replay", "session_id > 0")
    seed_x, _ = sample_arrays(homes / "s0-replay", "session_id = 0")
    assert odtd_labels == clean_labels and len(replay_x) == len(odtd_x)
    assert np.mean(odtd_x) < 0.7 * np.mean(clean_x)
    seeded = {x.tobytes() for x in seed_x}
    assert all(x.tobytes() in seeded for x in replay_x)
    # Never the reference set that init --replay held out of the seed.
    with np.load(homes / "s0-replay" / "validation" / "reference.npz") as reference:
        held_out = {x.tobytes() for x in reference["x"]}
    assert held_out and not held_out & {x.tobytes() for x in replay_x}
    # The odtd arm's sessions went through a real home: its guard decided each day, and the
    # second session went on from the first's candidate unless it was promoted.
    db = sqlite3.connect(homes / "s0-odtd" / "odtd.db")
    sessions = db.execute("SELECT outcome, accuracy_before, accuracy_after, details FROM sessions "
                          "WHERE id > 0 ORDER BY id").fetchall()
    assert len(sessions) == 2
    acceptance = summary["acceptance"]
    for outcome, before, after, details in sessions:
        refusal = refusal_reason(before, after, acceptance["tolerance"] / 100,
                                 acceptance["confidence_z"], json.loads(details)["paired"])
        assert (outcome == "promoted") == (refusal is None)
    assert json.loads(sessions[1][3])["resumed"] == bool(json.loads(sessions[0][3]).get("kept_for_resume"))
    assert summary["replay_seed"] == 60
    assert db.execute("SELECT count(*) FROM samples WHERE session_id = 0").fetchone()[0] + len(
        held_out) == 60
    assert db.execute("SELECT sum(samples_replay) FROM sessions").fetchone()[0] > 0

    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = subprocess.run(
        [sys.executable, "-c", "import json, sys; sys.path.insert(0, 'scripts');"
         "import reproduce_tx2_report as r; print(r.table(json.load(sys.stdin)))"],
        input=proc.stdout, capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert "odtd-replay" in text and "odtd-clean" in text and "after day 2, all 100 test images" in text


@pytest.mark.parametrize("options, message", [
    (["--shift", "sepia"], "Error: --shift 'sepia' is not a camera shift; use one of low_light,"),
    (["--shift", "help"], "Error: --shift takes one of: low_light (a third of the light, grainy); "),
    (["--arms", "clean"], "Error: --arms clean: the original domain is the device's without --shift"),
    (["--arms", "odtd,x"], "Error: --arms: 'x' is not an arm; use names or letters of odtd (a), "),
    (["--arms", "replay", "--replay-seed", "100"], "Error: --arms replay: replay and clean repeat odtd's"),
])
def test_bad_options_are_one_line_before_any_work(tmp_path, options, message):
    archive = tmp_path / "cifar.tar.gz"
    archive.write_bytes(b"")  # never read: the options are checked first
    proc = subprocess.run([sys.executable, SCRIPT, "--cifar", str(archive), "--work", str(tmp_path / "w"),
                           *options], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1
    assert not (tmp_path / "w").exists()


def test_missing_archive_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--cifar", str(tmp_path / "nope.tar.gz")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: --cifar") and proc.stderr.count("\n") == 1


def test_the_shifts_are_listed_without_the_archive():
    proc = subprocess.run([sys.executable, SCRIPT, "--shift", "help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: --shift takes one of: low_light") and "jpeg" in proc.stderr
