"""INA3221 power monitors read straight from sysfs: no service, no child process.

Two driver layouts exist, and rails are discovered by their label, never by a fixed path:

* JetPack 4 (L4T R32, NVIDIA's staging IIO driver ``ina3221x``)::

      sys/bus/i2c/drivers/ina3221x/<bus>-<addr>/iio:device<K>/rail_name_<N>     VDD_IN
      sys/bus/i2c/drivers/ina3221x/<bus>-<addr>/iio:device<K>/in_power<N>_input  mW

  On a TX2 module, 0-0040 carries VDD_SYS_GPU, VDD_SYS_SOC, VDD_4V0_WIFI and 0-0041 carries
  VDD_IN, VDD_SYS_CPU, VDD_SYS_DDR (energymon's jetson/JetsonPowerRails.md, from the L4T 32.6.1
  device trees; the same order tegrastats prints them in).

* JetPack 5 and later (mainline hwmon driver ``ina3221``)::

      sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon<K>/in<N>_label    VDD_IN | NC
      sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon<K>/in<N>_input    bus voltage, mV
      sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon<K>/curr<N>_input  current, mA

  Power is mV x mA / 1000. Unconnected channels are labelled ``NC`` and channel 7 is the "sum of
  shunt voltages", which is no rail (both skipped, as jetson-stats' ``jtop/core/power.py`` does).
"""

import logging
import re
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

from odtd.errors import TelemetryUnavailable
from odtd.telemetry.base import Backend, PowerSample, SlowReadings, SysfsIntReader, read_text_file

logger = logging.getLogger(__name__)

IIO_DRIVER_DIR = Path("sys/bus/i2c/drivers/ina3221x")
HWMON_DRIVER_DIR = Path("sys/bus/i2c/drivers/ina3221")
_IIO_LABEL_RE = re.compile(r"^rail_name_(\d+)$")
_HWMON_LABEL_RE = re.compile(r"^in(\d+)_label$")


class RailFiles(NamedTuple):
    """Where one rail's reading lives.

    Attributes:
        name: Rail label, e.g. ``VDD_IN``.
        first: The power file (mW) when ``current_ma`` is None, else the bus voltage file (mV).
        current_ma: The current file (mA) of the hwmon layout, else None.
    """

    name: str
    first: Path
    current_ma: Optional[Path]


def _skip_label(label: str) -> bool:
    return label == "" or label == "NC" or label.lower().startswith("sum of shunt")


def discover_rails(root: Path) -> List[RailFiles]:
    """Find every labelled INA3221 channel under ``root``, in both driver layouts.

    Args:
        root: Filesystem root (``/`` on a board, a fake tree in tests).

    Returns:
        The rails, JetPack 4 layout first; duplicate names get the device as a suffix.
    """
    rails: List[RailFiles] = []
    for device in sorted((root / IIO_DRIVER_DIR).glob("*/iio:device*")):
        for label_path in sorted(device.iterdir()):
            match = _IIO_LABEL_RE.match(label_path.name)
            if not match:
                continue
            channel = match.group(1)
            label = _read_label(label_path)
            if label is not None and not _skip_label(label):
                rails.append(RailFiles(label, device / f"in_power{channel}_input", None))
    for hwmon in sorted((root / HWMON_DRIVER_DIR).glob("*/hwmon/hwmon*")):
        for label_path in sorted(hwmon.iterdir()):
            match = _HWMON_LABEL_RE.match(label_path.name)
            if not match:
                continue
            channel = match.group(1)
            label = _read_label(label_path)
            current = hwmon / f"curr{channel}_input"
            if label is None or _skip_label(label) or not current.exists():
                continue
            rails.append(RailFiles(label, hwmon / f"in{channel}_input", current))
    return _unique(rails)


def _read_label(path: Path) -> Optional[str]:
    try:
        return read_text_file(path)
    except OSError as error:
        logger.debug("rail label %s unreadable: %s", path, error)
        return None


