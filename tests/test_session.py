"""The session path end to end through the real CLI, worker subprocess and SQLite."""

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, odtctl, odtctl_json, worker_config, write_images

from odtd.store.records import SESSION_KEYS


def _current(home):
    return (home / "models" / "tinycnn" / "current").read_text().strip()


def test_ingest_train_status(home, tmp_path):
    write_images(tmp_path / "imgs", per_class=7)
    ingest = odtctl_json("ingest", str(tmp_path / "imgs"), home=home)
    assert ingest["accepted"] == 70 and ingest["rejected"] == 0
    session = odtctl_json("train-now", "--foreground", home=home)
    assert set(SESSION_KEYS) <= set(session)
    assert session["outcome"] == "promoted"
    assert session["samples_new"] == 70 - ingest["holdout"]
    assert session["steps"] > 0 and session["peak_memory_mb"] > 50
    assert session["model_version_after"] == session["model_version_before"] + 1
    status = odtctl_json("status", home=home)
    assert status["sessions"][0]["id"] == session["id"]
    assert status["model"]["version"] == session["model_version_after"]
    assert status["samples"]["pending"] == 0
    steps = sqlite3.connect(home / "odtd.db").execute(
        "SELECT count(*), min(end_mono - start_mono) FROM steps WHERE session_id = ?",
        [session["id"]]).fetchone()
    assert steps[0] == session["steps"] and steps[1] > 0
    history = odtctl_json("history", "--limit", "1", home=home)
    assert [s["id"] for s in history] == [session["id"]]
    # Joules per point: this session's energy over the promoted model's gain since day 0.
    cumulative = history[0]["cumulative"]
    gain = round((session["accuracy_after"] - session["accuracy_before"]) * 100, 2)
    assert cumulative["energy_j"] == round(session["energy_j"] or 0.0, 1)
    assert cumulative["gain_points"] == gain
    # From the unrounded energy, as the report divides it (the rounded one can differ by 0.1).
    assert cumulative["j_per_point"] == (
        round((session["energy_j"] or 0.0) / gain, 1) if gain > 0 else None)
    text = odtctl("status", home=home).stdout
    assert "promoted" in text and "accuracy trend" in text
    # Without a validation set the held-out samples are the evaluation set: status and history
    # show their accuracy, the forgetting figure and the per-class accuracy.
    details = session["details"]
    holdout = f"{details['holdout_accuracy_after'] * 100:.1f}%"
    forgetting = f"{details['forgetting'] * 100:.1f} pt"
    per_class = "  ".join(f"{name} {value * 100:.1f}%" for name, value in
                          details["per_class_after"].items() if value is not None)
    row = text.splitlines()[text.splitlines().index(next(
        line for line in text.splitlines() if line.strip().startswith("id "))) + 1]
    assert holdout in row and forgetting in row
    assert per_class.split("  ")[0] in text and "per class" in text
    history_text = odtctl("history", home=home).stdout.splitlines()
    assert "holdout" in history_text[0] and "forgetting" in history_text[0] and "J/pt" in history_text[0]
    assert holdout in history_text[1] and forgetting in history_text[1]


def test_nothing_pending_is_skipped(home):
    session = odtctl_json("train-now", "--foreground", home=home)
    assert (session["outcome"], session["reason"]) == ("skipped", "no pending samples")


