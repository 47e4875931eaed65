"""A Flower fleet through Flower's real processes: a SuperLink, a SuperNode per device, `flwr run`.

Three tinycnn homes, each with its own daemon; two rounds. The third device has its charging
gate forced closed: it declines each round with that reason and the rounds complete with the
others. The second device's daemon is killed (SIGKILL) as its session of round 1 starts: it
declines that round, its home stays intact, and, started again at once, it takes round 2. The
first device's trainer worker is killed (SIGKILL) in round 2: its session fails, it declines
that round with the reason, and its home keeps the model it served. One fleet
serves one test (`make test`'s budget: its start and two rounds take about a minute).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, odtctl, odtctl_json, trainer_python_yaml, wait_for, write_images
from test_daemon import FAST_CONFIG, start_daemon, stop

from odtd.daemon.control import request_federated_session
from odtd.errors import OdtdError

flwr = pytest.importorskip("flwr", reason="flwr (odtd[fleet], Python >= 3.11) is not installed")

pytestmark = pytest.mark.trains

DEVICES = 3
ROUNDS = 2
CLOSED = 2  # the device whose gate is closed
KILLED, KILLED_ROUND = 1, 1  # the device whose daemon is killed, and in which round
WORKER_KILLED, WORKER_KILLED_ROUND = 0, 2  # the device whose trainer worker is killed, and when
# The fleet's run may take this long; the killers, started with it, wait as long for their round
# (on a loaded 2-core machine round 2 began after more than the 180 s they once waited).
RUN_TIMEOUT_S = 240
LOST = {KILLED_ROUND: "the daemon closed the connection",
        WORKER_KILLED_ROUND: "failed: worker killed by SIGKILL"}


def _device(base: Path, root: Path, index: int) -> Path:
    home = root / f"device{index}"
    shutil.copytree(base, home, symlinks=True)
    policy = (REPO / "policies" / "tinycnn-test.yaml").read_text()
    # Two rounds' worth of new samples: each round's session takes at most 8 of them.
    policy = policy.replace("max_samples_per_session: 256", "max_samples_per_session: 8") \
        .replace("epochs: 2", "epochs: 1")
    (home / "policy.yaml").write_text(policy)
    (home / "odtd.yaml").write_text(FAST_CONFIG + trainer_python_yaml())
    write_images(root / f"images{index}", per_class=3, seed=10 + index)
    odtctl("ingest", str(root / f"images{index}"), home=home)
    if index == CLOSED:
        (home / "run").mkdir(exist_ok=True)
        (home / "run" / "force-gate-closed").write_text("charging\n")
    return home


def start_fleet(local, pool, base: Path, root: Path, devices: int, daemons: list) -> tuple:
    """The devices' homes, their daemons (appended to ``daemons``), the SuperLink and a SuperNode
    per device, started side by side: each waits on processes. Returns the homes, the version
    each served before its daemon started (its ``current`` file) and the SuperNodes, each in
    device order (``local.supernodes`` is in the order they came up)."""
    superlink = pool.submit(local.start_superlink)
    homes = list(pool.map(lambda i: _device(base, root, i), range(devices)))
    served = [(home / "models/tinycnn/current").read_text() for home in homes]
    daemons += pool.map(start_daemon, homes)
    superlink.result()
    supernodes = list(pool.map(
        lambda i: local.start_supernode(homes[i] / "run" / "odtd.sock", f"supernode{i}"),
        range(devices)))
    return homes, served, supernodes


@pytest.fixture
def fleet(_base_home, tmp_path_factory):
    from odtd.fleet.launch import LocalFleet

    root = tmp_path_factory.mktemp("fleet")
    local = LocalFleet(root / "flower")
    daemons: list = []
    lines: list = []
    # The devices, their daemons and their SuperNodes start side by side: each waits on processes.
    with ThreadPoolExecutor(DEVICES + 1) as pool:
        try:
            homes, served, _ = start_fleet(local, pool, _base_home, root, DEVICES, daemons)
            initial = _base_home / "models/tinycnn" / served[0].strip() / "weights.npz"
            config = root / "fleet.yaml"
            config.write_text(f"rounds: {ROUNDS}\nmin_devices: {DEVICES}\nlocal_epochs: 1\n"
                              "evaluate_fraction: 1.0\n"
                              f"round_timeout_s: 120\ninitial_weights: {initial}\nrecord: rounds.db\n")
            killer = pool.submit(_kill_and_restart, homes[KILLED], daemons)
            worker_killer = pool.submit(_kill_worker, homes[WORKER_KILLED])
            status = local.run(config, progress=lines.append, timeout_s=RUN_TIMEOUT_S)
            killer.result(timeout=5)
            served[WORKER_KILLED] = worker_killer.result(timeout=5)
            yield {"root": root, "homes": homes, "served": served, "status": status, "lines": lines,
                   "record": root / "rounds.db", "initial": initial, "daemons": daemons,
                   "log": (root / "flower" / "run" / "flwr-run.log")}
        finally:
            local.stop()
            list(pool.map(stop, daemons))


def _rows(db: Path, query: str) -> list:
    try:
        with sqlite3.connect(db) as connection:
            return connection.execute(query).fetchall()
    except sqlite3.Error:  # not created yet
        return []


def _kill_worker(home: Path) -> str:
    """SIGKILL the device's trainer worker in its session of the round; the version it served."""
    query = ("SELECT worker_pid FROM sessions WHERE trigger = 'fleet' AND worker_pid IS NOT NULL "
             f"AND details LIKE '%\"round\": {WORKER_KILLED_ROUND},%'")
    rows = wait_for(lambda: _rows(home / "odtd.db", query), RUN_TIMEOUT_S, 0.05)
    assert rows, f"{home.name} started no session of round {WORKER_KILLED_ROUND} in {RUN_TIMEOUT_S} s"
    served = (home / "models/tinycnn/current").read_text()  # what round 1 left it serving
    os.kill(rows[0][0], signal.SIGKILL)
    return served


