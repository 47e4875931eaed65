"""The telemetry backend contract and the one value every backend produces.

A backend turns one hardware or software source (jtop, INA3221 sysfs, tegrastats lines, RAPL
counters, a CPU model, a recording) into :class:`PowerSample` values. Raw keys never leave the
backend: past this package there are only rails in milliwatts, a board total, and a note saying
whether that total is a real input rail or a sum.
"""

import abc
import logging
import os
import time
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar, Dict, Iterable, Mapping, NamedTuple, Optional, Tuple

logger = logging.getLogger(__name__)

#: Rails that measure the whole module's input, in order of preference. The sub-rails of a
#: board (VDD_SYS_GPU, VDD_SYS_CPU, ...) are parts of these and never add to the total.
#: VDD_IN: TX1, TX2, TX2 NX, Xavier NX, Orin NX/Nano; POM_5V_IN: Nano on JetPack 4
#: (https://github.com/rbonghi/jetson_stats/issues/51); VIN: Thor's INA238 carrier rail
#: (https://github.com/rbonghi/jetson_stats/pull/900).
INPUT_RAIL_NAMES: Tuple[str, ...] = ("VDD_IN", "POM_5V_IN", "VIN")

EMPTY_TEMPS: Mapping[str, float] = MappingProxyType({})


class PowerSample(NamedTuple):
    """One reading of every rail a backend sees, taken at one moment. Immutable.

    A NamedTuple rather than a frozen dataclass: the same named, read-only fields, but about a
    quarter of the construction cost, which counts on the sampler's 10 ms path.

    Attributes:
        t_mono: ``time.monotonic()`` right after the value was read (for a stream, when its
            line arrived). CLOCK_MONOTONIC is shared by all processes on the machine, so worker
            step spans can be joined with it.
        power_mw: Instantaneous power per rail in milliwatts (never a running average).
        total_power_mw: Board total in milliwatts, or None when the backend has no total.
        total_rail: Name of the input rail the total is, or None when the total is a sum.
        total_is_sum: True when no input rail exists and the total is a sum of parts.
        memory_available_mb: Memory available to new allocations in MB, when known.
        temps_c: Temperatures in degrees Celsius by sensor name, when known.
    """

    t_mono: float
    power_mw: Mapping[str, float]
    total_power_mw: Optional[float]
    total_rail: Optional[str]
    total_is_sum: bool
    memory_available_mb: Optional[float] = None
    temps_c: Mapping[str, float] = EMPTY_TEMPS

    @classmethod
    def from_rails(
        cls,
        t_mono: float,
        power_mw: Mapping[str, float],
        summed_rails: Optional[Iterable[str]] = None,
        memory_available_mb: Optional[float] = None,
        temps_c: Optional[Mapping[str, float]] = None,
    ) -> "PowerSample":
        """Build a sample, choosing the board total the one right way.

        The total is the first input rail of :data:`INPUT_RAIL_NAMES` present in ``power_mw``.
        Only when none exists is it a sum (of ``summed_rails``, default every rail), marked so.

        Args:
            t_mono: Monotonic time of the reading in seconds.
            power_mw: Power per rail in milliwatts.
            summed_rails: Rails whose sum is the total when there is no input rail (a backend
                whose rails nest, like RAPL's core inside package, names the outer ones).
            memory_available_mb: Memory available in MB, if known.
            temps_c: Temperatures by sensor in degrees Celsius, if known.

        Returns:
            The sample.
        """
        for rail in INPUT_RAIL_NAMES:
            if rail in power_mw:
                return cls(t_mono, power_mw, float(power_mw[rail]), rail, False,
                           memory_available_mb, temps_c or EMPTY_TEMPS)
        parts = list(power_mw) if summed_rails is None else list(summed_rails)
        total = float(sum(power_mw[r] for r in parts if r in power_mw)) if parts else None
        return cls(t_mono, power_mw, total, None, total is not None,
                   memory_available_mb, temps_c or EMPTY_TEMPS)