def _unique(rails: List[RailFiles]) -> List[RailFiles]:
    counts: Dict[str, int] = {}
    for rail in rails:
        counts[rail.name] = counts.get(rail.name, 0) + 1
    unique = []
    for rail in rails:
        if counts[rail.name] > 1:
            device = rail.first.parent  # iio:deviceK, or hwmonK under <bus>-<addr>/hwmon
            device_name = (device.parent if rail.current_ma is None else device.parent.parent).name
            rail = rail._replace(name=f"{rail.name}@{device_name}")
        unique.append(rail)
    return unique


class _Readers(NamedTuple):
    name: str
    first: SysfsIntReader
    current: Optional[SysfsIntReader]

    def close(self) -> None:
        self.first.close()
        if self.current is not None:
            self.current.close()


class Ina3221Backend(Backend):
    """Polled INA3221 rails from sysfs (JetPack 4 IIO and JetPack 5+ hwmon layouts)."""

    name = "ina3221"
    source = "ina3221"

    def __init__(self, root: Path = Path("/"), extras_period_s: float = 1.0) -> None:
        """Store options.

        Args:
            root: Filesystem root holding ``sys`` and ``proc``.
            extras_period_s: How often memory and temperatures are refreshed, in seconds.
        """
        self.root = Path(root)
        self._extras = SlowReadings(self.root, extras_period_s)
        self._readers: List[_Readers] = []

    @classmethod
    def probe(cls, root: Path = Path("/")) -> Optional[str]:
        """Available when at least one labelled rail can be read."""
        root = Path(root)
        if not (root / IIO_DRIVER_DIR).is_dir() and not (root / HWMON_DRIVER_DIR).is_dir():
            return (f"no INA3221 driver under /{IIO_DRIVER_DIR} or /{HWMON_DRIVER_DIR} (not a "
                    "Jetson with on-module power monitors; a Nano 2GB has none): choose another "
                    "backend")
        rails = discover_rails(root)
        if not rails:
            return (f"INA3221 driver present but no labelled rails under /{IIO_DRIVER_DIR} or "
                    f"/{HWMON_DRIVER_DIR}: check the device tree, or choose another backend")
        try:
            _open_readers(rails[0]).close()
        except OSError as error:
            return (f"INA3221 rail {rails[0].name} unreadable ({error.strerror or error}): run "
                    "odtd as a user that can read it, or choose another backend")
        return None

    def open(self) -> None:
        """Open a descriptor per rail file."""
        self.close()
        rails = discover_rails(self.root)
        if not rails:
            raise TelemetryUnavailable(
                f"ina3221: no labelled rails under {self.root / IIO_DRIVER_DIR} or "
                f"{self.root / HWMON_DRIVER_DIR}; choose another telemetry backend")
        try:
            for rail in rails:
                self._readers.append(_open_readers(rail))
        except OSError as error:
            self.close()
            raise TelemetryUnavailable(
                f"ina3221: cannot open {error.filename} ({error.strerror}); run odtd as a user "
                "that can read it, or choose another telemetry backend") from error
        logger.debug("ina3221 rails: %s", ", ".join(r.name for r in rails))

    def read(self) -> Optional[PowerSample]:
        """Read every rail once; ``OSError`` (an I2C hiccup) is a gap for the caller."""
        if not self._readers:
            raise TelemetryUnavailable("ina3221: read() before open()")
        power_mw: Dict[str, float] = {}
        for name, first, current in self._readers:
            if current is None:
                power_mw[name] = float(first.read())
            else:
                power_mw[name] = first.read() * current.read() / 1000.0  # mV x mA
        t_mono = time.monotonic()
        memory_available_mb, temps_c = self._extras.get()
        return PowerSample.from_rails(t_mono, power_mw, memory_available_mb=memory_available_mb,
                                      temps_c=temps_c)

    def close(self) -> None:
        """Close every descriptor."""
        for readers in self._readers:
            readers.close()
        self._readers = []


def _open_readers(rail: RailFiles) -> _Readers:
    first = SysfsIntReader(rail.first)
    if rail.current_ma is None:
        return _Readers(rail.name, first, None)
    try:
        return _Readers(rail.name, first, SysfsIntReader(rail.current_ma))
    except OSError:
        first.close()
        raise