def _kill_and_restart(home: Path, daemons: list) -> None:
    """SIGKILL the device's daemon as its session of the round starts, and start it again."""
    started = wait_for(lambda: _rows(home / "odtd.db", "SELECT id FROM sessions WHERE trigger = 'fleet' "
                                     f"AND details LIKE '%\"round\": {KILLED_ROUND},%'"), RUN_TIMEOUT_S, 0.05)
    assert started, f"{home.name} started no session of round {KILLED_ROUND} in {RUN_TIMEOUT_S} s"
    daemons[KILLED].kill()
    daemons[KILLED].wait()
    daemons[KILLED] = start_daemon(home)  # up again long before the next round reaches it


@pytest.mark.fleet  # dealt first in `make test` (tests/conftest.py); alone: `make test-fleet`
def test_a_fleet_of_three_devices(fleet, tmp_path):
    """One fleet, every check on it: pytest-xdist would start a module-scoped fixture once per
    worker that runs one of its tests, so the checks are one test."""
    _check_rounds_with_declining_and_killed_devices(fleet)
    _check_each_round_is_a_session_row_marked_federated(fleet)
    _check_weights_that_do_not_fit_are_refused_by_the_daemon(fleet)
    _check_a_request_outside_the_exchange_directory_is_refused(fleet, tmp_path)
    _check_fleet_status_text_and_bad_record(fleet, tmp_path)


def _check_rounds_with_declining_and_killed_devices(fleet):
    assert fleet["status"] == 0, fleet["log"].read_text()[-3000:]
    report = odtctl_json("fleet", "status", "--record", str(fleet["record"]))
    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    for r in rounds:
        assert (r["asked"], r["trained"], r["declined"], r["no_reply"]) == (DEVICES, 1, 2, 0)
        reasons = [d["reason"] for d in r["devices"] if d["outcome"] == "declined"]
        assert sum("gate charging closed" in reason for reason in reasons) == 1
        assert sum(LOST[r["round"]] in reason for reason in reasons) == 1, reasons
        trained = [d for d in r["devices"] if d["outcome"] == "trained"]
        for device in trained:
            assert device["metrics"]["num-examples"] > 0
            assert 0 <= device["metrics"]["accuracy-after"] <= 1
            assert device["metrics"]["seconds"] > 0
        # The device's part holds its session; the round holds the longest device's part.
        assert r["seconds"] >= r["device_s_max"] >= r["session_s_max"] > 0
        assert 0 <= r["flower_share"] <= r["outside_share"] < 1
        assert set(r["metrics"]) >= {"accuracy-before", "accuracy-after"}
        # The evaluate round after it: every device, its gate closed or not, scored the round's
        # model on its own samples (a measurement: nothing trained).
        evaluated = r["evaluation"]["devices"]
        assert [d["outcome"] for d in evaluated] == ["evaluated"] * DEVICES, evaluated
        for device in evaluated:
            assert device["metrics"]["num-examples"] > 0
            assert 0 <= device["metrics"]["accuracy"] <= 1
        assert 0 <= r["evaluation"]["metrics"]["accuracy"] <= 1
    # The server's progress lines, as `odtctl fleet run` prints them.
    assert any(line.startswith(f"round {ROUNDS}:") and "1 trained, 2 declined" in line
               for line in fleet["lines"])
    assert any(line.startswith(f"round {ROUNDS}: evaluated on {DEVICES} devices") for line in fleet["lines"])
    # The global weights moved away from the initial ones.
    with np.load(fleet["initial"]) as start, np.load(fleet["record"].with_name("rounds-global.npz")) as end:
        assert sorted(start.files) == sorted(end.files)
        assert any(not np.array_equal(start[k], end[k]) for k in start.files)


def _check_each_round_is_a_session_row_marked_federated(fleet):
    run_id = odtctl_json("fleet", "status", "--record", str(fleet["record"]))["run"]["run_id"]
    for index, home in enumerate(fleet["homes"]):
        sessions = [s for s in odtctl_json("history", home=home) if s["trigger"] == "fleet"
                    and s["details"]["federated"]["run_id"] == run_id]  # not the tests' own requests
        assert sorted(s["details"]["federated"]["round"] for s in sessions) == list(range(1, ROUNDS + 1))
        outcomes = {s["details"]["federated"]["round"]: s["outcome"] for s in sessions}
        if index == KILLED:  # the killed session is interrupted; the others trained
            assert outcomes.pop(KILLED_ROUND) == "interrupted"
            assert set(outcomes.values()) <= {"promoted", "rolled_back"}
            assert odtctl_json("status", home=home)["samples"]["pending"] > 0
        elif index == WORKER_KILLED:  # failed; it serves what round 1 left, its samples wait
            assert outcomes.pop(WORKER_KILLED_ROUND) == "failed"
            assert set(outcomes.values()) <= {"promoted", "rolled_back"}
            assert (home / "models/tinycnn/current").read_text() == fleet["served"][index]
            assert odtctl_json("status", home=home)["samples"]["pending"] > 0
        elif index == CLOSED:  # nothing trained; the served model is the one it had
            assert {s["outcome"] for s in sessions} == {"skipped"}
            assert all("gate charging closed" in s["reason"] for s in sessions)
            assert (home / "models/tinycnn/current").read_text() == fleet["served"][index]
        else:  # trained each round; the guard decided what it serves
            assert {s["outcome"] for s in sessions} <= {"promoted", "rolled_back"}
            assert all(s["details"]["federated"]["handed_back"] for s in sessions)
        assert not list((home / "run" / "fleet").glob("*.npz"))  # the exchanged files are gone


def _request(home: Path, name: str, arrays: dict) -> dict:
    exchange = home / "run" / "fleet"
    exchange.mkdir(exist_ok=True)
    np.savez(exchange / f"{name}.npz", **arrays)
    return request_federated_session(home / "run" / "odtd.sock", {
        "run_id": "test", "round": 9, "weights_in": str(exchange / f"{name}.npz"),
        "weights_out": str(exchange / f"{name}-out.npz")})