def test_killed_worker_fails_cleanly_and_next_session_succeeds(home, tmp_path):
    write_images(tmp_path / "imgs", per_class=7)
    odtctl("ingest", str(tmp_path / "imgs"), home=home)
    policy = (home / "policy.yaml").read_text().replace("epochs: 2", "epochs: 500")
    (home / "policy.yaml").write_text(policy)
    before = _current(home)
    pending = odtctl_json("status", home=home)["samples"]["pending"]
    env = dict(os.environ, ODTD_HOME=str(home))
    cli = subprocess.Popen([sys.executable, "-m", "odtd.cli", "train-now", "--foreground", "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    db = sqlite3.connect(home / "odtd.db")
    worker_pid = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and worker_pid is None:
        row = db.execute("SELECT worker_pid, steps FROM sessions WHERE state = 'running'").fetchone()
        if row and row[0] and (row[1] or 0) > 0:  # the worker is mid-training
            worker_pid = row[0]
        time.sleep(0.2)
    assert worker_pid, "the worker never started training"
    os.kill(worker_pid, signal.SIGKILL)
    out, err = cli.communicate(timeout=60)
    session = json.loads(out)
    assert cli.returncode == 1
    assert session["outcome"] == "failed"
    assert "SIGKILL" in session["reason"]
    assert _current(home) == before
    assert odtctl_json("status", home=home)["samples"]["pending"] == pending
    # The served model is whole, and the next session succeeds.
    (home / "policy.yaml").write_text(policy.replace("epochs: 500", "epochs: 1"))
    again = odtctl_json("train-now", "--foreground", home=home)
    assert again["outcome"] == "promoted"


def test_a_session_goes_on_when_its_progress_reader_goes_away(home, tmp_path):
    # `odtctl train-now --foreground 2>&1 | head -2`: the pipe closes after two progress lines.
    write_images(tmp_path / "imgs", per_class=7)
    odtctl("ingest", str(tmp_path / "imgs"), home=home)
    env = dict(os.environ, ODTD_HOME=str(home))
    cli = subprocess.Popen([sys.executable, "-m", "odtd.cli", "train-now", "--foreground", "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    first = cli.stderr.readline()
    assert first.startswith("session 1: ")
    cli.stderr.close()  # the reader goes away; the next progress line meets a broken pipe
    out = cli.stdout.read()
    assert cli.wait(timeout=120) == 0
    assert json.loads(out)["outcome"] == "promoted"
    assert odtctl_json("history", home=home)[0]["outcome"] == "promoted"


def test_second_session_is_refused_while_one_holds_the_lock(home):
    import fcntl

    lock = home / "run" / "session.lock"
    lock.parent.mkdir(exist_ok=True)
    with open(lock, "w") as handle:
        handle.write("4242")
        handle.flush()
        fcntl.flock(handle, fcntl.LOCK_EX)
        proc = odtctl("train-now", "--foreground", home=home, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "Error: a session is already running (pid 4242); wait for it to finish"


def test_cli_errors_are_one_line(home, tmp_path):
    proc = odtctl("ingest", "/no/such/path", home=home, check=False)
    assert proc.returncode == 1
    assert proc.stderr == "Error: /no/such/path: no such file or directory\n"
    proc = odtctl("init", "--model", "tinycnn", home=home, check=False)
    assert proc.returncode == 1 and "already an odtd home; pass --force" in proc.stderr
    proc = odtctl("status", home=tmp_path / "nothing", check=False)
    assert proc.returncode == 1 and "not an odtd home" in proc.stderr
    proc = odtctl("init", "--model", "resnet9000", home=tmp_path / "new", check=False)
    assert proc.stderr.startswith("Error: unknown model 'resnet9000'")
    assert not (tmp_path / "new").exists()


def test_init_writes_the_models_own_recipe(_base_home, tmp_path):
    # densenet40 has a recipe of its own; tinycnn gets the generic default.
    odtctl("init", "--model", "densenet40", home=tmp_path / "dn")
    policies = REPO / "policies"
    assert (tmp_path / "dn" / "policy.yaml").read_text() == (policies / "densenet40.yaml").read_text()
    assert (_base_home / "policy.yaml").read_text() == (policies / "default.yaml").read_text()


@pytest.mark.trains  # init and a session start TensorFlow workers
def test_init_replay_seed_is_rehearsed_from_the_first_session(tmp_path):
    write_images(tmp_path / "seed", per_class=3, seed=1)
    home = tmp_path / "home"
    proc = odtctl("init", "--model", "tinycnn", "--replay", str(tmp_path / "nope"), home=home,
                  check=False)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert errors == [proc.stderr.splitlines()[-1]] and errors[0].startswith("Error: --replay ")
    assert "Traceback" not in proc.stderr
    assert not (home / "odtd.db").exists()
    summary = odtctl_json("init", "--model", "tinycnn", "--replay", str(tmp_path / "seed"), home=home)
    # Every 10th image is held out as the reference set (the original domain), the rest seed.
    assert (summary["replay_samples"], summary["reference_samples"]) == (27, 3)
    with np.load(home / "validation" / "reference.npz") as reference:
        assert reference["x"].shape == (3, 32, 32, 3) and reference["x"].dtype == np.uint8
    counts = odtctl_json("status", home=home)["samples"]
    assert (counts["trained"], counts["pending"], counts["holdout"]) == (27, 0, 0)
    buffer = sqlite3.connect(home / "odtd.db").execute(
        "SELECT count(*), count(DISTINCT label) FROM replay_buffer").fetchone()
    assert buffer == (27, 10)
    (home / "policy.yaml").write_text((REPO / "policies" / "tinycnn-test.yaml").read_text())
    write_images(tmp_path / "day1", per_class=2, seed=2)
    ingest = odtctl_json("ingest", str(tmp_path / "day1"), home=home)
    session = odtctl_json("train-now", "--foreground", home=home)
    new = 20 - ingest["holdout"]
    # ratio 1.0: as many rehearsed as new, drawn from the seed (the buffer had nothing else).
    assert session["samples_new"] == new and session["samples_replay"] == new
    assert session["details"]["replay_buffer"]["size"] == 27 + new
    # Both models were scored on the reference set, and status shows it.
    details = session["details"]
    assert details["reference_paired"]["samples"] == 3
    assert {details["reference_accuracy_before"], details["reference_accuracy_after"]} <= \
        {0.0, 1 / 3, 2 / 3, 1.0}
    assert "reference" in odtctl("status", home=home).stdout


@pytest.mark.parametrize("failing", ["Store.add_model_version", "ModelRepo.set_current"])
def test_an_error_while_promoting_changes_nothing_and_fails_the_session(home, tmp_path, monkeypatch,
                                                                       failing):
    from odtd.home.paths import Home
    from odtd.home.versions import ModelRepo
    from odtd.policy import load_policy
    from odtd.session.runner import SessionRunner
    from odtd.store.database import Store

    write_images(tmp_path / "imgs", per_class=4)
    odtctl("ingest", str(tmp_path / "imgs"), home=home)
    # Tolerance 100: the candidate is promoted whatever it scores.
    policy = home / "policy.yaml"
    policy.write_text(policy.read_text().replace("tolerance: 1.0", "tolerance: 100.0"))
    db = sqlite3.connect(home / "odtd.db")

    def state():
        repo = ModelRepo(home / "models", "tinycnn")
        # eval-cache.npz is the served model's own results, written before training: not
        # something a promotion changes.
        files = sorted(p.name for p in repo.dir.iterdir() if p.name != "eval-cache.npz")
        return (repo.current(), repo.versions(), files,
                db.execute("SELECT * FROM model_versions ORDER BY version").fetchall(),
                db.execute("SELECT sha256, status, session_id FROM samples ORDER BY sha256").fetchall(),
                db.execute("SELECT * FROM replay_buffer").fetchall(),
                db.execute("SELECT * FROM replay_seen").fetchall())

    before = state()
    owner, name = failing.split(".")
    cls = {"Store": Store, "ModelRepo": ModelRepo}[owner]
    original = getattr(cls, name)

    def fail_on_the_new_version(self, *args, **kwargs):
        if name == "set_current" and args[0] == 0:
            return original(self, *args, **kwargs)  # putting the old pointer back may work
        raise OSError(f"{failing} failed (injected)")

    monkeypatch.setattr(cls, name, fail_on_the_new_version)
    odtd_home = Home(home)
    store = odtd_home.open_store()
    try:
        session = SessionRunner(odtd_home, store, worker_config(), load_policy(policy)).run().to_dict()
    finally:
        store.close()
    assert session["outcome"] == "failed"
    assert session["reason"].startswith("internal error while accepting the candidate: OSError")
    assert f"{failing} failed (injected)" in session["reason"]
    assert session["model_version_after"] == session["model_version_before"] == 0
    assert state() == before  # served model, versions, samples and replay buffer as they were
    assert db.execute("SELECT count(*) FROM events WHERE kind = 'promoted'").fetchone()[0] == 0
    assert odtctl_json("status", home=home)["samples"]["pending"] > 0


def test_a_guarded_candidate_without_a_reference_score_is_refused(home, tmp_path):
    # The worker scores every candidate the session could accept on the reference set; should a
    # result ever lack that score, promotion refuses rather than promote unguarded. Later, the
    # guard also holds a candidate to the first model's reference accuracy.
    from odtd.home.paths import Home
    from odtd.home.versions import ModelRepo
    from odtd.policy import load_policy
    from odtd.report.status import model_status
    from odtd.session.promotion import Promotion
    from odtd.store.records import SessionRecord

    policy = home / "policy.yaml"
    policy.write_text(policy.read_text().replace("acceptance:\n",
                                                 "acceptance:\n  reference_tolerance: 1.0\n"))
    odtd_home = Home(home)
    store = odtd_home.open_store()
    repo = ModelRepo(home / "models", "tinycnn")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    shutil.copyfile(repo.weights_path(repo.current()), job_dir / "candidate.npz")
    record = SessionRecord(day="2026-11-26", trigger="cli", model_version_before=repo.current(),
                           accuracy_before=0.5, accuracy_after=0.8)
    record.details.reference_accuracy_before = 0.5
    try:
        assert model_status(odtd_home, store)["accuracy"] is None  # nothing measured v0 yet
        store.start_session(record)
        Promotion(odtd_home, store, repo, load_policy(policy), lambda message: None).conclude(
            record, [], job_dir, {})
        assert record.outcome == "rolled_back"
        assert record.reason.startswith("the candidate was not scored on the reference set")
        assert repo.current() == 0 and repo.versions() == [0]
        assert store.session(record.id).outcome == "rolled_back"
        # Version 0 has no figure of its own: status shows the one the refusal measured.
        assert model_status(odtd_home, store)["accuracy"] == 0.5
        # With the reference score, the same candidate is promoted.
        again = SessionRecord(day="2026-11-26", trigger="cli", model_version_before=0,
                              accuracy_before=0.5, accuracy_after=0.8)
        again.details.reference_accuracy_before = again.details.reference_accuracy_after = 0.5
        store.start_session(again)
        shutil.copyfile(repo.weights_path(0), job_dir / "candidate.npz")
        Promotion(odtd_home, store, repo, load_policy(policy), lambda message: None).conclude(
            again, [], job_dir, {})
        assert again.outcome == "promoted" and repo.current() == 1
        assert model_status(odtd_home, store)["accuracy"] == 0.8
        # Version 1 lost a little on the reference; a candidate that loses 0.6 more passes
        # against it but not against version 0's 50% (the first session's measure): refused.
        third = SessionRecord(day="2026-11-27", trigger="cli", model_version_before=1,
                              accuracy_before=0.8, accuracy_after=0.9)
        third.details.reference_accuracy_before = 0.495
        third.details.reference_accuracy_after = 0.489
        store.start_session(third)
        shutil.copyfile(repo.weights_path(1), job_dir / "candidate.npz")
        Promotion(odtd_home, store, repo, load_policy(policy), lambda message: None).conclude(
            third, [], job_dir, {})
        assert third.outcome == "rolled_back" and repo.current() == 1
        assert "vs the first model's 50.00%: 1.10 points below it" in third.reason
    finally:
        store.close()


def test_a_rounds_model_as_the_fleet_sent_it_is_judged_by_round_confidence_z(home, tmp_path):
    # The same gain (6 images gained, 2 lost of 100: +4 points, standard error 2.8) is 1.5
    # standard errors short of 0 but half of one clear: a federated round's candidate at
    # trained_share 0 (the round's model as it came) is promoted under round_confidence_z 0.5;
    # the round's candidate with a share of the device's update, and a local session's, are
    # refused by confidence_z 1.5, and so is the round's model where the policy sets no
    # round_confidence_z.
    from odtd.home.paths import Home
    from odtd.home.versions import ModelRepo
    from odtd.policy import load_policy
    from odtd.session.promotion import Promotion
    from odtd.store.records import SessionRecord

    policy = home / "policy.yaml"
    strict = policy.read_text().replace("  tolerance: 1.0", "  tolerance: 0.0\n  confidence_z: 1.5")
    policy.write_text(strict.replace("acceptance:\n", "acceptance:\n  round_confidence_z: 0.5\n"))
    odtd_home = Home(home)
    store = odtd_home.open_store()
    repo = ModelRepo(home / "models", "tinycnn")
    job_dir = tmp_path / "job"
    job_dir.mkdir()

    def concluded(share, federated=True, policy_file=policy):
        shutil.copyfile(repo.weights_path(repo.current()), job_dir / "candidate.npz")
        record = SessionRecord(day="2026-12-01", trigger="fleet" if federated else "cli",
                               model_version_before=repo.current(), accuracy_before=0.50,
                               accuracy_after=0.54)
        record.details.paired = {"gained": 6, "lost": 2, "samples": 100}
        record.details.trained_share = share
        record.details.federated = {"run_id": "1", "round": 1} if federated else None
        store.start_session(record)
        Promotion(odtd_home, store, repo, load_policy(policy_file), lambda message: None).conclude(
            record, [], job_dir, {"trained_share": share})
        return record

    try:
        for share, federated in ((0.25, True), (0.0, False)):
            refused = concluded(share, federated)
            assert refused.outcome == "rolled_back" and repo.current() == 0
            assert "- 1.5 x 2.80 (standard error) = -0.20 points" in refused.reason
        unset = tmp_path / "unset.yaml"
        unset.write_text(strict)
        assert concluded(0.0, policy_file=unset).outcome == "rolled_back"
        kept = concluded(0.0)
        assert kept.outcome == "promoted" and repo.current() == 1
        assert kept.reason == "accepted: the round's model as the fleet sent it"
    finally:
        store.close()


def test_what_a_session_trains_does_not_depend_on_the_second_its_images_arrived(home, tmp_path):
    # Two homes get the same day's images in two batches, a second apart, in opposite orders:
    # their samples' stored times differ, their sessions must train alike (the worker is
    # deterministic for one job, so the weights are equal only if the jobs' data are).
    write_images(tmp_path / "a", per_class=3, seed=1)
    write_images(tmp_path / "b", per_class=3, seed=2)
    other = tmp_path / "other"
    shutil.copytree(home, other, symlinks=True)
    for target, batches in ((home, "ab"), (other, "ba")):
        policy = (target / "policy.yaml").read_text()
        assert "tolerance: 1.0" in policy  # every candidate promoted, so its weights are kept
        (target / "policy.yaml").write_text(policy.replace("tolerance: 1.0", "tolerance: 100.0"))
        for i, batch in enumerate(batches):
            if i:
                time.sleep(1.1)  # stored in the next second
            odtctl("ingest", str(tmp_path / batch), home=target)
    stored = [dict(sqlite3.connect(h / "odtd.db").execute(
        "SELECT sha256, ingested_at FROM samples WHERE status = 'pending'").fetchall())
        for h in (home, other)]
    assert stored[0].keys() == stored[1].keys() and stored[0] != stored[1]
    weights = []
    for target in (home, other):
        session = odtctl_json("train-now", "--foreground", home=target)
        assert session["outcome"] == "promoted", session
        with np.load(target / "models" / "tinycnn" / _current(target) / "weights.npz") as arrays:
            weights.append({key: arrays[key] for key in arrays.files})
    assert all(np.array_equal(weights[0][key], weights[1][key]) for key in weights[0])
