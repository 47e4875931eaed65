"""Policies acting on real sessions: memory budget, out-of-memory halving, gates."""

import sqlite3
import stat
import sys
import time

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