DAMAGES = [
    (lambda a: {**a, "w0000": a["w0000"][..., :1]}, "has shape"),
    (lambda a: {**a, "w0001": a["w0001"].astype(np.float64)}, "has dtype"),
    (lambda a: {**a, "w0000": np.full_like(a["w0000"], np.nan)}, "not finite"),
    (lambda a: {k: v for k, v in a.items() if k != "w0002"}, "arrays"),
]


def _served(home: Path) -> tuple:
    current = (home / "models/tinycnn/current").read_text()
    path = home / "models/tinycnn" / current.strip() / "weights.npz"
    with np.load(path) as data:
        return current, path, {k: data[k] for k in data.files}


def _runner_here(home: Path) -> tuple:
    """The home's store and a ``SessionRunner`` on it, in this process (close the store)."""
    from odtd.home.paths import Home
    from odtd.policy import load_policy
    from odtd.session.runner import SessionRunner

    h = Home(home)
    store = h.open_store()
    return store, SessionRunner(h, store, h.load_config(),
                                load_policy(h.policy_path(h.load_config())))


def _round_here(runner, home: Path, arrays: dict):
    """One federated session from ``arrays`` as the round's global weights, in this process;
    its record. The device's trained weights go to ``run/fleet/out.npz``."""
    from odtd.session.federated import FederatedRound

    exchange = home / "run" / "fleet"
    exchange.mkdir(parents=True, exist_ok=True)
    np.savez(exchange / "global.npz", **arrays)
    return runner.run(trigger="fleet", federated=FederatedRound(
        "run", 1, str(exchange / "global.npz"), str(exchange / "out.npz")))


def _with_training(home: Path, keys: str, images: Path, seed: int) -> None:
    """The home's policy with ``keys`` (YAML lines) under ``training:``, and a few images of each
    class ingested (written to ``images``)."""
    policy = (home / "policy.yaml").read_text()
    (home / "policy.yaml").write_text(policy.replace("training:\n", "training:\n" + keys, 1))
    write_images(images, per_class=3, seed=seed)
    odtctl("ingest", str(images), home=home)


def _scaled(arrays: dict, factor: float) -> dict:
    """The float arrays times ``factor`` (a global model that differs from the served one)."""
    return {k: v * np.asarray(factor, v.dtype) if v.dtype.kind == "f" else v
            for k, v in arrays.items()}


@pytest.mark.parametrize("damage, said", DAMAGES)
def test_check_global_weights_refuses_what_does_not_fit(_base_home, tmp_path, damage, said):
    from odtd.session.federated import check_global_weights

    _, served, arrays = _served(_base_home)
    np.savez(tmp_path / "in.npz", **damage(arrays))
    with pytest.raises(OdtdError, match=said):
        check_global_weights(tmp_path / "in.npz", served)
    np.savez(tmp_path / "fits.npz", **arrays)
    assert sorted(check_global_weights(tmp_path / "fits.npz", served)) == sorted(arrays)


@pytest.mark.parametrize("batchnorm", ["fedavg", "fedbn"])
def test_start_weights_take_the_servers_batchnorm_or_keep_the_devices(_base_home, tmp_path, batchnorm):
    from odtd.session.federated import FederatedRound, batchnorm_keys, write_start_weights

    current, served, arrays = _served(_base_home)
    names = json.loads((served.parent / "manifest.json").read_text())["weight_names"]
    bn = batchnorm_keys(names)
    assert [names[int(k[1:])].split("/")[1] for k in bn] == ["gamma", "beta", "moving_mean",
                                                             "moving_variance"] * 2
    np.savez(tmp_path / "global.npz", **{k: v + 1 for k, v in arrays.items()})
    federated = FederatedRound("run", 1, str(tmp_path / "global.npz"), str(tmp_path / "out.npz"),
                               batchnorm=batchnorm)
    written = write_start_weights(federated, served, names, tmp_path / "job")
    assert not written.already_served
    with np.load(written.path) as start:
        for key in arrays:
            kept = batchnorm == "fedbn" and key in bn
            assert np.array_equal(start[key], arrays[key] if kept else arrays[key] + 1), key


def _check_weights_that_do_not_fit_are_refused_by_the_daemon(fleet):
    home = fleet["homes"][0]
    current, _, arrays = _served(home)
    pending = odtctl_json("status", home=home)["samples"]["pending"]
    session = _request(home, "bad", DAMAGES[0][0](arrays))  # recorded failed, with why
    assert session["outcome"] == "failed" and "has shape" in session["reason"]
    assert "refused" in session["reason"] and session["steps"] is None
    assert not session["details"]["federated"].get("handed_back")
    assert odtctl_json("history", "--limit", "1", home=home)[0]["id"] == session["id"]
    assert (home / "models/tinycnn/current").read_text() == current
    assert odtctl_json("status", home=home)["samples"]["pending"] == pending


def _check_a_request_outside_the_exchange_directory_is_refused(fleet, tmp_path):
    home = fleet["homes"][0]
    with pytest.raises(OdtdError, match="is not in"):
        request_federated_session(home / "run" / "odtd.sock", {
            "run_id": "test", "round": 1, "weights_in": str(tmp_path / "x.npz"),
            "weights_out": str(home / "run" / "fleet" / "y.npz")})


