"""What each backend must get right beyond the contract: totals, units, quirks, messages."""

import json
import sys
import time
import types
from pathlib import Path

import pytest

from odtd.errors import OdtdError, TelemetryUnavailable
from odtd.telemetry import BACKENDS, describe_backends, open_backend, rapl
from odtd.telemetry.estimate import EstimateBackend
from odtd.telemetry.ina3221 import Ina3221Backend, discover_rails
from odtd.telemetry.jtop_backend import JtopBackend, normalise_power
from odtd.telemetry.rapl import RaplBackend
from odtd.telemetry.tegrastats import TegrastatsBackend

FIXTURES = Path(__file__).parent / "fixtures" / "telemetry"


def build_tree(root: Path, fixture: str) -> dict:
    spec = json.loads((FIXTURES / fixture).read_text())
    for relative, content in spec["files"].items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return spec


def frames(fixture: str) -> list:
    return json.loads((FIXTURES / fixture).read_text())["frames"]


# --- jtop -----------------------------------------------------------------------------------

def test_jtop_legacy_layout_uses_vdd_in_not_jtops_sum():
    total, rails = frames("jtop_power_legacy_tx2_jp44.json")[0]
    power_mw, total_mw, total_rail, is_sum = normalise_power((total, rails))
    assert total["cur"] == 152 + 687 + 0 + 3056 + 152 + 883  # jetson-stats 3.x summed VDD_IN in
    assert (total_mw, total_rail, is_sum) == (3056.0, "VDD_IN", False)
    assert power_mw["SYS GPU"] == 152.0 and "IN" not in power_mw


def test_jtop_uses_instantaneous_values_never_avg():
    total, rails = frames("jtop_power_legacy_tx2_jp44.json")[1]
    power_mw, total_mw, _, _ = normalise_power((total, rails))
    assert total_mw == 1876.0 and rails["IN"]["avg"] == 2466
    assert power_mw["SYS DDR"] == 115.0
    power_mw, total_mw, _, _ = normalise_power(frames("jtop_power_42_tx2_jp46.json")[1])
    assert total_mw == 1876.0 and power_mw["VDD_IN"] == 1876.0


def test_jtop_42_layout_puts_tot_back_as_the_input_rail():
    power_mw, total_mw, total_rail, is_sum = normalise_power(
        frames("jtop_power_42_orin_nano_jp6.json")[2])
    assert (total_mw, total_rail, is_sum) == (9342.0, "VDD_IN", False)
    assert set(power_mw) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}


def test_jtop_42_tot_without_name_is_a_sum():
    # AGX Xavier (JetPack 5): no input rail, so jetson-stats 4.2 sums the rails into 'tot'.
    power = {"rail": {"GPU": {"power": 0, "avg": 0}, "CPU": {"power": 311, "avg": 300},
                      "SOC": {"power": 932, "avg": 930}, "CV": {"power": 0, "avg": 0},
                      "VDDRQ": {"power": 621, "avg": 600}, "SYS5V": {"power": 1482, "avg": 1400}},
             "tot": {"power": 3346, "avg": 3230}}
    _, total_mw, total_rail, is_sum = normalise_power(power)
    assert (total_mw, total_rail, is_sum) == (3346.0, None, True)


def test_jtop_legacy_popped_pom_5v_in_is_restored():
    # Nano on jetson-stats 3.x: POM_5V_IN is taken out of the list into the total.
    total = {"cur": 1022, "avg": 1022}
    rails = {"5V GPU": {"cur": 0, "avg": 0}, "5V CPU": {"cur": 204, "avg": 204}}
    power_mw, total_mw, total_rail, is_sum = normalise_power((total, rails))
    assert (total_mw, total_rail, is_sum) == (1022.0, "POM_5V_IN", False)
    assert power_mw["POM_5V_IN"] == 1022.0


def test_jtop_unknown_layout_is_a_value_error():
    with pytest.raises(ValueError, match="unknown jtop power layout"):
        normalise_power("12 W")


def _fake_jtop_module(start_error=None):
    class Client:
        def __init__(self, interval=0.5):
            self.interval = interval

        def start(self):
            raise module.JtopException(start_error)

        def close(self):
            pass

    module = types.ModuleType("jtop")
    module.JtopException = type("JtopException", (Exception,), {})
    module.jtop = Client
    return module


def test_jtop_service_down_names_the_fix(tmp_path, monkeypatch):
    message = "The jetson_stats.service is not active. Please run:\nsudo systemctl restart jtop"
    monkeypatch.setitem(sys.modules, "jtop", _fake_jtop_module(message))
    backend = JtopBackend(tmp_path)
    with pytest.raises(TelemetryUnavailable, match=r"sudo systemctl start jtop.*`jtop` group"):
        backend.open()


