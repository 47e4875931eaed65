"""Gates: the conditions under which a session may start, and may go on.

Each gate reads plain files under an injectable ``root`` (a fake board tree in tests):

* ``charging`` (``require_charging``) and ``battery`` (``min_battery_pct``):
  ``sys/class/power_supply/*/``: ``type`` Battery (``capacity``, ``status``), Mains or USB
  (``online``). A board without a battery (a Jetson devkit) passes both with "no battery".
* ``temperature`` (``max_temp_c``): the hottest ``sys/class/thermal/thermal_zone*/temp``
  (millidegrees), named by the zone's ``type``.
* ``load`` (``max_system_load``): ``proc/loadavg`` (1 minute) divided by the online CPUs.
* ``idle`` (``min_idle_s``): seconds since the newest atime/mtime of ``dev/input/event*``;
  unknown (no input devices, e.g. a headless board) passes with a note. On a ``relatime`` mount
  the atime of a device read moves at most once a day, so this sees less input than there is.
* ``window``: local time inside ``gates.window`` ("01:00-06:00"; may wrap midnight).

Before the gates, ``samples_wanted``: how many new samples a session waits for
(``schedule.min_new_samples``; after a refused session, ``schedule.backoff`` times what it trained
on).

Forcing a gate closed, for demos and tests of the stop path: write gate names, one per line, to
``ODTD_HOME/run/force-gate-closed`` (``FORCE_CLOSED_FILE``). The checks read it like any other
input, at start and every ``check_interval_s`` while a session runs; delete it to reopen.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from odtd.policy import GatesPolicy, SchedulePolicy, parse_window
from odtd.store.records import SessionRecord

logger = logging.getLogger(__name__)

GATE_NAMES = ("charging", "battery", "temperature", "load", "idle", "window")
FORCE_CLOSED_FILE = "force-gate-closed"
# Zones whose reading is a placeholder: PMIC-Die reads a constant 100 C on Jetson TX1/TX2/Nano/
# Xavier (https://forums.developer.nvidia.com/t/thermal-zone4-reports-100-degree-celcius/44422).
IGNORED_THERMAL_ZONES = frozenset({"PMIC-Die"})
# Below this a zone is off, not cold: Orin's gpu-thermal reads -256 C while the GPU is gated.
MIN_VALID_TEMP_C = -40.0
_EXTERNAL_SUPPLY_TYPES = ("Mains", "USB", "USB_C", "USB_PD", "Wireless")


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict.

    Attributes:
        name: One of ``GATE_NAMES``.
        passed: Whether the gate is open.
        value: The reading (percent, degrees C, load per core, seconds, "HH:MM"), None if unknown.
        reason: One line: the reading against the limit, or why it is unknown.
    """

    name: str
    passed: bool
    value: Any
    reason: str


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError as exc:
        logger.debug("cannot read %s: %s", path, exc)
        return None


def read_power_supplies(root: Path) -> Tuple[List[Tuple[str, Optional[float], str]], List[str]]:
    """Return (batteries as (name, capacity percent or None, status), online external supplies).

    Peripheral batteries (``scope`` Device: a wireless mouse) are not the board's and are skipped.
    """
    batteries, online = [], []
    for supply in sorted((root / "sys/class/power_supply").glob("*")):
        kind = _read(supply / "type")
        if kind == "Battery" and _read(supply / "scope") != "Device":
            capacity = _read(supply / "capacity")
            pct = float(capacity) if capacity and capacity.lstrip("-").isdigit() else None
            batteries.append((supply.name, pct, _read(supply / "status") or "Unknown"))
        elif kind in _EXTERNAL_SUPPLY_TYPES and _read(supply / "online") == "1":
            online.append(supply.name)
    return batteries, online


def read_temperatures(root: Path) -> Dict[str, float]:
    """Return valid zone temperatures in degrees C by zone type (the zone's name if untyped)."""
    temps: Dict[str, float] = {}
    for zone in sorted((root / "sys/class/thermal").glob("thermal_zone*")):
        name = _read(zone / "type") or zone.name
        raw = _read(zone / "temp")
        if name in IGNORED_THERMAL_ZONES or raw is None or not raw.lstrip("-").isdigit():
            continue
        celsius = int(raw) / 1000.0
        if celsius > MIN_VALID_TEMP_C:
            temps[name if name not in temps else f"{name} ({zone.name})"] = celsius
    return temps


