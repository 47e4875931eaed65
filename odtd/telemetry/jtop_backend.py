"""jetson-stats (jtop) client: the root service reads the rails, this process asks it.

``jtop`` is imported here only, and only in ``open()``. Two shapes of ``jetson.power`` exist:

* Legacy tuple, ``total, rails = jetson.power``: rail dicts hold ``cur`` and ``avg`` and rail
  names lose their prefix (``VDD_IN`` becomes ``IN``, ``VDD_SYS_GPU`` becomes ``SYS GPU``).
  Its ``total`` is the *sum of every rail* unless the board has ``POM_5V_IN`` (jetson-stats
  ``jtop/service.py`` ``_total_power``), so on a TX2 it adds VDD_IN to its own parts; this
  backend ignores that total and uses the input rail.
* ``{"rail": {...}, "tot": {...}}`` (jetson-stats 4.2+, ``jtop/core/power.py``): the input rail
  is moved out of ``rail`` into ``tot`` with its ``name``; without an input rail ``tot`` is the
  sum and has no ``name``. Rail dicts hold ``power``, ``avg``, ``volt``, ``curr``, ``warn``, ...

The instantaneous value (``power`` or ``cur``) is used, never ``avg``.
"""

import importlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from odtd.errors import TelemetryUnavailable
from odtd.telemetry.base import INPUT_RAIL_NAMES, Backend, PowerSample

logger = logging.getLogger(__name__)

SOCKET_PATH = Path("run/jtop.sock")
_FIX = ("start the service with `sudo systemctl start jtop`, and make sure this user is in the "
        "`jtop` group (`sudo usermod -aG jtop $USER`, then log in again)")
# Names the legacy layout gives input rails after stripping VDD_/POM_ and underscores.
_LEGACY_INPUT_NAMES = {"IN": "VDD_IN", "5V IN": "POM_5V_IN", "VDD_IN": "VDD_IN",
                       "POM_5V_IN": "POM_5V_IN", "VIN": "VIN"}


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _instant_mw(rail: Mapping[str, Any]) -> float:
    value = rail.get("power", rail.get("cur"))
    if value is None:
        raise ValueError(f"jtop rail without 'power' or 'cur': {sorted(rail)!r}")
    return float(value)


def normalise_power(power: Any) -> Tuple[Dict[str, float], Optional[float], Optional[str], bool]:
    """Turn either jtop power layout into rails, total, total rail and the is-a-sum flag.

    Args:
        power: ``jetson.power`` as returned by the client.

    Returns:
        ``(power_mw, total_power_mw, total_rail, total_is_sum)``.

    Raises:
        ValueError: The value has neither known layout.
    """
    if isinstance(power, Mapping) and "rail" in power:
        rails = {name: _instant_mw(rail) for name, rail in power["rail"].items()}
        tot = power.get("tot") or {}
        name = tot.get("name")
        if name:
            rails[name] = _instant_mw(tot)
            return rails, rails[name], name, False
        return _from_rails(rails)
    if isinstance(power, (tuple, list)) and len(power) == 2:
        total, raw_rails = power
        rails = {}
        for name, rail in raw_rails.items():
            rails[_LEGACY_INPUT_NAMES.get(name, name)] = _instant_mw(rail)
        if not any(name in rails for name in INPUT_RAIL_NAMES) and total:
            total_mw = _instant_mw(total)
            named = total.get("name")
            if named or abs(total_mw - sum(rails.values())) > 1.0:
                # The service popped the input rail out of the list (only POM_5V_IN, in 3.x).
                rails[named or "POM_5V_IN"] = total_mw
        return _from_rails(rails)
    raise ValueError(f"unknown jtop power layout: {type(power).__name__!r}")


def _from_rails(rails: Dict[str, float]) -> Tuple[Dict[str, float], Optional[float],
                                                   Optional[str], bool]:
    sample = PowerSample.from_rails(0.0, rails)
    return rails, sample.total_power_mw, sample.total_rail, sample.total_is_sum


def _memory_available_mb(client: Any) -> Optional[float]:
    try:
        ram = client.memory["RAM"]  # jetson-stats 4.x: kB
        return (float(ram["tot"]) - float(ram["used"])) / 1024.0
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        logger.debug("jtop memory unavailable: %s", error)
        return None


def _temps_c(client: Any) -> Dict[str, float]:
    temps: Dict[str, float] = {}
    try:
        for name, value in dict(client.temperature).items():
            if isinstance(value, Mapping):  # 4.x: {"temp": 41.5, "online": True}
                if value.get("online", True) and value.get("temp") is not None:
                    temps[name] = float(value["temp"])
            else:
                temps[name] = float(value)
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        logger.debug("jtop temperatures unavailable: %s", error)
    return temps


class JtopBackend(Backend):
    """Rails from the jetson-stats service, at the client's own cadence."""

    name = "jtop"
    source = "jtop"

    def __init__(self, root: Path = Path("/"), interval_s: float = 0.1) -> None:
        """Store options.

        Args:
            root: Filesystem root holding ``run/jtop.sock``.
            interval_s: Update interval asked of the jtop service, in seconds.
        """
        self.root = Path(root)
        self.nominal_interval_s = float(interval_s)
        self._client: Any = None
        self._errors: Tuple[type, ...] = (OSError, EOFError)

    @classmethod
    def probe(cls, root: Path = Path("/")) -> Optional[str]:
        """Available when jetson-stats is importable and its socket is there and ours to use."""
        if "jtop" not in sys.modules and importlib.util.find_spec("jtop") is None:
            return "jetson-stats not installed: sudo pip3 install -U jetson-stats, then reboot"
        socket = Path(root) / SOCKET_PATH
        if not socket.exists():
            return f"jtop service not running (no /{SOCKET_PATH}): sudo systemctl start jtop"
        if not os.access(str(socket), os.R_OK | os.W_OK):
            return (f"no permission on /{SOCKET_PATH}: sudo usermod -aG jtop $USER, then log in "
                    "again")
        return None

    def open(self) -> None:
        """Connect to the jtop service."""
        self.close()
        try:
            module = importlib.import_module("jtop")
        except ImportError as error:
            raise TelemetryUnavailable(
                f"jtop: jetson-stats is not installed ({error}); "
                "sudo pip3 install -U jetson-stats") from error
        self._errors = (OSError, EOFError, getattr(module, "JtopException", OSError))
        client = module.jtop(interval=self.nominal_interval_s)
        try:
            client.start()
        except self._errors as error:
            raise TelemetryUnavailable("jtop: cannot connect to the jetson-stats service "
                                       f"({_one_line(error)}); {_FIX}") from error
        self._client = client

    def read(self) -> Optional[PowerSample]:
        """Wait for the service's next update and return it."""
        client = self._client
        if client is None:
            raise TelemetryUnavailable("jtop: read() before open()")
        try:
            # ok() blocks until the service's next update; False means the client gave up
            # after three intervals without one and has stopped for good.
            if not client.ok():
                raise TelemetryUnavailable(
                    f"jtop: no update from the jetson-stats service in time; {_FIX}")
            power = client.power
        except self._errors as error:
            raise TelemetryUnavailable(
                f"jtop: lost the jetson-stats service ({_one_line(error)}); {_FIX}") from error
        t_mono = time.monotonic()
        power_mw, total_mw, total_rail, total_is_sum = normalise_power(power)
        return PowerSample(t_mono, power_mw, total_mw, total_rail, total_is_sum,
                           _memory_available_mb(client), _temps_c(client))

    def close(self) -> None:
        """Disconnect from the service."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except self._errors as error:
                logger.debug("jtop close failed: %s", error)
