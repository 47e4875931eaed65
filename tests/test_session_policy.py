"""Policies acting on real sessions: memory budget, out-of-memory halving, gates."""

import json
import sqlite3
import stat
import sys
import time

import numpy as np
from conftest import odtctl, odtctl_json, write_images


def _ingest(home, tmp_path, seed=0):
    write_images(tmp_path / "imgs", per_class=7, seed=seed)
    odtctl("ingest", str(tmp_path / "imgs"), home=home)


def _set_policy(home, old, new):
    path = home / "policy.yaml"
    path.write_text(path.read_text().replace(old, new))


def test_batch_over_memory_budget_is_skipped_with_the_reason(home, tmp_path):
    _ingest(home, tmp_path)
    odtctl("profile", "--batch-sizes", "2,4", "--steps", "3", home=home)
    _set_policy(home, "batch:\n  size: 8", "batch:\n  size: 8\n  memory_budget_mb: 50")
    session = odtctl_json("train-now", "--foreground", home=home)
    assert session["outcome"] == "skipped"
    assert "tinycnn does not fit the memory cap even at batch 1" in session["reason"]
    assert "50 MB budget less 15% headroom" in session["reason"]
    assert odtctl_json("status", home=home)["samples"]["pending"] > 0  # nothing was lost


def test_a_session_waits_for_the_new_samples_the_schedule_asks(home, tmp_path):
    _ingest(home, tmp_path)
    pending = odtctl_json("status", home=home)["samples"]["pending"]
    _set_policy(home, "training:", f"schedule:\n  min_new_samples: {pending + 1}\ntraining:")
    session = odtctl_json("train-now", "--foreground", home=home)
    assert (session["outcome"], session["reason"]) == (
        "skipped", f"waiting for {pending + 1} new samples, {pending} pending")
    assert session["energy_j"] is None and not session["steps"]  # no worker ran
    assert odtctl_json("status", home=home)["samples"]["pending"] == pending  # nothing was lost


