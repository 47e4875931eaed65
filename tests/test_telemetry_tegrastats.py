"""tegrastats lines of every JetPack generation, recordings, and playing them back for energy."""

import json
import logging
from datetime import datetime
from pathlib import Path

import pytest
from conftest import odtctl

from odtd.config import load_config
from odtd.errors import ConfigError, OdtdError
from odtd.telemetry import PowerSample, integrate_recording, open_backend, parse_line, record
from odtd.telemetry.playback import PlaybackBackend, load_recording

FIXTURES = Path(__file__).parent / "fixtures" / "telemetry"


def fixture_lines(name):
    return [line for line in (FIXTURES / name).read_text().splitlines()
            if line and not line.startswith("#")]


def test_tx2_jetpack4_line():
    parsed = parse_line(fixture_lines("tegrastats_tx2_jp46.log")[0])
    assert parsed.power_mw == {"VDD_SYS_GPU": 152.0, "VDD_SYS_SOC": 687.0, "VDD_4V0_WIFI": 0.0,
                               "VDD_IN": 3056.0, "VDD_SYS_CPU": 152.0, "VDD_SYS_DDR": 883.0}
    assert parsed.timestamp is None
    assert (parsed.ram_used_mb, parsed.ram_total_mb) == (2344.0, 7852.0)
    assert parsed.temps_c["Tdiode"] == 34.25 and parsed.temps_c["GPU"] == 35.0
    sample = parsed.to_sample(12.5)
    assert (sample.total_power_mw, sample.total_rail, sample.total_is_sum) == \
        (3056.0, "VDD_IN", False)
    assert sample.memory_available_mb == 7852.0 - 2344.0


def test_first_value_is_the_instantaneous_one():
    parsed = parse_line(fixture_lines("tegrastats_tx2_jp46.log")[2])
    assert parsed.power_mw["VDD_SYS_DDR"] == 115.0  # "VDD_SYS_DDR 115/124"


def test_jetpack6_line_with_timestamp_and_units():
    parsed = parse_line(fixture_lines("tegrastats_orin_nano_jp6.log")[1])
    assert parsed.timestamp == datetime(2024, 9, 25, 10, 15, 2)
    assert parsed.power_mw == {"VDD_IN": 9127.0, "VDD_CPU_GPU_CV": 3871.0, "VDD_SOC": 2012.0}
    assert parsed.temps_c["tj"] == 48.5
    assert "NVENC" not in parsed.power_mw and "RAM" not in parsed.power_mw


def test_three_value_rails_and_two_value_temperatures():
    parsed = parse_line(fixture_lines("tegrastats_agx_orin_r39.log")[0])
    assert parsed.power_mw == {"VDD_GPU_SOC": 2792.0, "VDD_CPU_CV": 0.0, "VIN_SYS_5V0": 3918.0}
    assert parsed.temps_c["cpu"] == 43.093
    sample = parsed.to_sample(0.0)
    assert sample.total_is_sum and sample.total_rail is None
    assert sample.total_power_mw == 6710.0


def test_thor_total_is_vin():
    sample = parse_line(fixture_lines("tegrastats_thor_jp70.log")[0]).to_sample(0.0)
    assert (sample.total_rail, sample.total_power_mw) == ("VIN", 34842.0)
    assert sample.power_mw["VIN_SYS_5V0"] == 8696.0


def test_other_boards_of_jetpack4():
    # datadog-agent jetson check samples: Nano (POM_*), AGX Xavier (no input rail), TX1.
    nano = parse_line("RAM 534/3964MB (lfb 98x4MB) SWAP 5/1982MB (cached 1MB) IRAM 0/252kB(lfb "
                      "252kB) CPU [16%@204,9%@204,0%@204,0%@204] EMC_FREQ 0%@204 GR3D_FREQ 0%@76 "
                      "APE 25 PLL@34C CPU@36.5C PMIC@100C GPU@36C AO@39.5C thermal@36.25C "
                      "POM_5V_IN 1022/1022 POM_5V_GPU 0/0 POM_5V_CPU 204/204").to_sample(0.0)
    assert (nano.total_rail, nano.total_power_mw) == ("POM_5V_IN", 1022.0)
    assert "IRAM" not in nano.power_mw and "SWAP" not in nano.power_mw
    xavier = parse_line("RAM 721/31927MB (lfb 7291x4MB) SWAP 0/15963MB (cached 0MB) CPU "
                        "[2%@1190,0%@1190,0%@1190,0%@1190,off,off,off,off] EMC_FREQ 0%@665 "
                        "GR3D_FREQ 0%@318 APE 150 MTS fg 0% bg 0% AO@37.5C GPU@37.5C Tdiode@40C "
                        "PMIC@100C AUX@36C CPU@37.5C thermal@36.9C Tboard@37C GPU 0/0 CPU 311/311 "
                        "SOC 932/932 CV 0/0 VDDRQ 621/621 SYS5V 1482/1482").to_sample(0.0)
    assert xavier.total_is_sum and xavier.total_power_mw == 311 + 932 + 621 + 1482
    tx1 = parse_line("RAM 1179/3983MB (lfb 120x4MB) IRAM 0/252kB(lfb 252kB) CPU "
                     "[1%@102,4%@102,0%@102,0%@102] EMC_FREQ 7%@408 GR3D_FREQ 0%@76 APE 25 "
                     "AO@42.5C CPU@37.5C GPU@39C PLL@37C Tdiode@42.75C PMIC@100C Tboard@42C "
                     "thermal@38.5C VDD_IN 2532/2698 VDD_CPU 76/178 VDD_GPU 19/19").to_sample(0.0)
    assert (tx1.total_rail, tx1.total_power_mw) == ("VDD_IN", 2532.0)