def test_jtop_client_that_stopped_is_a_gap_with_the_fix(tmp_path, monkeypatch):
    module = _fake_jtop_module()
    module.jtop.start = lambda self: None
    module.jtop.ok = lambda self, spin=False: False  # jtop gave up: no update in 3 intervals
    monkeypatch.setitem(sys.modules, "jtop", module)
    backend = JtopBackend(tmp_path)
    backend.open()
    with pytest.raises(TelemetryUnavailable, match="no update from the jetson-stats service"):
        backend.read()
    backend.close()


def test_jtop_probe_messages(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "jtop", raising=False)
    assert "pip3 install -U jetson-stats" in JtopBackend.probe(tmp_path)
    monkeypatch.setitem(sys.modules, "jtop", _fake_jtop_module())
    assert "sudo systemctl start jtop" in JtopBackend.probe(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "jtop.sock").write_text("")
    monkeypatch.setattr("odtd.telemetry.jtop_backend.os.access", lambda path, mode: False)
    assert "usermod -aG jtop" in JtopBackend.probe(tmp_path)


# --- INA3221 sysfs --------------------------------------------------------------------------

def test_ina3221_tx2_rails_found_by_label(tmp_path):
    build_tree(tmp_path, "tx2_jp46_sysfs.json")
    rails = {rail.name: rail for rail in discover_rails(tmp_path)}
    assert set(rails) == {"VDD_SYS_GPU", "VDD_SYS_SOC", "VDD_4V0_WIFI", "VDD_IN", "VDD_SYS_CPU",
                          "VDD_SYS_DDR"}
    assert rails["VDD_IN"].first.parent.parent.name == "0-0041"
    assert rails["VDD_SYS_GPU"].first.parent.parent.name == "0-0040"


def test_ina3221_reads_the_value_now_not_at_open(tmp_path):
    build_tree(tmp_path, "tx2_jp46_sysfs.json")
    with Ina3221Backend(tmp_path) as backend:
        assert backend.read().total_power_mw == 3056.0
        power_file = tmp_path / "sys/bus/i2c/drivers/ina3221x/0-0041/iio:device1/in_power0_input"
        power_file.write_text("8411\n")
        sample = backend.read()
    assert sample.total_power_mw == 8411.0
    assert sample.total_power_mw < sum(sample.power_mw.values())  # never the sum on a TX2
    assert sample.memory_available_mb == pytest.approx(5637604 / 1024)
    assert sample.temps_c["GPU-therm"] == 35.0


def test_ina3221_hwmon_skips_nc_and_sum_of_shunts(tmp_path):
    build_tree(tmp_path, "agx_orin_jp512_sysfs.json")
    names = [rail.name for rail in discover_rails(tmp_path)]
    assert names == ["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"]
    with Ina3221Backend(tmp_path) as backend:
        sample = backend.read()
    assert sample.power_mw["VDD_GPU_SOC"] == pytest.approx(3205.0)  # 5000 mV x 641 mA
    assert sample.total_is_sum and sample.total_rail is None


def test_ina3221_duplicate_labels_get_their_device(tmp_path):
    build_tree(tmp_path, "orin_nano_jp6_sysfs.json")
    twin = tmp_path / "sys/bus/i2c/drivers/ina3221/1-0041/hwmon/hwmon2"
    twin.mkdir(parents=True)
    for name, value in (("in1_label", "VDD_SOC\n"), ("in1_input", "5000\n"),
                        ("curr1_input", "10\n")):
        (twin / name).write_text(value)
    names = [rail.name for rail in discover_rails(tmp_path)]
    assert "VDD_SOC@1-0040" in names and "VDD_SOC@1-0041" in names


def test_ina3221_without_rails_is_unavailable(tmp_path):
    (tmp_path / "sys/bus/i2c/drivers/ina3221").mkdir(parents=True)
    assert "no labelled rails" in Ina3221Backend.probe(tmp_path)
    with pytest.raises(TelemetryUnavailable, match="choose another telemetry backend"):
        Ina3221Backend(tmp_path).open()


# --- RAPL -----------------------------------------------------------------------------------

def test_rapl_power_from_deltas_across_a_wraparound(tmp_path):
    build_tree(tmp_path, "rapl_x86_sysfs.json")
    zone = tmp_path / "sys/class/powercap/intel-rapl:0"
    with RaplBackend(tmp_path) as backend:
        first = backend.read()
        (zone / "energy_uj").write_text("4000\n")  # wrapped: 262143328850 - 262143000000 + 4000
        (zone.parent / "intel-rapl:0:2" / "energy_uj").write_text("50200000\n")
        time.sleep(0.01)
        second = backend.read()
    elapsed_s = second.t_mono - first.t_mono
    package_uj = second.power_mw["package-0"] * elapsed_s * 1000.0
    assert package_uj == pytest.approx(262143328850 - 262143000000 + 4000)
    dram_uj = second.power_mw["package-0/dram"] * elapsed_s * 1000.0
    assert dram_uj == pytest.approx(200000)
    assert second.total_is_sum and second.total_rail is None
    # Packages plus DRAM; core and uncore are inside the package, psys overlaps everything.
    assert second.total_power_mw == pytest.approx(
        second.power_mw["package-0"] + second.power_mw["package-0/dram"])
    assert set(second.power_mw) == {"package-0", "package-0/core", "package-0/uncore",
                                    "package-0/dram", "psys"}