def _check_fleet_status_text_and_bad_record(fleet, tmp_path):
    text = odtctl("fleet", "status", "--record", str(fleet["record"])).stdout
    assert "round" in text and "declined" in text and "gate charging closed" in text
    missing = odtctl("fleet", "status", "--record", str(tmp_path / "none.db"), check=False)
    assert missing.returncode == 1 and missing.stderr.startswith("Error: ")
    assert "Traceback" not in missing.stderr
    assert json.loads(odtctl("fleet", "status", "--record", str(fleet["record"]), "--json").stdout)
    plotted = odtctl_json("fleet", "plot", "--record", str(fleet["record"]),
                          "--out", str(tmp_path / "rounds.png"))
    assert plotted["rounds"] == ROUNDS
    assert (tmp_path / "rounds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_supernode_unit_passes_systemd_analyze_verify(tmp_path):
    import subprocess

    from test_deploy import make_systemd_root

    root = make_systemd_root(tmp_path / "root")
    supernode = root / "opt/odtd/fleet-venv/bin/flower-supernode"
    supernode.parent.mkdir(parents=True)
    supernode.write_text("#!/bin/sh\nexit 0\n")
    supernode.chmod(0o755)
    shutil.copy(REPO / "deploy" / "odtd-supernode.service", root / "etc/systemd/system/")
    shutil.copy(REPO / "deploy" / "odtd.service", root / "etc/systemd/system/")
    result = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "odtd-supernode.service"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stderr


def test_device_pools_draw_each_devices_class_mix():
    from odtd.fleet.simulate import DevicePools, FleetSimulation
    from odtd.sim.simulate import DataSource, SimulationOptions

    options = FleetSimulation(devices=2, alpha=0.1, each=SimulationOptions(seed=3))
    pools = DevicePools(options, DataSource(options.each))
    assert pools.mix.shape == (2, 10) and np.allclose(pools.mix.sum(axis=1), 1)
    x, y = pools.draw(0, 400, "train")
    assert x.shape == (400, 32, 32, 3) and x.dtype == np.uint8
    share = np.bincount(y, minlength=10) / 400
    assert np.abs(share - pools.mix[0]).max() < 0.1  # a multinomial draw of the device's mix
    x2, _ = pools.draw(0, 50, "train")
    assert not any((x2[:1] == image).all() for image in x)  # new images, not the same again


def _small_dataset(root: Path, train: int, test: int) -> Path:
    """A labelled image folder of two classes: ``train`` and ``test`` JPEGs of each."""
    from PIL import Image

    for split, count in (("train", train), ("test", test)):
        for c, label in enumerate(("cat", "dog")):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (32, 32), (8 * i, 120 * c, 90)).save(folder / f"{i}.jpg")
    return root


def test_device_pools_check_plan_refuses_exactly_the_runs_whose_draws_run_out(tmp_path):
    from odtd.errors import ConfigError
    from odtd.fleet.simulate import DevicePools, FleetSimulation
    from odtd.sim.simulate import DataSource, SimulationOptions

    data = _small_dataset(tmp_path / "data", train=12, test=8)
    outcomes = set()
    for test_images in range(1, 9):
        for days in (1, 3, 5):
            options = FleetSimulation(devices=2, alpha=0.5, test_per_device=test_images,
                                      device_validation=2, each=SimulationOptions(
                                          seed=test_images, dataset=str(data), days=days, per_day=2))
            pools = DevicePools(options, DataSource(options.each))
            try:
                pools.check_plan()
                refused = None
            except ConfigError as exc:
                refused = str(exc)
            # The run's draws in its order: each device's test images, validation sets, days.
            plan = [("test", test_images)] * 2 + [("test", 2)] * 2 + [("train", 2)] * (2 * days)
            failed = None
            try:
                for index, (split, n) in enumerate(plan):
                    pools.draw(index % 2, n, split)
            except ConfigError as exc:
                failed = str(exc)
            assert refused == failed, (test_images, days)
            outcomes.add(refused is None)
            if refused:
                split = "test" if "test images" in refused else "train"
                assert ("--test-images" in refused) == (split == "test")
    assert outcomes == {True, False}  # both sides of the limit were reached


