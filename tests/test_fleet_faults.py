"""A device's SuperNode killed mid-round: the round completes with the others, the device's home
stays intact, and the SuperNode started again takes the next round.

Flower's SuperLink notices a SuperNode gone only when its heartbeats stop (Flower 1.42: 30 s,
patience 2), so the round waits about a minute for it: this test is not in `make test`'s
five minutes but in `make test-fleet` (and `.ci/run`).
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import odtctl_json, wait_for
from test_daemon import stop
from test_fleet import _rows, start_fleet

pytest.importorskip("flwr", reason="flwr (odtd[fleet], Python >= 3.11) is not installed")

pytestmark = [pytest.mark.trains, pytest.mark.fleet_faults]

DEVICES, ROUNDS = 2, 2
KILLED = 1  # the device whose SuperNode is killed in round 1


def _kill_supernode_in_its_session(local, home, supernode, index):
    """SIGKILL the device's SuperNode (its ClientApp child too) once its round-1 session runs,
    then start a new one; the session row it was running."""
    query = "SELECT id FROM sessions WHERE trigger = 'fleet' AND details LIKE '%\"round\": 1,%'"
    wait_for(lambda: _rows(home / "odtd.db", query), 180, 0.05)
    for child in _children(supernode.pid):
        os.kill(child, signal.SIGKILL)
    supernode.kill()
    supernode.wait()
    local.start_supernode(home / "run" / "odtd.sock", f"supernode{index}-again")
    return _rows(home / "odtd.db", query)[0][0]


def _children(pid: int) -> list:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_a_killed_supernode_does_not_stop_the_round_and_its_device_takes_the_next(
        _base_home, tmp_path_factory):
    from odtd.fleet.launch import LocalFleet

    root = tmp_path_factory.mktemp("fleet-faults")
    local = LocalFleet(root / "flower")
    daemons: list = []
    lines: list = []
    with ThreadPoolExecutor(DEVICES + 1) as pool:
        try:
            homes, served, supernodes = start_fleet(local, pool, _base_home, root, DEVICES,
                                                    daemons)
            config = root / "fleet.yaml"
            config.write_text(
                f"rounds: {ROUNDS}\nmin_devices: {DEVICES}\nlocal_epochs: 1\nround_timeout_s: 240\n"
                f"initial_weights: {_base_home / 'models/tinycnn' / served[0].strip() / 'weights.npz'}\n"
                "record: rounds.db\n")
            killer = pool.submit(_kill_supernode_in_its_session, local, homes[KILLED],
                                 supernodes[KILLED], KILLED)
            status = local.run(config, progress=lines.append, timeout_s=400)
            killed_session = killer.result(timeout=5)
        finally:
            local.stop()
            list(pool.map(stop, daemons))
    assert status == 0, (root / "flower" / "run" / "flwr-run.log").read_text()[-3000:]
    rounds = odtctl_json("fleet", "status", "--record", str(root / "rounds.db"))["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    first, second = rounds
    # Round 1: the other device trained; the killed one is silent, with the SuperLink's reason,
    # under its own node id (the SuperLink's reply comes from the SuperLink's).
    assert (first["asked"], first["trained"], first["declined"], first["no_reply"]) == (2, 1, 0, 1), first
    gone = [d for d in first["devices"] if d["outcome"] == "no reply"][0]
    assert "Node Unavailable" in gone["reason"], gone
    assert gone["node_id"] not in {d["node_id"] for d in second["devices"]}  # a new SuperNode
    # Round 2: the SuperNode started again takes it with the other.
    assert (second["asked"], second["trained"]) == (DEVICES, DEVICES), [
        (d["outcome"], d["reason"]) for d in second["devices"]]
    # The killed device's home: its round-1 session ran to its end in the daemon (the guard
    # decided), round 2's too; nothing left half-done, no exchanged weights left behind.
    home = homes[KILLED]
    sessions = {s["id"]: s for s in odtctl_json("history", home=home)}
    assert sessions[killed_session]["outcome"] in ("promoted", "rolled_back")
    rounds_run = sorted(s["details"]["federated"]["round"] for s in sessions.values()
                        if s["trigger"] == "fleet")
    assert rounds_run == [1, 2]
    assert all(s["outcome"] for s in sessions.values())  # every session ended, none half-done
    version = odtctl_json("status", home=home)["model"]["version"]
    assert (home / "models/tinycnn" / f"v{version}" / "weights.npz").exists()
    assert not list((home / "run" / "fleet").glob("*.npz"))