def test_out_of_memory_halves_the_batch_and_is_remembered(home, tmp_path):
    _ingest(home, tmp_path)
    # A worker interpreter that runs out of memory at batch 8, as TensorFlow reports it.
    fake = tmp_path / "python-oom-at-8"
    fake.write_text(f"""#!{sys.executable}
import json, sys
job = json.load(open(sys.argv[-1]))
if job.get("batch_size") == 8:
    print(json.dumps({{"event": "error", "kind": "oom", "message": "OOM when allocating tensor"}}))
    sys.exit(2)
import runpy
sys.argv = sys.argv[2:]
runpy.run_module("odtd.trainer.worker", run_name="__main__")
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    (home / "odtd.yaml").write_text(f"trainer:\n  python: {fake}\n")
    session = odtctl_json("train-now", "--foreground", home=home)
    assert session["outcome"] == "promoted"
    assert session["batch_size"] == 4
    attempts = session["details"]["attempts"]
    assert attempts[0]["batch_size"] == 8 and attempts[0]["oom"] is True
    db = sqlite3.connect(home / "odtd.db")
    assert db.execute("SELECT value FROM meta WHERE key = 'oom_limit_tinycnn'").fetchone()[0] == "8"
    # The next session starts below the learned limit.
    _ingest(home, tmp_path / "more", seed=1)
    again = odtctl_json("train-now", "--foreground", home=home)
    assert again["outcome"] in ("promoted", "rolled_back")  # trained: random images may not help
    assert again["batch_size"] < 8 and "attempts" not in again["details"]  # no retry this time


def test_gate_closing_mid_session_interrupts_it(home, tmp_path):
    _ingest(home, tmp_path)
    _set_policy(home, "epochs: 2", "epochs: 500")
    (home / "policy.yaml").write_text((home / "policy.yaml").read_text()
                                      + "gates:\n  check_interval_s: 0.5\n")
    import subprocess

    from conftest import REPO
    env = {"ODTD_HOME": str(home), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-m", "odtd.cli", "train-now", "--foreground", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    db = sqlite3.connect(home / "odtd.db")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        row = db.execute("SELECT steps FROM sessions WHERE state = 'running'").fetchone()
        if row and (row[0] or 0) > 0:
            break
        time.sleep(0.2)
    (home / "run" / "force-gate-closed").write_text("temperature\n")
    out, _ = proc.communicate(timeout=60)
    import json

    session = json.loads(out)
    assert session["outcome"] == "interrupted"
    assert session["reason"].startswith("gate temperature closed")
    # With the gate still closed, the next session does not start; --force bypasses gates.
    assert odtctl_json("train-now", "--foreground", home=home)["reason"].startswith("gate temperature closed")
    _set_policy(home, "epochs: 500", "epochs: 1")
    forced = odtctl_json("train-now", "--foreground", "--force", home=home)
    assert forced["outcome"] == "promoted" and forced["details"]["forced"] is True


def test_status_reports_each_configured_gate(home):
    (home / "policy.yaml").write_text((home / "policy.yaml").read_text()
                                      + "gates:\n  min_battery_pct: 30\n  window: '00:00-23:59'\n")
    (home / "run").mkdir(exist_ok=True)
    (home / "run" / "force-gate-closed").write_text("window\n")
    gates = {g["name"]: g for g in odtctl_json("status", home=home)["gates"]["gates"]}
    assert gates["window"]["passed"] is False
    assert "battery" in gates
    assert "gates" in odtctl("status", home=home).stdout


def test_a_batch_that_fits_only_recomputed_runs_recomputed_and_explain_says_why(home, tmp_path):
    from odtd.store.database import Store

    _ingest(home, tmp_path)
    # A profile of this board: whole batches 600 + 40 MB x batch, recomputed 600 + 10 MB x batch.
    rows = [{"batch_size": size, "precision": "fp32", "recompute": recompute, "status": "ok",
             "samples_per_s": 100.0 if recompute else 140.0, "peak_memory_mb": 600 + per * size}
            for size in (2, 4, 8) for recompute, per in ((False, 40.0), (True, 10.0))]
    store = Store(home / "odtd.db")
    store.add_profile_rows("tinycnn", "estimate", "test board", 3, rows)
    store.close()
    # Batch 8: whole 920 MB, recomputed 680 MB; the cap: 1000 MB less 15% = 850 MB.
    _set_policy(home, "batch:\n  size: 8", "batch:\n  size: 8\n  memory_budget_mb: 1000")
    _set_policy(home, "training:\n", "training:\n  recompute: auto\n")

    explained = odtctl_json("policy", "explain", home=home)
    admission = explained["admission"]
    assert (admission["batch_size"], admission["recompute"]) == (8, True)
    assert {"batch_size": 8, "plan": "fp32",
            "reason": "predicted peak 920 MB > 850 MB (1000 MB budget less 15% headroom)"} \
        in admission["rejected"]
    text = odtctl("policy", "explain", home=home).stdout
    assert "admission: run at batch 8 (fp32+recompute)" in text
    assert "plans not chosen:" in text and "920 MB > 850 MB" in text

    # The session's worker gets the plan: this interpreter keeps the job and stops there.
    _keep_job(home, tmp_path)
    assert odtctl("train-now", "--foreground", home=home, check=False).returncode == 1
    [session] = odtctl_json("history", home=home)
    job = json.loads((tmp_path / "job.json").read_text())
    assert (job["batch_size"], job["recompute"], job["micro_batch_size"]) == (8, True, None)
    assert session["outcome"] == "failed" and session["details"]["admission"]["recompute"]


def _keep_job(home, tmp_path):
    """Make the session's worker an interpreter that keeps the job and its train file, exits 3."""
    keeper = tmp_path / "python-keep-job"
    keeper.write_text(f"#!/bin/sh\ncp \"$3\" {tmp_path}/job.json\n"
                      f"cp \"$(dirname \"$3\")/train.npz\" {tmp_path}/train.npz\nexit 3\n")
    keeper.chmod(0o755)
    config = (home / "odtd.yaml").read_text()
    (home / "odtd.yaml").write_text(config.replace("python: null", f"python: {keeper}"))


def test_the_train_file_marks_the_device_images_for_batchnorm_adaptation(home, tmp_path):
    import hashlib

    from odtd.home.ingest import load_sample_arrays
    from odtd.home.paths import Home
    from odtd.home.replay_buffer import update_buffer
    from odtd.policy import load_policy
    from odtd.store.database import Store

    _ingest(home, tmp_path)
    # Of the pending samples, 20 become the replay seed (the server's, session 0) and 20 an
    # earlier session's (the device's); the rest are today's.
    store = Store(home / "odtd.db")
    pending = store.samples("pending")
    seed, earlier = pending[:20], pending[20:40]
    replay = load_policy(home / "policy.yaml").replay
    for session_id, rows in ((0, seed), (1, earlier)):
        store.mark_trained([row["sha256"] for row in rows], session_id=session_id)
        update_buffer(store, replay, store.samples_by_sha(row["sha256"] for row in rows),
                      session_id, home)
    store.close()
    _set_policy(home, "  freeze_bn: true", "  freeze_bn: true\n  bn_device_share: 0.5")
    _keep_job(home, tmp_path)
    assert odtctl("train-now", "--foreground", home=home, check=False).returncode == 1
    [session] = odtctl_json("history", home=home)
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["bn_device_share"] == 0.5
    assert job["reference_tolerance"] == 0.01  # acceptance.reference_tolerance: 1 point

    def digests(x):
        return [hashlib.sha256(image.tobytes()).hexdigest() for image in x]

    classes = job["classes"]
    seed_x = set(digests(load_sample_arrays(Home(home), seed, classes)[0]))
    device_x = set(digests(load_sample_arrays(Home(home), earlier, classes)[0]))
    with np.load(tmp_path / "train.npz") as train:
        x, mask, extra = train["x"], train["device"], train["device_x"]
    new = session["samples_new"]
    assert len(x) == new + session["samples_replay"] and session["samples_replay"] > 0
    assert mask[:new].all()
    assert set(digests(x[new:][~mask[new:]])) <= seed_x and (~mask).sum() > 0
    assert set(digests(x[new:][mask[new:]])) | set(digests(extra)) == device_x


def test_distillation_reaches_the_job_with_the_device_mask(home, tmp_path):
    # training.distill alone (BatchNorm adaptation off) still marks which images are the
    # device's, so the worker knows which are rehearsed from the original domain.
    _ingest(home, tmp_path)
    _set_policy(home, "  freeze_bn: true", "  freeze_bn: true\n  bn_device_share: null\n"
                "  distill: 2\n  trained_share: auto")
    _keep_job(home, tmp_path)
    # An earlier session measured version 0 on the reference set: the job carries it.
    from odtd.store.database import Store
    from odtd.store.records import SessionRecord

    store = Store(home / "odtd.db")
    earlier = SessionRecord(day="2026-11-20", trigger="cli", model_version_before=0,
                            outcome="rolled_back")
    earlier.details.reference_accuracy_before = 0.625
    store.start_session(earlier)
    store.finish_session(earlier)
    store.close()
    assert odtctl("train-now", "--foreground", home=home, check=False).returncode == 1
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["distill"] == 2.0 and job["bn_device_share"] is None
    assert job["trained_share"] == "auto" and job["reference_origin"] == 0.625
    with np.load(tmp_path / "train.npz") as train:
        assert train["device"].shape == train["y"].shape
    # The session failed (the kept worker exits 3): status says why, below its table.
    session, _earlier = odtctl_json("history", home=home)  # newest first
    assert session["outcome"] == "failed"
    assert f"last session {session['id']} failed: {session['reason']}" in odtctl(
        "status", home=home).stdout