class Backend(abc.ABC):
    """A source of :class:`PowerSample` values; one subclass per module.

    Contract:
        * ``name`` is the registry key; ``source`` labels every energy figure made from it.
        * ``probe(root)`` is cheap, opens nothing for long, and never raises: None means the
          backend can run here, otherwise it returns one line saying why not and the fix.
        * The constructor only stores options (hardware paths live under ``root``);
          ``open()`` acquires resources and raises ``TelemetryUnavailable`` with the fix.
        * ``read()`` returns one sample, or None when there is nothing new. None, ``OSError``,
          ``ValueError`` and ``TelemetryUnavailable`` are gaps for the caller, not crashes.
        * ``nominal_interval_s`` is None for polled backends (the sampler sets the pace). A
          backend with its own cadence (a stream) sets it, and its ``read()`` blocks until the
          next sample or about three intervals, whichever comes first.
        * ``close()`` is idempotent. Backends are context managers (open on enter).
        * ``measures_energy`` is False only for the ``none`` backend.
    """

    name: ClassVar[str] = ""
    source: ClassVar[str] = ""
    measures_energy: ClassVar[bool] = True
    nominal_interval_s: Optional[float] = None

    @classmethod
    @abc.abstractmethod
    def probe(cls, root: Path = Path("/")) -> Optional[str]:
        """Say whether this backend can run under ``root``.

        Args:
            root: Filesystem root holding ``sys`` and ``proc`` (a fake board tree in tests).

        Returns:
            None when available, else a one-line reason naming the fix.
        """

    @abc.abstractmethod
    def open(self) -> None:
        """Acquire files, clients or child processes.

        Raises:
            TelemetryUnavailable: The source cannot be used; the message names the fix.
        """

    @abc.abstractmethod
    def read(self) -> Optional[PowerSample]:
        """Return the next sample, or None when there is none (a gap)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most backends override it
        """Release what ``open()`` acquired; safe to call twice."""

    def __enter__(self) -> "Backend":
        """Open the backend."""
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the backend."""
        self.close()


def read_int_file(path: Path) -> int:
    """Read a sysfs attribute holding one integer (``OSError``/``ValueError`` on failure)."""
    with open(path, "rb") as handle:
        return int(handle.read().split()[0])


def read_text_file(path: Path) -> str:
    """Read a small text attribute, stripped."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read().strip()


class SysfsIntReader:
    """Re-read one integer attribute through a file descriptor kept open.

    ``pread`` at offset 0 makes sysfs regenerate the value, which costs a fraction of an
    ``open``/``read``/``close`` round trip: it matters at 100 reads per second.
    """

    def __init__(self, path: Path) -> None:
        """Open ``path`` read-only (``OSError`` when missing or not readable)."""
        self.path = path
        self._fd: Optional[int] = os.open(str(path), os.O_RDONLY)

    def read(self) -> int:
        """Return the current value."""
        if self._fd is None:
            raise OSError(f"closed: {self.path}")
        return int(os.pread(self._fd, 64, 0).split()[0])

    def close(self) -> None:
        """Close the descriptor."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_memory_available_mb(root: Path) -> Optional[float]:
    """Return ``MemAvailable`` from ``root/proc/meminfo`` in MB, or None if unreadable."""
    try:
        with open(root / "proc" / "meminfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError) as error:
        logger.debug("meminfo unreadable under %s: %s", root, error)
    return None


def read_thermal_zones_c(root: Path) -> Dict[str, float]:
    """Return thermal zone temperatures (sysfs millidegrees) in degrees Celsius by zone type."""
    temps: Dict[str, float] = {}
    for zone in sorted((root / "sys" / "class" / "thermal").glob("thermal_zone*")):
        try:
            temps[read_text_file(zone / "type")] = read_int_file(zone / "temp") / 1000.0
        except (OSError, ValueError, IndexError) as error:
            # Some zones (e.g. TX2's PMIC-Die) refuse reads or report placeholders.
            logger.debug("thermal zone %s unreadable: %s", zone, error)
    return temps


class SlowReadings:
    """Memory and temperatures, refreshed at most every ``period_s`` and cached in between.

    Neither changes meaningfully in 10 ms, and reading a dozen thermal zones per power sample
    would cost more than the power reading itself.
    """

    def __init__(self, root: Path, period_s: float = 1.0) -> None:
        """Prepare to read under ``root`` at most every ``period_s`` seconds."""
        self.root = root
        self.period_s = period_s
        self._next_s = 0.0
        self._memory_available_mb: Optional[float] = None
        self._temps_c: Mapping[str, float] = EMPTY_TEMPS

    def get(self) -> Tuple[Optional[float], Mapping[str, float]]:
        """Return ``(memory_available_mb, temps_c)``, refreshing when due."""
        now = time.monotonic()
        if now >= self._next_s:
            self._next_s = now + self.period_s
            self._memory_available_mb = read_memory_available_mb(self.root)
            self._temps_c = read_thermal_zones_c(self.root)
        return self._memory_available_mb, self._temps_c

