"""Gates on fake board trees (sysfs, procfs, dev/input under tmp_path) and the gate monitor."""

import json
import os
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from odtd.policy import GatesPolicy, SchedulePolicy
from odtd.session.gates import (
    FORCE_CLOSED_FILE,
    GateMonitor,
    StopRequest,
    check_gates,
    in_window,
    samples_wanted,
)
from odtd.store.records import SessionRecord

FIXTURES = Path(__file__).parent / "fixtures" / "telemetry"
NOW = datetime(2026, 11, 22, 2, 30)


def write_tree(root: Path, files: dict) -> Path:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return root


def tx2_devkit(root: Path) -> Path:
    """Jetson TX2 devkit, JetPack 4.6: the recorded sysfs thermal zones (PMIC-Die reads a
    constant 100 C), six CPUs, no power_supply entries (no battery)."""
    spec = json.loads((FIXTURES / "tx2_jp46_sysfs.json").read_text())
    write_tree(root, spec["files"])
    return write_tree(root, {"proc/loadavg": "1.20 0.90 0.70 2/512 4242\n",
                             "sys/devices/system/cpu/online": "0-5\n"})


def laptop(root: Path, status="Discharging", capacity=35, ac_online=0) -> Path:
    """An x86 laptop's power_supply class: BAT0, an AC adapter, and a wireless mouse battery."""
    return write_tree(root, {
        "sys/class/power_supply/BAT0/type": "Battery\n",
        "sys/class/power_supply/BAT0/status": f"{status}\n",
        "sys/class/power_supply/BAT0/capacity": f"{capacity}\n",
        "sys/class/power_supply/BAT0/scope": "System\n",
        "sys/class/power_supply/AC/type": "Mains\n",
        "sys/class/power_supply/AC/online": f"{ac_online}\n",
        "sys/class/power_supply/hidpp_battery_0/type": "Battery\n",
        "sys/class/power_supply/hidpp_battery_0/scope": "Device\n",
        "sys/class/power_supply/hidpp_battery_0/capacity": "5\n",
        "sys/class/thermal/thermal_zone0/type": "x86_pkg_temp\n",
        "sys/class/thermal/thermal_zone0/temp": "55000\n",
        "proc/loadavg": "0.30 0.20 0.10 1/300 999\n",
        "sys/devices/system/cpu/online": "0-3\n",
    })


def by_name(results):
    return {r.name: r for r in results}


ALL = GatesPolicy(require_charging=True, min_battery_pct=50, max_temp_c=80, max_system_load=1.0,
                  window="01:00-06:00")


def test_tx2_devkit_without_battery_passes_and_ignores_pmic_die(tmp_path):
    results = by_name(check_gates(ALL, tx2_devkit(tmp_path), NOW))
    assert list(results) == ["charging", "battery", "temperature", "load", "window"]
    assert all(r.passed for r in results.values())
    assert results["charging"].reason == results["battery"].reason == "no battery"
    # The hottest real zone, not PMIC-Die's placeholder 100 C.
    assert results["temperature"].value == 37.5
    assert results["temperature"].reason.startswith("BCPU-therm 37.5 C <= 80 C")
    assert results["load"].value == pytest.approx(0.2)
    assert "6 CPUs" in results["load"].reason


def test_laptop_on_battery_discharging_closes_charging_and_battery(tmp_path):
    results = by_name(check_gates(ALL, laptop(tmp_path), NOW))
    assert not results["charging"].passed
    assert results["charging"].reason == "on battery (BAT0 Discharging)"
    assert not results["battery"].passed
    # The mouse's 5% battery (scope Device) is not the board's.
    assert results["battery"].value == 35.0
    assert results["battery"].reason == "BAT0 35% < 50%"
    assert results["temperature"].passed and results["load"].passed


def test_laptop_plugged_in_passes_charging(tmp_path):
    results = by_name(check_gates(ALL, laptop(tmp_path, "Not charging", 80, ac_online=1), NOW))
    assert results["charging"].passed and results["charging"].reason == "on external power (AC)"
    assert results["battery"].passed


def test_hot_thermal_zone_closes_temperature(tmp_path):
    root = tx2_devkit(tmp_path)
    write_tree(root, {"sys/class/thermal/thermal_zone2/temp": "91500\n"})
    result = by_name(check_gates(ALL, root, NOW))["temperature"]
    assert not result.passed
    assert result.value == 91.5
    assert result.reason == "GPU-therm 91.5 C > 80 C"


def test_high_load_per_core_closes_load(tmp_path):
    root = tx2_devkit(tmp_path)
    write_tree(root, {"proc/loadavg": "7.50 6.00 3.00 9/600 5000\n"})
    result = by_name(check_gates(ALL, root, NOW))["load"]
    assert not result.passed
    assert result.value == 1.25
    assert result.reason == "load 1.25 per core (6 CPUs) > 1"


@pytest.mark.parametrize("hhmm,inside", [
    ("23:30", True), ("22:00", True), ("00:00", True), ("05:59", True), ("06:00", False),
    ("12:00", False), ("21:59", False),
])
def test_window_wrapping_midnight(hhmm, inside):
    hour, minute = map(int, hhmm.split(":"))
    assert in_window("22:00-06:00", hour * 60 + minute) is inside
    gates = GatesPolicy(window="22:00-06:00")
    result = check_gates(gates, Path("/nonexistent"), NOW.replace(hour=hour, minute=minute))[0]
    assert (result.name, result.passed, result.value) == ("window", inside, hhmm)


def test_window_not_wrapping():
    assert in_window("01:00-06:00", 60) and not in_window("01:00-06:00", 6 * 60)
    assert not in_window("01:00-06:00", 0)