def test_rapl_unreadable_counter_names_the_fix(tmp_path, monkeypatch):
    build_tree(tmp_path, "rapl_x86_sysfs.json")

    real_read = rapl.read_int_file

    def root_only(path):
        if path.name == "energy_uj":  # mode 0400 root since CVE-2020-8694
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(rapl, "read_int_file", root_only)
    reason = RaplBackend.probe(tmp_path)
    assert reason.startswith("RAPL energy_uj not readable (Permission denied; root-only since "
                             "CVE-2020-8694)")


# --- estimate -------------------------------------------------------------------------------

def test_estimate_models_power_from_proc_stat(tmp_path):
    stat = tmp_path / "proc" / "stat"
    stat.parent.mkdir(parents=True)
    stat.write_text("cpu  1000 0 500 8000 500 0 0 0 0 0\n")
    with EstimateBackend(tmp_path, idle_w=2.0, max_w=10.0, window_s=0.0) as backend:
        assert backend.read().total_power_mw == pytest.approx(2000.0)
        # +300 busy (user/system/irq) and +100 idle+iowait ticks: 75% busy.
        stat.write_text("cpu  1200 0 550 8050 550 0 50 0 0 0\n")
        sample = backend.read()
    assert sample.total_power_mw == pytest.approx(1000 * (2.0 + 8.0 * 0.75))
    assert sample.total_rail == "estimated_board" and not sample.total_is_sum


def test_estimate_rejects_impossible_parameters(tmp_path):
    with pytest.raises(OdtdError, match="idle_w=20"):
        open_backend("estimate", tmp_path, idle_w=20.0, max_w=10.0)


# --- tegrastats child -----------------------------------------------------------------------

def test_tegrastats_child_that_dies_is_reported(tmp_path):
    script = tmp_path / "usr" / "bin" / "tegrastats"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\necho 'tegrastats: Permission denied' >&2\nexit 1\n")
    script.chmod(0o755)
    with pytest.raises(TelemetryUnavailable, match="exited with status 1: tegrastats: Permission"):
        TegrastatsBackend(tmp_path, interval_ms=10, start_timeout_s=2.0).open()


def test_tegrastats_missing_is_a_probe_reason(tmp_path):
    assert "tegrastats not found" in TegrastatsBackend.probe(tmp_path)


# --- registry -------------------------------------------------------------------------------

def test_registry_order_is_the_detection_order():
    assert list(BACKENDS) == ["jtop", "ina3221", "tegrastats", "rapl", "estimate", "none"]


def _auto_name(root) -> str:
    backend = open_backend("auto", root)
    try:
        return backend.name
    finally:
        backend.close()


def test_auto_opens_the_first_available(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "jtop", raising=False)
    assert _auto_name(tmp_path) == "none"
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "stat").write_text("cpu  1 0 1 10 0 0 0 0 0 0\n")
    assert _auto_name(tmp_path) == "estimate"
    build_tree(tmp_path, "tx2_jp46_sysfs.json")
    assert _auto_name(tmp_path) == "ina3221"


def test_describe_backends_lists_every_selectable_one(tmp_path):
    build_tree(tmp_path, "rapl_x86_sysfs.json")
    rows = describe_backends(tmp_path)
    assert [row["name"] for row in rows] == list(BACKENDS) + ["playback"]
    by_name = {row["name"]: row for row in rows}
    assert by_name["rapl"] == {"name": "rapl", "available": True, "reason": None,
                               "source": "rapl"}
    assert by_name["ina3221"]["available"] is False
    assert "choose another backend" in by_name["ina3221"]["reason"]


def test_open_backend_auto_ignores_options_the_choice_does_not_take(tmp_path):
    build_tree(tmp_path, "tx2_jp46_sysfs.json")
    backend = open_backend("auto", tmp_path, interval_ms=100)
    try:
        assert backend.name == "ina3221"
        assert backend.read().total_rail == "VDD_IN"
    finally:
        backend.close()


def test_open_backend_errors_name_the_choices(tmp_path):
    with pytest.raises(OdtdError, match="unknown; choose auto, jtop, ina3221"):
        open_backend("nvml", tmp_path)
    with pytest.raises(OdtdError, match="has no option interval_ms; its options are: "
                                        "extras_period_s"):
        open_backend("ina3221", tmp_path, interval_ms=100)
    with pytest.raises(TelemetryUnavailable, match="telemetry backend ina3221 is unavailable"):
        open_backend("ina3221", tmp_path)
    with pytest.raises(TelemetryUnavailable, match="telemetry.playback_file"):
        open_backend("playback", tmp_path)
