"""One contract, every backend: each case builds a fake board (sysfs tree, jtop client, tegrastats
executable, RAPL tree, /proc/stat or recording) from the fixtures in tests/fixtures/telemetry,
whose headers name the board and JetPack they represent."""

import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Callable, Dict, NamedTuple, Optional

import pytest

from odtd.telemetry import SELECTABLE, Backend, PowerSample, Sampler
from odtd.telemetry.estimate import EstimateBackend
from odtd.telemetry.ina3221 import Ina3221Backend
from odtd.telemetry.jtop_backend import JtopBackend
from odtd.telemetry.null import NullBackend
from odtd.telemetry.playback import PlaybackBackend
from odtd.telemetry.rapl import RaplBackend
from odtd.telemetry.tegrastats import TegrastatsBackend

FIXTURES = Path(__file__).parent / "fixtures" / "telemetry"


def build_tree(root: Path, fixture: str) -> Dict:
    spec = json.loads((FIXTURES / fixture).read_text())
    for relative, content in spec["files"].items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return spec


class FakeJtopException(Exception):
    """Stands in for jtop.core.exceptions.JtopException."""


class FakeJtop:
    """Duck of jetson-stats' ``jtop.jtop`` client, playing back recorded ``jetson.power`` frames."""

    frames: list = []
    memory: object = None
    temperature: object = {}
    start_error: Optional[str] = None
    instances: list = []

    def __init__(self, interval=0.5):
        self.interval = interval
        self.index = -1
        self.started = self.closed = False
        FakeJtop.instances.append(self)

    def start(self):
        if self.start_error:
            raise FakeJtopException(self.start_error)
        self.started = True

    def ok(self, spin=False):
        if self.closed:
            return False
        time.sleep(self.interval)
        self.index += 1
        return True

    @property
    def power(self):
        frame = self.frames[self.index % len(self.frames)]
        return tuple(frame) if isinstance(frame, list) else frame

    def close(self):
        self.closed = True


def install_fake_jtop(monkeypatch, root: Path, fixture: str) -> Dict:
    spec = json.loads((FIXTURES / fixture).read_text())
    client = type("jtop", (FakeJtop,), {
        "frames": spec["frames"], "memory": spec.get("memory"),
        "temperature": spec.get("temperature", {}), "start_error": None, "instances": []})
    module = types.ModuleType("jtop")
    module.jtop = client
    module.JtopException = FakeJtopException
    monkeypatch.setitem(sys.modules, "jtop", module)
    (root / "run").mkdir(parents=True, exist_ok=True)
    (root / "run" / "jtop.sock").write_text("")
    return spec


def install_fake_tegrastats(root: Path, log: str) -> Path:
    """A real executable at root/usr/bin/tegrastats that prints a recorded log at --interval."""
    script = root / "usr" / "bin" / "tegrastats"
    script.parent.mkdir(parents=True, exist_ok=True)
    argv_file = root / "tegrastats.argv"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        f"open({str(argv_file)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "interval = int(sys.argv[sys.argv.index('--interval') + 1]) / 1000.0\n"
        f"lines = [l for l in open({str(FIXTURES / log)!r}).read().splitlines()\n"
        "         if l.strip() and not l.startswith('#')]\n"
        "i = 0\n"
        "while True:\n"
        "    print(lines[i % len(lines)], flush=True)\n"
        "    i += 1\n"
        "    time.sleep(interval)\n")
    script.chmod(0o755)
    return argv_file


class Case(NamedTuple):
    backend: Backend
    root: Path
    total_rail: Optional[str]
    total_is_sum: bool
    first_total_mw: Optional[float]


CASES: Dict[str, Callable[[Path, pytest.MonkeyPatch], Case]] = {}


def case(name):
    def register(factory):
        CASES[name] = factory
        return factory
    return register


@case("jtop-4.2-tx2-jp46")
def _jtop_42_tx2(root, monkeypatch):
    install_fake_jtop(monkeypatch, root, "jtop_power_42_tx2_jp46.json")
    return Case(JtopBackend(root, interval_s=0.01), root, "VDD_IN", False, 3056.0)


