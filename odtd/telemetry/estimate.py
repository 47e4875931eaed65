"""A power *model* from CPU utilisation, for machines with no meter. Never a measurement.

``power_w = idle_w + (max_w - idle_w) * utilisation``, with utilisation the busy share of all
CPU time in ``/proc/stat`` (user, nice, system, irq, softirq, steal; not idle or iowait) over a
trailing window of at least ``window_s``. ``/proc/stat`` counts in USER_HZ ticks (1/100 s), so
a shorter window would only see quantisation noise; between window updates the last figure holds.

Defaults approximate a Jetson TX2 module: about 1.9 W idle on VDD_IN (the idle tegrastats lines
of the test fixtures read 1.4-2.1 W) and 15 W at the top of its MAX-N power mode. They are
options because any other machine needs its own: set ``idle_w`` and ``max_w`` from a meter.
Every figure made from this backend carries ``source = "estimate"``.
"""

import logging
import time
from pathlib import Path
from typing import Optional, Tuple

from odtd.errors import TelemetryUnavailable
from odtd.telemetry.base import Backend, PowerSample, SlowReadings

logger = logging.getLogger(__name__)

RAIL = "estimated_board"


def read_cpu_ticks(root: Path) -> Tuple[int, int]:
    """Return ``(busy_ticks, total_ticks)`` from the aggregate ``cpu`` line of /proc/stat."""
    with open(root / "proc" / "stat", "rb") as handle:
        fields = handle.readline().split()
    if not fields or fields[0] != b"cpu" or len(fields) < 5:
        raise ValueError(f"unexpected first line of {root / 'proc' / 'stat'}")
    # user nice system idle iowait irq softirq steal; guest time is already inside user/nice.
    ticks = [int(value) for value in fields[1:9]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    total = sum(ticks)
    return total - idle, total


class EstimateBackend(Backend):
    """Board power modelled from CPU utilisation; source always ``estimate``."""

    name = "estimate"
    source = "estimate"

    def __init__(self, root: Path = Path("/"), idle_w: float = 1.9, max_w: float = 15.0,
                 window_s: float = 0.1, extras_period_s: float = 1.0) -> None:
        """Store the model parameters.

        Args:
            root: Filesystem root holding ``proc``.
            idle_w: Modelled power at 0% CPU, in watts.
            max_w: Modelled power at 100% CPU, in watts.
            window_s: Shortest utilisation window, in seconds.
            extras_period_s: How often memory and temperatures are refreshed, in seconds.
        """
        if not 0 <= idle_w <= max_w:
            raise ValueError(f"need 0 <= idle_w <= max_w, got idle_w={idle_w!r} max_w={max_w!r}")
        self.root = Path(root)
        self.idle_w = idle_w
        self.max_w = max_w
        self.window_s = window_s
        self._extras = SlowReadings(self.root, extras_period_s)
        self._reference: Optional[Tuple[float, int, int]] = None
        self.utilisation = 0.0

    @classmethod
    def probe(cls, root: Path = Path("/")) -> Optional[str]:
        """Available wherever /proc/stat can be read."""
        try:
            read_cpu_ticks(Path(root))
        except (OSError, ValueError) as error:
            return f"cannot read /proc/stat ({error}): not Linux, or /proc not mounted"
        return None

    def open(self) -> None:
        """Take the reference tick counts."""
        try:
            busy, total = read_cpu_ticks(self.root)
        except (OSError, ValueError) as error:
            raise TelemetryUnavailable(f"estimate: cannot read {self.root / 'proc' / 'stat'} "
                                       f"({error}); mount /proc") from error
        self._reference = (time.monotonic(), busy, total)
        self.utilisation = 0.0

    def read(self) -> Optional[PowerSample]:
        """Return the modelled power now."""
        if self._reference is None:
            raise TelemetryUnavailable("estimate: read() before open()")
        t_ref, busy_ref, total_ref = self._reference
        now = time.monotonic()
        if now - t_ref >= self.window_s:
            busy, total = read_cpu_ticks(self.root)
            if total > total_ref:
                self.utilisation = min(1.0, max(0.0, (busy - busy_ref) / (total - total_ref)))
                self._reference = (now, busy, total)
        power_mw = 1000.0 * (self.idle_w + (self.max_w - self.idle_w) * self.utilisation)
        memory_available_mb, temps_c = self._extras.get()
        return PowerSample(time.monotonic(), {RAIL: power_mw}, power_mw, RAIL, False,
                           memory_available_mb, temps_c)

    def close(self) -> None:
        """Forget the reference."""
        self._reference = None
