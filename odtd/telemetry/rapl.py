"""x86 RAPL energy counters through the Linux powercap framework.

Layout (https://www.kernel.org/doc/html/latest/power/powercap/powercap.html)::

    sys/class/powercap/intel-rapl:0/name                  package-0
    sys/class/powercap/intel-rapl:0/energy_uj             cumulative microjoules
    sys/class/powercap/intel-rapl:0/max_energy_range_uj   the counter wraps to 0 past this
    sys/class/powercap/intel-rapl:0:0/name                core   (inside package-0)
    sys/class/powercap/intel-rapl:0:1/name                uncore (inside package-0)
    sys/class/powercap/intel-rapl:0:2/name                dram   (beside the package)
    sys/class/powercap/intel-rapl:1/name                  psys   (the platform, overlaps all)

RAPL gives energy, not power: power is the counter delta between two reads over the time
between them, corrected for wraparound. There is no input rail, so the total is a sum, and it is
marked as one: packages plus DRAM (core and uncore are already inside a package; psys overlaps
everything and is reported on its own). Since CVE-2020-8694 (Platypus) ``energy_uj`` is readable
by root only on most distributions.
"""

import logging
import re
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

from odtd.errors import TelemetryUnavailable
from odtd.telemetry.base import (
    Backend,
    PowerSample,
    SlowReadings,
    SysfsIntReader,
    read_int_file,
    read_text_file,
)

logger = logging.getLogger(__name__)

POWERCAP_DIR = Path("sys/class/powercap")
_ZONE_RE = re.compile(r"^intel-rapl:(\d+)(?::(\d+))?$")


class RaplZone(NamedTuple):
    """One powercap zone.

    Attributes:
        rail: Rail name, e.g. ``package-0`` or ``package-0/dram``.
        path: Zone directory.
        max_energy_range_uj: Where the counter wraps, in microjoules.
        in_total: Whether the zone is part of the summed total.
    """

    rail: str
    path: Path
    max_energy_range_uj: int
    in_total: bool


def discover_zones(root: Path) -> List[RaplZone]:
    """Find the RAPL zones under ``root`` and name them (``OSError`` if a name is unreadable)."""
    names: Dict[str, str] = {}
    found = []
    for path in sorted((root / POWERCAP_DIR).glob("intel-rapl:*")):
        match = _ZONE_RE.match(path.name)
        if match:
            names[path.name] = read_text_file(path / "name")
            found.append((path, match.group(1), match.group(2)))
    zones = []
    for path, parent, child in found:
        name = names[path.name]
        if child is None:
            rail, in_total = name, name.startswith("package")
        else:
            parent_name = names.get(f"intel-rapl:{parent}", f"intel-rapl:{parent}")
            rail, in_total = f"{parent_name}/{name}", name == "dram"
        zones.append(RaplZone(rail, path, read_int_file(path / "max_energy_range_uj"), in_total))
    return zones


class RaplBackend(Backend):
    """Polled RAPL counters; each sample's power is the average since the previous read."""

    name = "rapl"
    source = "rapl"

    def __init__(self, root: Path = Path("/"), extras_period_s: float = 1.0) -> None:
        """Store options.

        Args:
            root: Filesystem root holding ``sys`` and ``proc``.
            extras_period_s: How often memory and temperatures are refreshed, in seconds.
        """
        self.root = Path(root)
        self._extras = SlowReadings(self.root, extras_period_s)
        self._zones: List[RaplZone] = []
        self._readers: List[SysfsIntReader] = []
        self._last_uj: List[int] = []
        self._last_t = 0.0

    @classmethod
    def probe(cls, root: Path = Path("/")) -> Optional[str]:
        """Available when a package zone's counter can be read."""
        try:
            zones = discover_zones(Path(root))
        except (OSError, ValueError) as error:
            return f"RAPL zones unreadable ({error}): choose another backend"
        if not zones:
            return (f"no RAPL zones under /{POWERCAP_DIR} (not x86, or the intel_rapl driver is "
                    "not loaded: modprobe intel_rapl_msr)")
        try:
            read_int_file(zones[0].path / "energy_uj")
        except OSError as error:
            return (f"RAPL energy_uj not readable ({error.strerror or error}; root-only since "
                    "CVE-2020-8694): run odtd as root or grant read access with a udev rule")
        return None

    def open(self) -> None:
        """Open the counters and take the baseline reading."""
        self.close()
        try:
            self._zones = discover_zones(self.root)
            self._readers = [SysfsIntReader(zone.path / "energy_uj") for zone in self._zones]
            self._last_uj = [reader.read() for reader in self._readers]
        except (OSError, ValueError) as error:
            self.close()
            raise TelemetryUnavailable(
                f"rapl: cannot read {self.root / POWERCAP_DIR} ({error}); run odtd as root or "
                "grant read access to energy_uj with a udev rule") from error
        if not self._zones:
            raise TelemetryUnavailable(f"rapl: no zones under {self.root / POWERCAP_DIR}; "
                                       "choose another telemetry backend")
        self._last_t = time.monotonic()

    def read(self) -> Optional[PowerSample]:
        """Return mean power per zone since the previous read (None if no time has passed)."""
        if not self._readers:
            raise TelemetryUnavailable("rapl: read() before open()")
        counters_uj = [reader.read() for reader in self._readers]
        t_mono = time.monotonic()
        elapsed_s = t_mono - self._last_t
        if elapsed_s <= 0:
            return None
        power_mw: Dict[str, float] = {}
        for zone, now_uj, last_uj in zip(self._zones, counters_uj, self._last_uj):
            delta_uj = now_uj - last_uj
            if delta_uj < 0:
                delta_uj += zone.max_energy_range_uj  # The counter wrapped past its range.
            power_mw[zone.rail] = delta_uj / elapsed_s / 1000.0  # uJ/s is uW
        self._last_uj = counters_uj
        self._last_t = t_mono
        memory_available_mb, temps_c = self._extras.get()
        return PowerSample.from_rails(
            t_mono, power_mw, summed_rails=[z.rail for z in self._zones if z.in_total],
            memory_available_mb=memory_available_mb, temps_c=temps_c)

    def close(self) -> None:
        """Close the counters."""
        for reader in self._readers:
            reader.close()
        self._readers = []