def test_line_without_rails():
    parsed = parse_line("RAM 1004/7852MB (lfb 7x2MB) CPU [0%@350] EMC_FREQ 17%@40")
    assert parsed.power_mw == {} and parsed.ram_used_mb == 1004.0


def hand_energy_j(log_path: Path, rail: str, interval_s: float) -> float:
    """Independent figure: sum of mW x 0.1 s, minus half of each end sample (trapezoid)."""
    values = []
    for line in log_path.read_text().splitlines():
        tokens = line.split()
        if rail in tokens:
            values.append(int(tokens[tokens.index(rail) + 1].split("/")[0]))
    assert len(values) == 1000
    return (sum(values) - (values[0] + values[-1]) / 2.0) * interval_s / 1000.0


def test_thousand_line_tx2_log_energy_matches_a_hand_computation():
    log = FIXTURES / "tegrastats_tx2_jp46_train_1000.log"
    result = integrate_recording(log, fmt="tegrastats", interval_ms=100)
    assert set(result) == {"duration_s", "samples", "total_j", "energy_by_rail_j", "total_rail",
                           "coverage", "source"}
    expected_j = hand_energy_j(log, "VDD_IN", 0.1)
    assert result["total_j"] == pytest.approx(expected_j, rel=0.005)
    assert result["total_rail"] == "VDD_IN"
    assert result["samples"] == 1000 and result["coverage"] == pytest.approx(1.0)
    assert result["duration_s"] == pytest.approx(99.9)
    assert result["source"] == "tegrastats"
    # The total is VDD_IN, not VDD_IN plus its own sub-rails.
    sum_of_rails_j = sum(result["energy_by_rail_j"].values())
    assert sum_of_rails_j > 1.5 * result["total_j"]
    assert result["energy_by_rail_j"]["VDD_IN"] == pytest.approx(result["total_j"])


def test_log_without_timestamps_needs_its_interval():
    with pytest.raises(OdtdError, match="pass the interval it was taken at"):
        integrate_recording(FIXTURES / "tegrastats_tx2_jp46.log", fmt="tegrastats")


def test_interval_of_a_timestamped_log_comes_from_its_stamps():
    recording = load_recording(FIXTURES / "tegrastats_orin_nano_jp6.log", "tegrastats")
    assert recording.interval_s == pytest.approx(1.0)
    result = integrate_recording(FIXTURES / "tegrastats_orin_nano_jp6.log", fmt="tegrastats")
    # Trapezoids over 1 s steps: (4803 + 9127) / 2 + (9127 + 9342) / 2 mJ.
    assert result["total_j"] == pytest.approx((4803 + 9127) / 2000 + (9127 + 9342) / 2000)


def test_jsonl_recording_plays_back_to_its_energy():
    result = integrate_recording(FIXTURES / "recording_tx2_jp46_ina3221.jsonl")
    # 19 steps at 3056 mW, one ramp step, 19 at 8411 mW, each 10 ms.
    expected_j = (19 * 3056 + (3056 + 8411) / 2 + 19 * 8411) * 0.01 / 1000
    assert result["total_j"] == pytest.approx(expected_j)
    assert (result["source"], result["total_rail"], result["samples"]) == ("ina3221", "VDD_IN", 40)