def read_cpu_count(root: Path) -> int:
    """Count online CPUs from ``sys/devices/system/cpu/online`` ("0-5"), else os.cpu_count()."""
    text = _read(root / "sys/devices/system/cpu/online")
    if text:
        try:
            count = 0
            for part in text.split(","):
                low, _, high = part.partition("-")
                count += int(high or low) - int(low) + 1
            return count
        except ValueError:
            logger.debug("unexpected cpu/online %r; using os.cpu_count()", text)
    return os.cpu_count() or 1


def read_load_1min(root: Path) -> Optional[float]:
    """The 1-minute load average from ``proc/loadavg``, or None."""
    text = _read(root / "proc/loadavg")
    try:
        return float(text.split()[0]) if text else None
    except ValueError:
        logger.debug("unexpected loadavg %r", text)
        return None


def read_idle_s(root: Path, now_s: float) -> Optional[float]:
    """Seconds since the last input event (newest atime/mtime of dev/input/event*), or None."""
    newest = None
    for path in glob.glob(str(root / "dev/input/event*")):
        try:
            info = os.stat(path)
        except OSError as exc:
            logger.debug("cannot stat %s: %s", path, exc)
            continue
        newest = max(newest or 0.0, info.st_atime, info.st_mtime)
    return None if newest is None else max(0.0, now_s - newest)


def read_forced(force_file: Optional[Path]) -> List[str]:
    """Gate names listed in the force file (one per line, # comments), [] when it is absent."""
    if force_file is None or not force_file.exists():
        return []
    text = _read(force_file) or ""
    return [line.split("#")[0].strip() for line in text.splitlines()
            if line.split("#")[0].strip()]


def in_window(window: str, minute_of_day: int) -> bool:
    """Whether a minute after midnight lies in "HH:MM-HH:MM" (start inclusive, may wrap)."""
    start, end = parse_window(window)
    if start < end:
        return start <= minute_of_day < end
    return minute_of_day >= start or minute_of_day < end


def check_gates(gates: GatesPolicy, root: Path = Path("/"), now: Optional[datetime] = None,
                force_file: Optional[Path] = None) -> List[GateResult]:
    """Check every configured gate, plus any forced closed, in ``GATE_NAMES`` order.

    Args:
        gates: The policy's gates (a gate whose setting is null is not checked).
        root: Filesystem root holding ``sys``, ``proc`` and ``dev``.
        now: Local time (default: now); idle time compares it with file times.
        force_file: ``ODTD_HOME/run/force-gate-closed``, or None.
    """
    root, now = Path(root), now or datetime.now()
    results: Dict[str, GateResult] = {}
    if gates.require_charging or gates.min_battery_pct is not None:
        batteries, online = read_power_supplies(root)
        if gates.require_charging:
            results["charging"] = _charging(batteries, online)
        if gates.min_battery_pct is not None:
            results["battery"] = _battery(batteries, gates.min_battery_pct)
    if gates.max_temp_c is not None:
        temps = read_temperatures(root)
        if not temps:
            results["temperature"] = GateResult("temperature", True, None, "no thermal zones")
        else:
            zone, hottest = max(temps.items(), key=lambda item: item[1])
            results["temperature"] = GateResult(
                "temperature", hottest <= gates.max_temp_c, hottest,
                f"{zone} {hottest:.1f} C {'<=' if hottest <= gates.max_temp_c else '>'} "
                f"{gates.max_temp_c:g} C")
    if gates.max_system_load is not None:
        load = read_load_1min(root)
        if load is None:
            results["load"] = GateResult("load", True, None, "load unknown (no /proc/loadavg)")
        else:
            cpus = read_cpu_count(root)
            per_core = load / cpus
            ok = per_core <= gates.max_system_load
            results["load"] = GateResult(
                "load", ok, round(per_core, 3), f"load {per_core:.2f} per core ({cpus} CPUs) "
                f"{'<=' if ok else '>'} {gates.max_system_load:g}")
    if gates.min_idle_s is not None:
        idle_s = read_idle_s(root, now.timestamp())
        if idle_s is None:
            results["idle"] = GateResult("idle", True, None,
                                         "idle time unknown (no dev/input/event*): not checked")
        else:
            ok = idle_s >= gates.min_idle_s
            results["idle"] = GateResult("idle", ok, round(idle_s, 1), f"last input "
                                         f"{idle_s:.0f} s ago {'>=' if ok else '<'} "
                                         f"{gates.min_idle_s:g} s")
    if gates.window is not None:
        ok = in_window(gates.window, now.hour * 60 + now.minute)
        results["window"] = GateResult("window", ok, now.strftime("%H:%M"), f"{now:%H:%M} "
                                       f"{'inside' if ok else 'outside'} {gates.window}")
    for name in read_forced(force_file):
        if name in GATE_NAMES:
            reading = results.get(name)
            results[name] = GateResult(name, False, reading.value if reading else None,
                                       f"forced closed by {force_file}"
                                       + (f" (reading: {reading.reason})" if reading else ""))
        else:
            results[name] = GateResult(name, False, None, f"unknown gate {name!r} in "
                                       f"{force_file}; known: {', '.join(GATE_NAMES)}")
    order = {name: index for index, name in enumerate(GATE_NAMES)}
    return sorted(results.values(), key=lambda r: order.get(r.name, len(order)))