@case("jtop-4.2-orin-nano-jp6")
def _jtop_42_nano(root, monkeypatch):
    install_fake_jtop(monkeypatch, root, "jtop_power_42_orin_nano_jp6.json")
    return Case(JtopBackend(root, interval_s=0.01), root, "VDD_IN", False, 4803.0)


@case("jtop-legacy-tx2-jp44")
def _jtop_legacy_tx2(root, monkeypatch):
    install_fake_jtop(monkeypatch, root, "jtop_power_legacy_tx2_jp44.json")
    return Case(JtopBackend(root, interval_s=0.01), root, "VDD_IN", False, 3056.0)


@case("ina3221-tx2-jp46")
def _ina_tx2(root, monkeypatch):
    build_tree(root, "tx2_jp46_sysfs.json")
    return Case(Ina3221Backend(root), root, "VDD_IN", False, 3056.0)


@case("ina3221-orin-nano-jp6")
def _ina_nano(root, monkeypatch):
    build_tree(root, "orin_nano_jp6_sysfs.json")
    return Case(Ina3221Backend(root), root, "VDD_IN", False, 5072 * 947 / 1000)


@case("ina3221-agx-orin-jp512")
def _ina_agx(root, monkeypatch):
    build_tree(root, "agx_orin_jp512_sysfs.json")
    total = (5000 * 641 + 5000 * 881 + 5000 * 953 + 1800 * 240) / 1000
    return Case(Ina3221Backend(root), root, None, True, total)


@case("tegrastats-tx2-jp46")
def _tegrastats_tx2(root, monkeypatch):
    install_fake_tegrastats(root, "tegrastats_tx2_jp46.log")
    return Case(TegrastatsBackend(root, interval_ms=20), root, "VDD_IN", False, 3056.0)


@case("tegrastats-orin-nano-jp6")
def _tegrastats_nano(root, monkeypatch):
    install_fake_tegrastats(root, "tegrastats_orin_nano_jp6.log")
    return Case(TegrastatsBackend(root, interval_ms=20), root, "VDD_IN", False, 4803.0)


@case("tegrastats-agx-orin-r39")
def _tegrastats_r39(root, monkeypatch):
    install_fake_tegrastats(root, "tegrastats_agx_orin_r39.log")
    return Case(TegrastatsBackend(root, interval_ms=20), root, None, True, 2792.0 + 0 + 3918)


@case("tegrastats-thor-jp70")
def _tegrastats_thor(root, monkeypatch):
    install_fake_tegrastats(root, "tegrastats_thor_jp70.log")
    return Case(TegrastatsBackend(root, interval_ms=20), root, "VIN", False, 34842.0)


@case("rapl-x86")
def _rapl(root, monkeypatch):
    build_tree(root, "rapl_x86_sysfs.json")
    return Case(RaplBackend(root), root, None, True, None)


@case("estimate-tx2-proc")
def _estimate(root, monkeypatch):
    build_tree(root, "tx2_jp46_sysfs.json")
    return Case(EstimateBackend(root), root, "estimated_board", False, 1900.0)


@case("none")
def _none(root, monkeypatch):
    return Case(NullBackend(root), root, None, False, None)


@case("playback-jsonl-tx2")
def _playback_jsonl(root, monkeypatch):
    path = FIXTURES / "recording_tx2_jp46_ina3221.jsonl"
    return Case(PlaybackBackend(root, path=str(path)), root, "VDD_IN", False, 3056.0)


@case("playback-tegrastats-tx2")
def _playback_log(root, monkeypatch):
    path = FIXTURES / "tegrastats_tx2_jp46_train_1000.log"
    # 1,000 samples at 50x last 2 s: looped, as the meter plays it back, so a loaded machine that
    # opens a window late still finds samples.
    backend = PlaybackBackend(root, path=str(path), interval_ms=100, speed=50.0, loop=True)
    return Case(backend, root, "VDD_IN", False, 1871.0)