@pytest.mark.parametrize("content, message", [
    ("", "has no {\"format\": \"odtd-telemetry\"} header"),
    ("not json\n", ":1 is not JSON"),
    ('{"format": "odtd-telemetry"}\n{"t_mono": 1}\n', ":2 is not a sample line"),
    ('{"format": "odtd-telemetry"}\n', "has no power samples"),
])
def test_bad_recordings_name_file_line_and_fix(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(OdtdError, match=message.replace("{", r"\{").replace("}", r"\}")):
        integrate_recording(path)


def test_record_then_playback_round_trip(tmp_path):
    source = PlaybackBackend(path=str(FIXTURES / "tegrastats_tx2_jp46_train_1000.log"),
                           interval_ms=100, speed=50.0)
    source.open()
    out = tmp_path / "session.jsonl"
    summary = record(source, 0.3, out, interval_s=0.01)
    source.close()
    lines = out.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "odtd-telemetry" and header["source"] == "playback"
    assert header["total_rail"] == "VDD_IN" and header["total_is_sum"] is False
    assert summary["samples"] == len(lines) - 1 >= 5
    played = integrate_recording(out)
    assert played["samples"] == summary["samples"]
    assert played["total_rail"] == "VDD_IN" and played["coverage"] == pytest.approx(1.0)
    first = json.loads(lines[1])
    assert first["power_mw"]["VDD_IN"] == 1871.0 and first["total_mw"] == 1871.0


def test_playback_backend_restamps_on_the_present_clock():
    backend = PlaybackBackend(path=str(FIXTURES / "recording_tx2_jp46_ina3221.jsonl"), speed=10.0)
    backend.open()
    samples = [backend.read() for _ in range(40)]
    assert backend.read() is None and backend.finished
    backend.close()
    assert all(isinstance(s, PowerSample) for s in samples)
    spacing = [b.t_mono - a.t_mono for a, b in zip(samples, samples[1:])]
    assert spacing == pytest.approx([0.001] * 39)


def test_cli_playback_and_its_former_name_replay(tmp_path):
    # `odtctl telemetry playback` integrates a recording; `replay`, its first name (before
    # "replay" meant the rehearsal buffer alone), does the same with one deprecation line.
    log = FIXTURES / "tegrastats_tx2_jp46_train_1000.log"
    args = ("--format", "tegrastats", "--interval-ms", "100", "--json")
    played = odtctl("telemetry", "playback", str(log), *args)
    assert played.stderr == ""
    result = json.loads(played.stdout)
    assert result == integrate_recording(log, fmt="tegrastats", interval_ms=100)
    assert result["total_j"] == pytest.approx(hand_energy_j(log, "VDD_IN", 0.1), rel=0.005)
    old = odtctl("telemetry", "replay", str(log), *args)
    assert json.loads(old.stdout) == result
    assert old.stderr == "odtctl telemetry replay is deprecated: use odtctl telemetry playback\n"
    refused = odtctl("telemetry", "playback", check=False)
    assert refused.returncode != 0
    assert refused.stderr.strip() == "Error: telemetry playback: give the recording FILE"


def test_odtd_yaml_replay_backend_keys_load_as_playback(tmp_path, caplog):
    path = tmp_path / "odtd.yaml"
    log = FIXTURES / "tegrastats_tx2_jp46_train_1000.log"
    path.write_text(f"telemetry:\n  backend: replay\n  replay_file: {log}\n"
                    "  replay_interval_ms: 100\n")
    with caplog.at_level(logging.WARNING, logger="odtd.config"):
        telemetry = load_config(path).telemetry
    assert (telemetry.backend, telemetry.playback_file, telemetry.playback_interval_ms) == \
        ("playback", str(log), 100.0)
    assert [record.getMessage() for record in caplog.records] == [
        f"{path}: telemetry.replay_file is deprecated: rename it telemetry.playback_file "
        "(same value)",
        f"{path}: telemetry.replay_interval_ms is deprecated: rename it "
        "telemetry.playback_interval_ms (same value)",
        f"{path}: telemetry.backend: replay is deprecated: write playback"]
    path.write_text(f"telemetry:\n  replay_file: {log}\n  playback_file: {log}\n")
    with pytest.raises(ConfigError, match="telemetry.replay_file and telemetry.playback_file "
                                          "are the same setting"):
        load_config(path)
    path.write_text("telemetry:\n  backend: replay\n")  # the check names the new key
    with pytest.raises(ConfigError, match="backend 'playback' needs telemetry.playback_file"):
        load_config(path)
    with caplog.at_level(logging.WARNING, logger="odtd.telemetry"):
        backend = open_backend("replay", path=str(log), interval_ms=100, speed=50.0)
    try:
        assert backend.name == "playback" and backend.read().total_rail == "VDD_IN"
    finally:
        backend.close()
    assert "telemetry backend replay is deprecated: it is called playback now" in caplog.text