def test_idle_time_from_input_device_times(tmp_path):
    event = tmp_path / "dev" / "input" / "event0"
    event.parent.mkdir(parents=True)
    event.write_text("")
    last_input = NOW.timestamp() - 600
    os.utime(event, (last_input, last_input))
    result = check_gates(GatesPolicy(min_idle_s=300), tmp_path, NOW)[0]
    assert result.passed and result.value == 600.0
    result = check_gates(GatesPolicy(min_idle_s=900), tmp_path, NOW)[0]
    assert not result.passed and result.reason == "last input 600 s ago < 900 s"


def test_unknown_idle_time_passes_with_a_note(tmp_path):
    result = check_gates(GatesPolicy(min_idle_s=300), tmp_path, NOW)[0]
    assert result.passed and result.value is None
    assert "idle time unknown" in result.reason


def test_force_file_closes_a_gate_and_flags_unknown_names(tmp_path):
    root = tx2_devkit(tmp_path / "board")
    force = tmp_path / "run" / FORCE_CLOSED_FILE
    force.parent.mkdir()
    force.write_text("# demo\ntemperature\nwindw\n")
    results = by_name(check_gates(ALL, root, NOW, force_file=force))
    assert not results["temperature"].passed
    assert results["temperature"].value == 37.5
    assert results["temperature"].reason.startswith(f"forced closed by {force}")
    assert not results["windw"].passed and "unknown gate 'windw'" in results["windw"].reason
    force.unlink()
    assert all(r.passed for r in check_gates(ALL, root, NOW, force_file=force))


def test_no_gates_configured_checks_nothing(tmp_path):
    assert check_gates(GatesPolicy(), tmp_path, NOW) == []


def wait_for(event: threading.Event, timeout_s: float = 5.0) -> bool:
    return event.wait(timeout_s)


def test_monitor_stops_the_session_when_a_reading_crosses_the_limit(tmp_path):
    root = tx2_devkit(tmp_path)
    gates = GatesPolicy(max_temp_c=80, check_interval_s=0.05)
    stop = StopRequest()
    with GateMonitor(gates, stop, root=root, clock=lambda: NOW) as monitor:
        time.sleep(0.2)
        assert not stop.is_set()
        write_tree(root, {"sys/class/thermal/thermal_zone1/temp": "85000\n"})
        assert wait_for(stop)
    assert stop.reason == "gate temperature closed: MCPU-therm 85.0 C > 80 C"
    assert monitor.closed.name == "temperature"


def test_monitor_reads_the_force_file_like_any_input(tmp_path):
    stop = StopRequest()
    force = tmp_path / FORCE_CLOSED_FILE
    gates = GatesPolicy(window="01:00-06:00", check_interval_s=0.05)
    with GateMonitor(gates, stop, root=tmp_path, clock=lambda: NOW, force_file=force):
        time.sleep(0.2)
        assert not stop.is_set()
        force.write_text("window\n")
        assert wait_for(stop)
    assert stop.reason.startswith(f"gate window closed: forced closed by {force}")


def test_monitor_closes_at_start_when_a_gate_is_already_closed(tmp_path):
    stop = StopRequest()
    gates = GatesPolicy(window="01:00-06:00", check_interval_s=60)
    with GateMonitor(gates, stop, root=tmp_path, clock=lambda: NOW.replace(hour=12)):
        assert wait_for(stop, 2.0)
    assert stop.reason == "gate window closed: 12:30 outside 01:00-06:00"


def test_monitor_interrupts_a_real_session_at_a_step_boundary(home, tmp_path):
    from conftest import odtctl, write_images

    from odtd.home.paths import Home
    from odtd.policy import load_policy
    from odtd.session.runner import SessionRunner

    write_images(tmp_path / "imgs", per_class=7)
    odtctl("ingest", str(tmp_path / "imgs"), home=home)
    policy_path = home / "policy.yaml"
    policy_path.write_text(policy_path.read_text().replace("epochs: 2", "epochs: 500"))
    odtd_home = Home(home)
    store = odtd_home.open_store()
    force = odtd_home.run / FORCE_CLOSED_FILE
    stop = StopRequest()

    def progress(message: str) -> None:
        if "epoch 1/" in message:  # the worker is training: close a gate now
            force.write_text("window\n")

    policy = load_policy(policy_path)
    runner = SessionRunner(odtd_home, store, odtd_home.load_config(), policy, progress=progress)
    with GateMonitor(GatesPolicy(check_interval_s=0.1), stop, force_file=force):
        session = runner.run(trigger="cli", stop=stop).to_dict()
    store.close()
    assert session["outcome"] == "interrupted"
    assert session["reason"] == f"gate window closed: forced closed by {force}"
    assert session["model_version_after"] == session["model_version_before"]


def _judged(outcome, new):
    return SessionRecord(day="2026-11-26", trigger="schedule", id=7, outcome=outcome,
                         samples_new=new)


def test_after_a_refused_session_the_next_waits_for_backoff_times_its_new_samples():
    schedule = SchedulePolicy(min_new_samples=10, backoff=2)
    assert samples_wanted(schedule, None, 512) == 10
    assert samples_wanted(schedule, _judged("promoted", 60), 512) == 10
    assert samples_wanted(schedule, _judged("rolled_back", 55), 512) == 110
    # Refused again on those 110: 220. Spaced out geometrically, up to what a session takes.
    assert samples_wanted(schedule, _judged("rolled_back", 110), 512) == 220
    assert samples_wanted(schedule, _judged("rolled_back", 300), 512) == 512
    assert samples_wanted(SchedulePolicy(min_new_samples=10, backoff=1.5),
                          _judged("rolled_back", 5), 512) == 10  # never below the minimum
    # Off by default: every pending sample starts a session, refusals or not.
    assert samples_wanted(SchedulePolicy(), _judged("rolled_back", 64), 512) == 1