@pytest.fixture(params=sorted(CASES))
def board(request, tmp_path, monkeypatch):
    built = CASES[request.param](tmp_path, monkeypatch)
    yield built
    built.backend.close()


def read_samples(backend: Backend, count: int, attempts: int = 200):
    samples = []
    for _ in range(attempts):
        sample = backend.read()
        if sample is not None:
            samples.append(sample)
            if len(samples) == count:
                break
        elif backend.nominal_interval_s is None:
            time.sleep(0.002)
    return samples


def test_backend_is_a_registered_subclass(board):
    backend = board.backend
    assert isinstance(backend, Backend)
    assert SELECTABLE[backend.name] is type(backend)
    assert backend.source


def test_probe_passes_on_its_board(board):
    assert type(board.backend).probe(board.root) is None


def test_probe_explains_itself_elsewhere(board, tmp_path_factory):
    empty = tmp_path_factory.mktemp("empty")
    backend_class = type(board.backend)
    if backend_class.name == "jtop":
        sys.modules.pop("jtop", None)  # monkeypatch restores it
    reason = backend_class.probe(empty)
    if backend_class.name in ("none", "playback"):
        assert reason is None
    else:
        assert isinstance(reason, str) and reason and "\n" not in reason


def test_reads_normalised_samples(board):
    backend = board.backend
    backend.open()
    if not backend.measures_energy:
        assert read_samples(backend, 1, attempts=3) == []
        return
    samples = read_samples(backend, 3)
    assert len(samples) == 3
    before = time.monotonic()
    for previous, sample in zip([None] + samples, samples):
        assert isinstance(sample, PowerSample)
        assert sample.t_mono <= before
        if previous is not None:
            assert sample.t_mono > previous.t_mono
        assert sample.power_mw
        assert all(math.isfinite(v) and v >= 0 for v in sample.power_mw.values())
        assert sample.total_rail == board.total_rail
        assert sample.total_is_sum == board.total_is_sum
        if sample.total_rail is not None:
            assert not sample.total_is_sum
            assert sample.total_power_mw == sample.power_mw[sample.total_rail]
        else:
            assert sample.total_is_sum
            assert sample.total_power_mw <= sum(sample.power_mw.values()) + 1e-6
    if board.first_total_mw is not None:
        assert samples[0].total_power_mw == pytest.approx(board.first_total_mw)
    backend.close()
    backend.close()


def test_sampler_window_carries_the_source(board):
    backend = board.backend
    backend.open()
    sampler = Sampler(backend, interval_s=0.005)
    sampler.start()
    try:
        sampler.open_window("w")
        # Four samples inside the window: on a loaded machine more than four may already have
        # been taken before it opened.
        wanted = sampler.stats().samples + 4
        deadline = time.monotonic() + 5.0
        while sampler.stats().samples < wanted and time.monotonic() < deadline:
            if not backend.measures_energy:
                break
            time.sleep(0.01)
        report = sampler.close_window("w")
    finally:
        sampler.stop()
    assert report.source == backend.source
    if backend.measures_energy:
        assert report.energy_j is not None and report.energy_j >= 0
        assert 0 < report.coverage <= 1
        assert report.total_rail == board.total_rail
        assert report.total_is_sum == board.total_is_sum
    else:
        assert report.energy_j is None and report.coverage == 0


def test_every_selectable_backend_has_a_case():
    assert {name.split("-")[0] for name in CASES} == set(SELECTABLE)


def test_fakes_leave_no_child_behind(tmp_path):
    argv_file = install_fake_tegrastats(tmp_path, "tegrastats_tx2_jp46.log")
    backend = TegrastatsBackend(tmp_path, interval_ms=10)
    backend.open()
    process = backend._process
    assert read_samples(backend, 2)
    backend.close()
    assert process.poll() is not None
    assert "--stop" not in argv_file.read_text()
    assert argv_file.read_text().split() == ["--interval", "10"]


def test_importing_telemetry_loads_neither_jtop_nor_tensorflow():
    code = ("import sys, odtd.telemetry; "
            "print('jtop' in sys.modules, 'tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[1]).stdout
    assert out.split() == ["False", "False"]