def _charging(batteries: List[Tuple[str, Optional[float], str]], online: List[str]
              ) -> GateResult:
    if not batteries:
        return GateResult("charging", True, None, "no battery")
    if online:
        return GateResult("charging", True, True, f"on external power ({', '.join(online)})")
    charging = [name for name, _, status in batteries if status in ("Charging", "Full")]
    if charging:
        return GateResult("charging", True, True, f"{charging[0]} charging")
    name, _, status = batteries[0]
    return GateResult("charging", False, False, f"on battery ({name} {status})")


def _battery(batteries: List[Tuple[str, Optional[float], str]], min_pct: float) -> GateResult:
    known = [(name, pct) for name, pct, _ in batteries if pct is not None]
    if not batteries:
        return GateResult("battery", True, None, "no battery")
    if not known:
        return GateResult("battery", True, None, "battery level unknown (no capacity file)")
    name, pct = min(known, key=lambda item: item[1])
    ok = pct >= min_pct
    return GateResult("battery", ok, pct, f"{name} {pct:g}% {'>=' if ok else '<'} {min_pct:g}%")


class StopRequest(threading.Event):
    """A request that a running session stop at its next step boundary, and why.

    Set by a closing gate (``GateMonitor``), a signal to a foreground session, or the daemon
    shutting down; the first reason given is the one recorded.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reason: Optional[str] = None

    def request(self, reason: str) -> None:
        """Ask for the stop (a second request keeps the first reason)."""
        if not self.is_set():
            self.reason = reason
            self.set()


class GateMonitor:
    """Re-checks the gates every ``check_interval_s`` in a thread while a session runs.

    When a gate closes it requests a stop with the reason ``gate NAME closed: ...``;
    the session runner then stops the worker at its next step boundary (outcome interrupted).
    It checks once at ``start()`` too. Use it as a context manager around the session.

    Args:
        gates: The policy's gates.
        stop: The session's stop event.
        root: Filesystem root for the readings.
        clock: Returns local time (injectable for tests).
        force_file: ``ODTD_HOME/run/force-gate-closed``.
    """

    def __init__(self, gates: GatesPolicy, stop: StopRequest, root: Path = Path("/"),
                 clock: Callable[[], datetime] = datetime.now,
                 force_file: Optional[Path] = None) -> None:
        self.gates, self.stop, self.root = gates, stop, Path(root)
        self.clock, self.force_file = clock, force_file
        self.closed: Optional[GateResult] = None
        self._halt = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start the monitoring thread."""
        self._halt.clear()
        self._thread = threading.Thread(target=self._run, name="odtd-gates", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and wait for it."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> GateMonitor:
        """Start monitoring."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop monitoring."""
        self.close()

    def _run(self) -> None:
        while not self._halt.is_set() and not self.stop.is_set():
            try:
                failed = [r for r in check_gates(self.gates, self.root, self.clock(),
                                                 self.force_file) if not r.passed]
            except Exception as exc:  # an unguarded session must not go on
                logger.exception("gate check failed")
                failed = [GateResult("monitor", False, None, f"gate check failed: {exc!r}")]
            if failed:
                self.closed = failed[0]
                self.stop.request(f"gate {failed[0].name} closed: {failed[0].reason}")
                logger.info("%s", self.stop.reason)
                return
            self._halt.wait(self.gates.check_interval_s)


def samples_wanted(schedule: SchedulePolicy, last: Optional[SessionRecord], cap: int) -> int:
    """How many new samples the next session waits for.

    ``last`` is the latest session whose candidate was judged (``Store.last_judged_session``).
    After a refusal the next session waits for ``backoff`` times the new samples the refused one
    trained on, so refusals in a row space sessions out geometrically at any daily volume;
    never fewer than ``min_new_samples``, never more than ``cap`` (the most a session takes: it
    must be able to start).
    """
    wanted = schedule.min_new_samples
    if last is not None and last.outcome == "rolled_back" and schedule.backoff > 1:
        wanted = max(wanted, math.ceil(schedule.backoff * (last.samples_new or 0)))
    return min(cap, wanted)