def test_fleet_simulate_refuses_a_run_the_data_set_cannot_fill_before_making_anything(tmp_path):
    data = _small_dataset(tmp_path / "data", train=40, test=4)
    out = tmp_path / "fleet"
    refused = odtctl("fleet", "simulate", "--out", str(out), "--dataset", str(data),
                     "--devices", "2", "--test-images", "20", check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
    assert refused.returncode == 1 and len(errors) == 1, refused.stderr
    assert "too few test images of" in errors[0] and "--test-images" in errors[0]
    assert not out.exists()

def test_fleet_plot_draws_a_run_and_refuses_an_empty_record(tmp_path):
    from odtd.fleet.rounds import DeviceReply, RoundLog, RoundRecord

    log = RoundLog(tmp_path / "rounds.db")
    log.start_run("7", {})
    for number in (1, 2):
        log.add_round(RoundRecord("7", number, "2026-11-29T00:00:00+00:00", 30.0 + number, [
            DeviceReply("1", "trained", metrics={"seconds": 20.0, "device-seconds": 25.0,
                                                 "joules": 100.0, "num-examples": 10,
                                                 "accuracy-after": 0.6}),
            DeviceReply("3", "trained", metrics={"seconds": 10.0, "num-examples": 30,
                                                 "accuracy-after": float("nan")}),
            DeviceReply("2", "declined", "gate charging closed")],
            metrics={"accuracy-before": 0.5, "accuracy-after": float("nan")}))
    log.close()
    text = odtctl("fleet", "status", "--record", str(tmp_path / "rounds.db")).stdout
    # Round 2: 32 s, the device's part 25 s of it: Flower's share 7/32.
    row = next(line.split() for line in text.splitlines() if line.split()[:2] == ["2", "3"])
    assert row[-1] == f"{7 / 32:.1%}" and row[-2] == f"{12 / 32:.1%}"  # Flower's; outside
    # Flower's NaN (one device did not measure it): the mean of those that did.
    assert row[5:8] == ["0.500", "0.600", "-"]
    out = odtctl_json("fleet", "plot", "--record", str(tmp_path / "rounds.db"),
                      "--out", str(tmp_path / "plot.png"))
    assert out == {"out": str(tmp_path / "plot.png"), "run": "7", "rounds": 2}
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    RoundLog(tmp_path / "empty.db").close()
    empty = odtctl("fleet", "plot", "--record", str(tmp_path / "empty.db"), check=False)
    assert empty.returncode == 1 and "no run yet" in empty.stderr and "Traceback" not in empty.stderr


def test_fleet_status_all_shows_every_runs_rounds_as_fleet_simulate_records_them(tmp_path):
    from odtd.fleet.rounds import DeviceReply, RoundLog, RoundRecord

    record = tmp_path / "rounds.db"
    log = RoundLog(record)
    for day, run_id in enumerate(("11", "5", "8"), start=1):  # one run of one round a day
        log.start_run(run_id, {})
        log.add_round(RoundRecord(run_id, 1, "2026-11-30T00:00:00+00:00", 10.0 * day, [
            DeviceReply("1", "trained", metrics={"num-examples": 10, "accuracy-after": 0.1 * day})],
            metrics={"accuracy-after": 0.1 * day}))
        log.finish_run(run_id)
    log.close()
    latest = odtctl_json("fleet", "status", "--record", str(record))
    assert latest["run"]["run_id"] == "8" and len(latest["rounds"]) == 1
    every = odtctl_json("fleet", "status", "--record", str(record), "--all")
    assert [(r["round"], r["run_round"], r["run_id"]) for r in every["rounds"]] == \
        [(1, 1, "11"), (2, 1, "5"), (3, 1, "8")]
    assert every["run"] is None and every["label"] == "3 runs" and every["runs"] == ["8", "5", "11"]
    text = odtctl("fleet", "status", "--record", str(record), "--all").stdout.splitlines()
    assert text[0].startswith("3 runs, the first started")
    assert [line.split()[0] for line in text[2:]] == ["1", "2", "3"]
    assert [line.split()[6] for line in text[2:]] == ["0.100", "0.200", "0.300"]
    plotted = odtctl_json("fleet", "plot", "--record", str(record), "--all", "--out", str(tmp_path / "p.png"))
    assert (plotted["run"], plotted["rounds"]) == (None, 3)
    again = RoundLog.open_existing(record)  # what the CLI printed is the record's every_round
    assert again.every_round() == every["rounds"]
    again.close()
    both = odtctl("fleet", "status", "--record", str(record), "--all", "--run", "5", check=False)
    assert both.returncode == 2 and "not allowed" in both.stderr


@pytest.mark.parametrize("options, said", [
    (["--server-momentum", "0.5"], "--server-momentum 0.5 is FedAvgM's: add --strategy fedavgm"),
    (["--strategy", "fedavgm", "--server-momentum", "1"], "--server-momentum 1: it must be at least 0"),
])
def test_fleet_simulate_refuses_a_server_momentum_it_cannot_use(tmp_path, options, said):
    out = tmp_path / "fleet"
    refused = odtctl("fleet", "simulate", "--out", str(out), *options, check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
    assert refused.returncode == 1 and len(errors) == 1 and said in errors[0], refused.stderr
    assert not out.exists()


def test_server_settings_choose_flowers_strategy_and_fedprox_reaches_the_session(tmp_path):
    from flwr.serverapp.strategy import FedAvgM, FedProx

    from odtd.errors import ConfigError
    from odtd.fleet.rounds import RoundLog
    from odtd.fleet.server import make_strategy
    from odtd.fleet.settings import load_settings
    from odtd.session.federated import FederatedRound

    np.savez(tmp_path / "base.npz", w0000=np.zeros(3, np.float32))
    path = tmp_path / "server.yaml"
    log = RoundLog(tmp_path / "rounds.db")
    for text, kind, check in (("strategy: fedprox\nproximal_mu: 0.1\n", FedProx,
                               lambda s: s.proximal_mu == 0.1),
                              ("strategy: fedavgm\n", FedAvgM, lambda s: s.server_momentum == 0.9)):
        path.write_text(text + "initial_weights: base.npz\n")
        settings = load_settings(path)
        strategy = make_strategy(settings, log, "1")
        assert isinstance(strategy, kind) and check(strategy)
    log.close()
    path.write_text("strategy: fedsgd\ninitial_weights: base.npz\n")
    with pytest.raises(ConfigError, match="strategy"):
        load_settings(path)
    # The device's side: the config's proximal-mu becomes the session's, checked.
    exchange = tmp_path / "fleet"
    args = {"run_id": "1", "round": 1, "weights_in": str(exchange / "a.npz"),
            "weights_out": str(exchange / "b.npz"), "proximal_mu": 0.1}
    assert FederatedRound.from_args(args, exchange).to_details()["proximal_mu"] == 0.1
    with pytest.raises(OdtdError, match="proximal_mu -1"):
        FederatedRound.from_args(dict(args, proximal_mu=-1), exchange)


def test_a_server_killed_while_recording_loses_no_recorded_round(tmp_path):
    # A server process records rounds as fast as it can and is SIGKILLed mid-way: every round
    # it recorded is whole (its devices' rows with it), and a restarted server records on.
    from odtd.fleet.rounds import DeviceReply, RoundLog, RoundRecord

    record = tmp_path / "rounds.db"
    script = (
        "import sys\n"
        "from odtd.fleet.rounds import DeviceReply, RoundLog, RoundRecord\n"
        "log = RoundLog(sys.argv[1]); log.start_run('1', {})\n"
        "n = 0\n"
        "while True:\n"
        "    n += 1\n"
        "    log.add_round(RoundRecord('1', n, 'now', 1.0, [DeviceReply(str(d), 'trained', metrics={"
        "'seconds': 0.5}) for d in range(8)]))\n")
    server = subprocess.Popen([sys.executable, "-c", script, str(record)], cwd=REPO)
    wait_for(lambda: len(_rows(record, "SELECT round FROM rounds")) >= 20, 60, 0.01)
    time.sleep(0.05)
    server.send_signal(signal.SIGKILL)
    server.wait()
    rounds = [r for (r,) in _rows(record, "SELECT round FROM rounds ORDER BY round")]
    assert rounds == list(range(1, len(rounds) + 1)) and len(rounds) >= 20
    devices = _rows(record, "SELECT round, COUNT(*) FROM devices GROUP BY round ORDER BY round")
    assert devices == [(r, 8) for r in rounds]  # no round without its devices, none half written
    log = RoundLog(record)  # the server, started again
    log.add_round(RoundRecord("1", len(rounds) + 1, "now", 1.0, [DeviceReply("0", "declined", "x")]))
    assert [r.round for r in log.rounds("1")] == list(range(1, len(rounds) + 2))
    log.close()


def test_packed_weights_round_trip_and_average_as_the_arrays_do():
    from odtd.fleet.packing import pack, packed_mask, unpack

    rng = np.random.default_rng(0)
    one = [rng.normal(size=(3, 3, 2, 4)).astype(np.float32), np.arange(5, dtype=np.int64),
           rng.normal(size=4).astype(np.float32), np.float32(2.5).reshape(())]
    two = [a * 3 for a in one]
    packed, layout = pack(one)
    assert [a.shape for a in packed] == [(3 * 3 * 2 * 4 + 4 + 1,), (5,)]  # one array a dtype
    for got, want in zip(unpack(packed, layout), one):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    # FedAvg's weighted mean of the packed arrays is the mean of the arrays.
    mean = [(0.25 * a + 0.75 * b).astype(a.dtype) for a, b in zip(pack(one)[0], pack(two)[0])]
    for got, a, b in zip(unpack(mean, layout), one, two):
        assert np.allclose(got, (0.25 * a + 0.75 * b).astype(a.dtype))
    # A mask over the packed arrays (FedAvgM's statistics) falls on the arrays it flags.
    flags = [True, False, True, False]
    mask = packed_mask(layout, flags)
    assert [m.shape for m in mask] == [a.shape for a in packed] and mask[0].dtype == bool
    for got, flag in zip(unpack([m.astype(a.dtype) for m, a in zip(mask, packed)], layout), flags):
        assert np.all(got == flag)


@pytest.mark.parametrize("damage, said", [
    (lambda p: p[:1], "hold 1 packed arrays, its layout 2 dtypes"),
    (lambda p: [p[0][:-1], p[1]], "float32 weights are float32 of shape (76,), the layout says (77,)"),
    (lambda p: [p[0].astype(np.float64), p[1]], "are float64"),
])
def test_packed_weights_that_do_not_fit_their_layout_are_refused(damage, said):
    from odtd.fleet.packing import pack, unpack

    packed, layout = pack([np.zeros((3, 3, 2, 4), np.float32), np.zeros(5, np.int64),
                           np.zeros(5, np.float32)])
    with pytest.raises(OdtdError, match=re.escape(said)):
        unpack(damage(packed), layout)
    with pytest.raises(OdtdError, match="layout entry 'x:1' is not dtype:shape"):
        unpack(packed, ["x:1"])


def test_served_by_day_follows_promotions_and_keeps_what_was_served(_base_home, tmp_path):
    from odtd.fleet.daily import served_by_day
    from odtd.home.paths import Home
    from odtd.store.records import SessionRecord

    shutil.copytree(_base_home, tmp_path / "home", symlinks=True)
    home = Home(tmp_path / "home")
    store = home.open_store()
    for outcome, before, after in (("promoted", 0, 1), ("rolled_back", 1, 2), ("skipped", None, None),
                                   ("promoted", 1, 3), ("failed", 3, None)):
        record = SessionRecord(day="2026-11-29", trigger="fleet")
        store.start_session(record)
        record.outcome, record.model_version_before, record.model_version_after = outcome, before, after
        store.finish_session(record)
    store.close()
    assert served_by_day(home, 7) == [1, 1, 1, 3, 3, None, None]


def test_a_fleet_round_is_not_held_back_by_a_local_refusals_backoff(home, tmp_path):
    # After a refused session the policy's backoff makes the next local session wait for twice
    # its new samples. A round starts from the fleet's new model, not from what was refused: it
    # trains on what is pending (the policy's minimum still holds).
    from odtd.store.records import SessionRecord

    assert "schedule:" not in (home / "policy.yaml").read_text()
    with open(home / "policy.yaml", "a") as policy:
        policy.write("\nschedule:\n  backoff: 4\n")
    write_images(tmp_path / "images", per_class=3, seed=5)
    odtctl("ingest", str(tmp_path / "images"), home=home)
    store, runner = _runner_here(home)
    refused = SessionRecord(day="2026-11-28", trigger="schedule", samples_new=50)
    store.start_session(refused)
    refused.outcome, refused.reason = "rolled_back", "refused"
    store.finish_session(refused)
    local = runner.run(trigger="socket")
    assert local.outcome == "skipped" and "waiting for 200 new samples" in local.reason
    round_ = _round_here(runner, home, _served(home)[2])
    store.close()
    assert round_.outcome in ("promoted", "rolled_back"), round_.reason
    assert round_.samples_new > 0 and (home / "run" / "fleet" / "out.npz").exists()


def test_federated_mix_averages_a_rounds_candidate_with_the_served_model_too(home, tmp_path):
    # training.federated_mix: the round's session asks the worker for the second average (the
    # candidate with the device's served model), and the session row records what it kept.
    _with_training(home, "  trained_share: auto\n  federated_mix: true\n", tmp_path / "images", 6)
    store, runner = _runner_here(home)
    round_ = _round_here(runner, home, _scaled(_served(home)[2], 0.9))
    store.close()
    assert round_.outcome in ("promoted", "rolled_back"), round_.reason
    assert round_.details.trained_share is not None
    assert round_.details.served_share is not None
    assert len(round_.details.served_shares_tried) == 4


def test_round_trained_share_0_serves_the_rounds_model_and_hands_back_the_update(home, tmp_path):
    # training.round_trained_share 0: in a round the device's candidate is the round's model as
    # the fleet sent it, while the server still gets the device's trained weights; a local
    # session keeps training.trained_share.
    policy = (home / "policy.yaml").read_text()  # any candidate passes: what is served shows
    (home / "policy.yaml").write_text(policy.replace("tolerance: 1.0", "tolerance: 100.0"))
    _with_training(home, "  trained_share: 0.5\n  round_trained_share: 0\n", tmp_path / "images", 7)
    store, runner = _runner_here(home)
    sent = _scaled(_served(home)[2], 0.9)
    round_ = _round_here(runner, home, sent)
    assert round_.outcome == "promoted", round_.reason
    assert round_.details.trained_share == 0.0 and not round_.details.trained_shares_tried
    assert round_.details.federated["already_served"] is False
    _, _, served = _served(home)
    assert all(np.array_equal(served[k], sent[k]) for k in sent)
    with np.load(home / "run" / "fleet" / "out.npz") as out:
        assert any(not np.array_equal(out[k], sent[k]) for k in out.files)
    write_images(tmp_path / "more", per_class=3, seed=8)
    odtctl("ingest", str(tmp_path / "more"), home=home)
    local = runner.run(trigger="socket", force=True)
    store.close()
    assert local.outcome in ("promoted", "rolled_back"), local.reason
    assert local.details.trained_share == 0.5


def test_a_round_of_the_model_the_device_serves_trains_as_a_local_session(home, tmp_path):
    # A fleet's first round sends the devices' own base back: as it came it brings nothing, so
    # under round_trained_share 0 the session takes training.trained_share and the local
    # acceptance test; the server still gets the trained weights.
    _with_training(home, "  trained_share: 0.5\n  round_trained_share: 0\n", tmp_path / "images", 9)
    store, runner = _runner_here(home)
    sent = _served(home)[2]
    round_ = _round_here(runner, home, sent)
    store.close()
    assert round_.outcome in ("promoted", "rolled_back"), round_.reason
    assert round_.details.federated["already_served"] is True
    assert round_.details.trained_share == 0.5
    with np.load(home / "run" / "fleet" / "out.npz") as out:
        assert any(not np.array_equal(out[k], sent[k]) for k in out.files)


def test_hand_back_gives_the_server_the_trained_weights_whole_not_the_devices_average(tmp_path):
    """``trained_share`` averaged the device's candidate with the round's start: the server
    still gets the trained weights whole (FedAvg averages the devices' updates); without an
    average (no ``trained.npz``) the candidate is the trained model; no candidate, nothing."""
    from odtd.session.federated import TRAINED_WEIGHTS, FederatedRound, hand_back

    job = tmp_path / "session-1"
    job.mkdir()
    federated = FederatedRound("run", 1, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    assert not hand_back(job, federated) and not (tmp_path / "out.npz").exists()
    np.savez(job / "candidate.npz", w0000=np.zeros(3, np.float32))
    assert hand_back(job, federated)
    with np.load(tmp_path / "out.npz") as out:
        assert np.array_equal(out["w0000"], np.zeros(3))
    np.savez(job / TRAINED_WEIGHTS, w0000=np.ones(3, np.float32))
    assert hand_back(job, federated)
    with np.load(tmp_path / "out.npz") as out:
        assert np.array_equal(out["w0000"], np.ones(3))


def test_a_round_start_clears_what_gone_clientapps_left_and_not_a_living_ones_files(tmp_path):
    """Two SuperNodes pointed at one daemon (CI saw it: a SuperNode started again beside one
    still up) once shared one round's file name, and the one declined removed the other's. Each
    ClientApp's files are now named per process (``atomic.temporary_name``); a round's start
    clears only those whose process is gone, and the old names without one."""
    from odtd import atomic
    from odtd.fleet.device import clear_exchange, exchange_file

    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        mine = exchange_file(tmp_path, "7", 3, "global")
        theirs = tmp_path / f".7-2-global.{living.pid}.tmp.npz"
        for path in (mine, theirs, tmp_path / f".7-2-global.{gone.pid}.tmp.npz",
                     tmp_path / "7-1-global.npz"):
            path.write_bytes(b"weights")
        assert atomic.is_temporary(mine.name) and str(os.getpid()) in mine.name
        clear_exchange(tmp_path)
        assert sorted(tmp_path.iterdir()) == sorted([mine, theirs])
    finally:
        living.kill()
        living.wait()


@pytest.fixture
def flower_task(monkeypatch):
    """Messages made in this process as the ServerApp's process makes them (its task identity)."""
    from flwr.supercore.task_identity import TaskIdentity

    for key in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, key, 1)


def _train_replies(start: list, devices: list) -> list:
    """Flower's train replies of devices whose weights are ``devices`` (each a list of arrays),
    8 examples each, to a round asked with the weights ``start``, packed as the server sends them."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    from odtd.fleet.packing import pack

    asked = Message(content=RecordDict({"arrays": ArrayRecord(pack(start)[0]),
                                        "config": ConfigRecord({})}),
                    dst_node_id=2, message_type="train")
    return [Message(content=RecordDict({"arrays": ArrayRecord(pack(arrays)[0]),
                                        "metrics": MetricRecord({"num-examples": 8})}),
                    reply_to=asked) for arrays in devices]


def test_fedavgm_steps_the_trained_weights_and_averages_batchnorm_statistics(tmp_path, flower_task,
                                                                            monkeypatch):
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from odtd.fleet.packing import pack, unpack
    from odtd.fleet.server import AveragedStatisticsFedAvgM, statistics_mask, weight_names, write_weight_names
    from odtd.session.federated import write_weights

    names = ["conv/kernel", "bn/gamma", "bn/moving_mean", "bn/moving_variance"]
    start = [np.ones((2, 2), np.float32), np.ones(2, np.float32), np.zeros(2, np.float32),
             np.ones(2, np.float32)]
    write_weights(tmp_path / "global-1.npz", start)
    assert weight_names(tmp_path / "global-1.npz", 4) is None  # nothing beside it names them
    write_weight_names(tmp_path / "global-1.npz", names)
    assert weight_names(tmp_path / "global-1.npz", 4) == names
    assert weight_names(tmp_path / "global-1.npz", 5) is None  # names for another model
    packed, layout = pack(start)

    def device(kernel: float, variance: float) -> list:
        return [np.full((2, 2), kernel, np.float32), np.ones(2, np.float32),
                np.full(2, 0.5, np.float32), np.full(2, variance, np.float32)]

    means = []  # FedAvg's weighted mean, computed (and logged by Flower) once a round
    monkeypatch.setattr(FedAvg, "aggregate_train", lambda self, *args, _mean=FedAvg.aggregate_train:
                        means.append(1) or _mean(self, *args))

    def aggregate(statistics, server_round, replies):
        strategy = AveragedStatisticsFedAvgM(server_learning_rate=2.0, server_momentum=0.5)
        strategy.statistics = statistics
        strategy.current_arrays = ArrayRecord(packed)
        means.clear()
        for r in range(1, server_round + 1):
            arrays, _ = strategy.aggregate_train(r, iter(replies))
        assert len(means) == server_round
        return dict(zip(names, unpack(arrays.to_numpy_ndarrays(), layout)))

    # Two devices' updates: kernels 2 and 4 (mean 3), variances 0.2 and 0.4 (mean 0.3).
    replies = _train_replies(start, [device(2.0, 0.2), device(4.0, 0.4)])
    got = aggregate(statistics_mask(names, layout), 1, replies)
    assert np.allclose(got["conv/kernel"], 1 + 2 * (3 - 1))  # the server's step: twice the mean update
    assert np.allclose(got["bn/moving_variance"], 0.3) and np.allclose(got["bn/moving_mean"], 0.5)
    # Round 2 from round 1's global (momentum 0.5): the step grows, the statistics stay the mean.
    got = aggregate(statistics_mask(names, layout), 2, replies)
    assert np.allclose(got["conv/kernel"], 5 - 2 * (0.5 * (1 - 3) + (5 - 3)))
    assert np.allclose(got["bn/moving_variance"], 0.3)
    # Without names every array is stepped, as Flower's FedAvgM does: the variances go below 0.
    got = aggregate(None, 1, replies)
    assert np.allclose(got["bn/moving_variance"], 1 + 2 * (0.3 - 1)) and (got["bn/moving_variance"] < 0).all()


def test_fedavgm_momentum_carries_to_a_run_that_starts_where_one_ended(tmp_path, flower_task):
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from odtd.fleet.packing import pack
    from odtd.fleet.server import AveragedStatisticsFedAvgM, momentum_file, resume_momentum, save_momentum

    weights = [np.ones((2, 2), np.float32)]
    start, _ = pack(weights)
    replies = _train_replies(weights, [[np.full((2, 2), k, np.float32)] for k in (2.0, 4.0)])  # mean 3

    def run(arrays, rounds, carried_from=None):
        strategy = AveragedStatisticsFedAvgM(server_learning_rate=1.0, server_momentum=0.5)
        strategy.current_arrays = ArrayRecord(arrays)
        resumed = carried_from is not None and resume_momentum(strategy, carried_from, arrays)
        for r in range(1, rounds + 1):
            out, _ = strategy.aggregate_train(r, replies)
        return strategy, out.to_numpy_ndarrays(), resumed

    # One run of two rounds: 1 -> 3 (momentum -2), then 3 -> 3 + 0.5 * 2 = 4.
    _, both, _ = run(start, 2)
    assert np.allclose(both[0], 4.0)
    # Two runs of one round each, the first's momentum written beside its global weights.
    first, day1, _ = run(start, 1)
    global1 = tmp_path / "global-1.npz"
    save_momentum(first, global1)
    assert momentum_file(global1).is_file()
    _, day2, resumed = run(day1, 1, carried_from=global1)
    assert resumed and np.allclose(day2[0], both[0])
    # Without it the second run starts its momentum afresh: no step beyond the mean.
    _, fresh, resumed = run(day1, 1, carried_from=tmp_path / "global-0.npz")
    assert not resumed and np.allclose(fresh[0], 3.0)
    # Momentum of another model's shapes is not taken up.
    other, _ = pack([np.ones((3, 2), np.float32)])
    assert not resume_momentum(AveragedStatisticsFedAvgM(server_momentum=0.5), global1, other)
    # A strategy without momentum takes none up, and its run removes what an earlier one left.
    assert not resume_momentum(FedAvg(), global1, day1)
    save_momentum(FedAvg(), global1)
    assert not momentum_file(global1).exists()


def test_a_negative_batchnorm_variance_is_refused_unless_the_device_keeps_its_own(_base_home, tmp_path):
    from odtd.session.federated import FederatedRound, write_start_weights

    _, served, arrays = _served(_base_home)
    names = json.loads((served.parent / "manifest.json").read_text())["weight_names"]
    variance = next(i for i, name in enumerate(names) if name.endswith("/moving_variance"))
    np.savez(tmp_path / "global.npz", **{**arrays, f"w{variance:04d}": -arrays[f"w{variance:04d}"]})
    for batchnorm in ("fedavg", "fedbn"):
        federated = FederatedRound("run", 1, str(tmp_path / "global.npz"), str(tmp_path / "out.npz"),
                                   batchnorm=batchnorm)
        if batchnorm == "fedavg":
            with pytest.raises(OdtdError, match=f"{names[variance]} holds .* negative variances: refused"):
                write_start_weights(federated, served, names, tmp_path / "job")
            assert not (tmp_path / "job" / "global.npz").exists()
        else:  # the device's own BatchNorm parameters replace the server's
            written = write_start_weights(federated, served, names, tmp_path / "job")
            with np.load(written.path) as start:
                assert np.array_equal(start[f"w{variance:04d}"], arrays[f"w{variance:04d}"])
            assert written.already_served  # the rest was the served model's too
