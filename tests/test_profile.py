"""`odtctl profile` with real worker processes (tinycnn), and `odtctl policy` on what it writes."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, built_once, odtctl, odtctl_json

from odtd.policy import load_policy
from odtd.profiling.sweep import board_description

# Stands in for trainer.python: the real interpreter, except that for batch 3 the process is
# killed by SIGKILL before it starts, as the kernel's OOM killer ends a worker that is too big.
KILLER = """#!/bin/sh
if grep -q '"batch_size": 3,' "$3"; then kill -KILL $$; fi
exec {python} "$@"
"""


@pytest.fixture(scope="session")
def profiled(_base_home, tmp_path_factory):
    """A tinycnn home profiled twice over at batch 2, 3 (killed) and 4, with its policy."""
    def build(root: Path) -> None:
        home = root / "home"
        shutil.copytree(_base_home, home, symlinks=True)
        shutil.copyfile(REPO / "policies" / "tinycnn-test.yaml", home / "policy.yaml")
        killer = root / "python-killer"
        killer.write_text(KILLER.format(python=sys.executable))
        killer.chmod(0o755)
        config = (home / "odtd.yaml").read_text()
        (home / "odtd.yaml").write_text(config.replace("python: null", f"python: {killer}"))
        # 60 measured steps (about 0.1 s of tinycnn): a span of a few milliseconds can fall
        # wholly inside a gap of the 10 ms energy sampler when a loaded machine starves it
        # (over 3 intervals), leaving the row no energy and the energy objective no choice.
        proc = odtctl("profile", "--batch-sizes", "2,3,4", "--steps", "60", "--repeats", "2",
                      "--json",
                      "--write-policy", str(root / "written.yaml"), "--memory-budget-mb", "4000",
                      home=home)
        (root / "stdout.json").write_text(proc.stdout)
        (root / "stderr.txt").write_text(proc.stderr)

    root = built_once(tmp_path_factory, "profiled", build)
    return (root / "home", root / "written.yaml", yaml.safe_load((root / "stdout.json").read_text()),
            (root / "stderr.txt").read_text())


def test_rows_are_measured_and_the_crash_is_a_data_point(profiled):
    _, _, data, stderr = profiled
    rows = {row["batch_size"]: row for row in data["rows"]}
    assert sorted(rows) == [2, 3, 4]
    for size in (2, 4):
        assert rows[size]["status"] == "ok"
        assert rows[size]["samples_per_s"] > 0 and rows[size]["step_s"] > 0
        assert rows[size]["peak_memory_mb"] > 50
        assert rows[size]["precision"] == rows[size]["precision_resolved"] == "fp32"
        assert rows[size]["energy_source"] is not None and rows[size]["energy_per_sample_j"] > 0
    assert rows[3]["status"] == "does_not_fit"
    assert rows[3]["reason"].startswith("worker killed by SIGKILL")
    fit = data["memory_model"]["fp32"]
    assert fit["per_sample_mb"] is not None and fit["fixed_mb"] > 0
    assert sorted({point[0] for point in fit["points"]}) == [2, 4]
    assert data["profile_id"] == 1 and data["model"] == "tinycnn"
    assert "batch 3: does not fit" in stderr and "worker starting" in stderr


def test_repeats_run_each_size_again_and_fit_through_every_run(profiled):
    home, _, data, stderr = profiled
    rows = {row["batch_size"]: row for row in data["rows"]}
    for size in (2, 4):
        runs = rows[size]["peak_memory_runs_mb"]
        assert len(runs) == 2 and rows[size]["peak_memory_mb"] == max(runs)
    assert rows[3]["peak_memory_runs_mb"] is None  # killed in pass 1, not run again
    job_dirs = sorted(path.name.rsplit("-", 2)[-2:] for path in (home / "runs").iterdir()
                      if path.name.startswith("profile-"))
    assert job_dirs == [["b2", "r1"], ["b2", "r2"], ["b3", "r1"], ["b4", "r1"], ["b4", "r2"]]
    fit = data["memory_model"]["fp32"]
    assert [point[0] for point in fit["points"]] == [2, 2, 4, 4]
    assert fit["spread_pct"] is not None and fit["spread_pct"] >= 0
    assert "pass 2 of 2" in stderr


def test_written_policy_validates_and_explains(profiled):
    home, written, data, _ = profiled
    policy = load_policy(written, missing_ok=False)
    # Batch 4 ran, but batch 3 did not: the writer does not choose above a size that failed.
    assert policy.batch.size == 2 and policy.batch.memory_budget_mb == 4000
    text = written.read_text()
    assert text.startswith("# odtd policy written by `odtctl profile`")
    assert "does_not_fit" in text and "memory fit (fp32): peak_mb = " in text
    out = odtctl("policy", "validate", str(written), home=home).stdout
    assert out.startswith(f"{written}: valid; batch {policy.batch.size}")
    explained = odtctl_json("policy", "explain", str(written), home=home)
    by_size = {p["batch_size"]: p for p in explained["predictions"]}
    assert {2, 4, 32} <= set(by_size)
    assert by_size[32]["peak_mb"] is not None and by_size[32]["time_s"] > 0
    # Past batch 4, the largest that ran, the memory line is an extrapolation, and says so.
    assert by_size[32]["memory_extrapolated_past"] == 4
    assert by_size[2]["memory_extrapolated_past"] is None
    # Batch 3 did not run, so a larger size is refused whatever the line predicts.
    assert by_size[4]["fits_memory"] is False and "batch 3 did not run" in by_size[4]["memory_problem"]


def one_error_line(home: Path, path: Path, text: str) -> str:
    path.write_text(text)
    proc = odtctl("policy", "validate", str(path), home=home, check=False)
    assert proc.returncode == 1, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_validate_failures_are_one_precise_line(profiled, tmp_path):
    home = profiled[0]
    path = tmp_path / "p.yaml"
    assert one_error_line(home, path, "batch:\n  sise: 8\n") == \
        f"Error: {path}: unknown key 'batch.sise'; remove it or check its spelling"
    assert one_error_line(home, path, "batch:\n  size: -4\n") == \
        f"Error: {path}: batch.size=-4: Input should be greater than or equal to 1"
    assert one_error_line(home, path, "gates:\n  window: '25:00-06:00'\n") == \
        f"Error: {path}: gates.window='25:00-06:00': '25:00-06:00' is not a window like '01:00-06:00'"
    line = one_error_line(home, path, "batch:\n  size: 2\n  memory_budget_mb: 100\n")
    assert line.startswith(f"Error: {path}: batch.size=2: needs ~")
    assert "the memory budget 100 MB less 15% headroom is 85 MB" in line
    assert line.endswith("raise batch.memory_budget_mb")
    line = one_error_line(home, path, "batch:\n  size: 8\n")
    assert line.startswith(f"Error: {path}: batch.size=8: batch 3 did not run when tinycnn was "
                           "profiled (worker killed by SIGKILL")


def test_schema_lists_every_section():
    schema = odtctl_json("policy", "schema")
    assert {"batch", "energy", "gates", "training"} <= set(schema["properties"])


def test_the_board_is_the_device_tree_model_else_the_cpu(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Some Xeon\n")
    assert board_description(tmp_path).endswith(", Some Xeon, " + f"{os.cpu_count()} CPUs")
    (tmp_path / "proc" / "device-tree").mkdir()
    (tmp_path / "proc" / "device-tree" / "model").write_bytes(b"NVIDIA Jetson TX2 Developer Kit\0")
    assert board_description(tmp_path) == "NVIDIA Jetson TX2 Developer Kit"
