"""tegrastats as a child process, and a pure parser for its lines (live or from saved logs).

Line formats read (rails are ``NAME cur/avg``; the first value is the instantaneous one):

* JetPack 4 (L4T R32), TX2: no unit, no timestamp::

      RAM 2344/7852MB (lfb 1154x4MB) SWAP 0/3926MB (cached 0MB) CPU [1%@345,off,off,...]
      ... BCPU@37.5C thermal@36.5C Tdiode@34.25C VDD_SYS_GPU 152/152 VDD_SYS_SOC 687/687
      VDD_4V0_WIFI 0/0 VDD_IN 3056/3056 VDD_SYS_CPU 152/152 VDD_SYS_DDR 883/883

* JetPack 5/6 (L4T R35/R36): ``mW`` units and an optional leading ``MM-DD-YYYY HH:MM:SS``::

      09-15-2024 12:19:33 RAM 6334/15388MB ... VDD_IN 5299mW/5299mW VDD_CPU_GPU_CV 773mW/773mW

* Newer releases print three values per rail and two per temperature, e.g. an AGX Orin line
  ``VDD_GPU_SOC 2792mW/2792mW/2792mW ... cpu@43.093C/43.093C``; only the first value is used.

Samples come from DataDog's datadog-agent jetson check tests and jetson-stats'
``jtop/core/tegra_parse.py``. ``tegrastats --stop`` is never run: it stops every tegrastats on the
machine, including other people's; odtd terminates only its own child.
"""

import collections
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import IO, Deque, Dict, Iterable, Iterator, NamedTuple, Optional

from odtd.errors import TelemetryUnavailable
from odtd.telemetry.base import Backend, PowerSample

logger = logging.getLogger(__name__)

DEFAULT_EXECUTABLE = Path("usr/bin/tegrastats")
_TIMESTAMP_RE = re.compile(r"^\s*(\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2})\s")
_RAIL_RE = re.compile(
    r"(?:^|\s)([A-Z][A-Z0-9_]*) (\d+)(?:mW)?/\d+(?:mW)?(?:/\d+(?:mW)?)?(?=\s|$)")
_RAM_RE = re.compile(r"\bRAM (\d+)/(\d+)MB")
_TEMP_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_]*)@(-?\d+(?:\.\d+)?)C(?:/[-\d.]+C)?(?=\s|$)")


class ParsedLine(NamedTuple):
    """What one tegrastats line says about power, memory and temperature.

    Attributes:
        power_mw: Instantaneous power per rail in milliwatts.
        timestamp: The line's wall-clock timestamp (JetPack 5+), or None.
        ram_used_mb: RAM in use in MB, or None.
        ram_total_mb: RAM total in MB, or None.
        temps_c: Temperatures by sensor in degrees Celsius.
    """

    power_mw: Dict[str, float]
    timestamp: Optional[datetime]
    ram_used_mb: Optional[float]
    ram_total_mb: Optional[float]
    temps_c: Dict[str, float]

    def to_sample(self, t_mono: float) -> PowerSample:
        """Turn the line into a sample taken at ``t_mono``."""
        available = None
        if self.ram_total_mb is not None and self.ram_used_mb is not None:
            available = self.ram_total_mb - self.ram_used_mb
        return PowerSample.from_rails(t_mono, self.power_mw, memory_available_mb=available,
                                      temps_c=self.temps_c)


def parse_line(line: str) -> ParsedLine:
    """Parse one tegrastats line of any supported JetPack format.

    Args:
        line: One line of tegrastats output.

    Returns:
        The parsed line; ``power_mw`` is empty when the line has no rails.
    """
    timestamp = None
    match = _TIMESTAMP_RE.match(line)
    if match:
        try:
            timestamp = datetime.strptime(match.group(1), "%m-%d-%Y %H:%M:%S")
        except ValueError:
            logger.debug("bad tegrastats timestamp %r", match.group(1))
    power_mw = {name: float(value) for name, value in _RAIL_RE.findall(line)}
    ram = _RAM_RE.search(line)
    temps_c = {name: float(value) for name, value in _TEMP_RE.findall(line)}
    return ParsedLine(power_mw, timestamp,
                      float(ram.group(1)) if ram else None,
                      float(ram.group(2)) if ram else None,
                      temps_c)


def parse_log(lines: Iterable[str]) -> Iterator[ParsedLine]:
    """Yield the parsed lines that carry power rails, skipping anything else."""
    for line in lines:
        parsed = parse_line(line)
        if parsed.power_mw:
            yield parsed


class TegrastatsBackend(Backend):
    """tegrastats run as a child at its own cadence; each line becomes a sample."""

    name = "tegrastats"
    source = "tegrastats"

    def __init__(self, root: Path = Path("/"), interval_ms: int = 100,
                 executable: Optional[str] = None, start_timeout_s: float = 5.0) -> None:
        """Store options.

        Args:
            root: Filesystem root; the executable defaults to ``root/usr/bin/tegrastats``.
            interval_ms: Value passed to ``tegrastats --interval``, in milliseconds.
            executable: Explicit path of tegrastats, overriding the default.
            start_timeout_s: How long ``open()`` waits for the first line, in seconds.
        """
        if interval_ms < 1:
            raise ValueError(f"interval_ms must be >= 1, got {interval_ms!r}")
        self.root = Path(root)
        self.interval_ms = int(interval_ms)
        self.nominal_interval_s = self.interval_ms / 1000.0
        self.executable = Path(executable) if executable else _default_executable(self.root)
        self.start_timeout_s = start_timeout_s
        self._process: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None
        self._lines: Deque[PowerSample] = collections.deque(maxlen=1024)
        self._ready = threading.Condition()
        self._exit_message: Optional[str] = None
        self._stderr: Optional[IO[str]] = None

    @classmethod
    def probe(cls, root: Path = Path("/")) -> Optional[str]:
        """Available when an executable tegrastats exists."""
        executable = _default_executable(Path(root))
        if not os.access(str(executable), os.X_OK):
            return (f"tegrastats not found at /{DEFAULT_EXECUTABLE} (not a Jetson, or "
                    "nvidia-l4t-tools missing): choose another backend")
        return None

    def open(self) -> None:
        """Start ``tegrastats --interval N`` and wait for its first line."""
        self.close()
        self._exit_message = None
        command = [str(self.executable), "--interval", str(self.interval_ms)]
        try:
            # stderr goes to a file: a pipe nobody reads could fill and stall tegrastats.
            self._stderr = tempfile.TemporaryFile(mode="w+")
            self._process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=self._stderr,
                stdin=subprocess.DEVNULL, universal_newlines=True, bufsize=1)
        except OSError as error:
            self.close()
            raise TelemetryUnavailable(
                f"tegrastats: cannot run {self.executable} ({error.strerror or error}); install "
                "nvidia-l4t-tools or choose another telemetry backend") from error
        self._thread = threading.Thread(target=self._read_lines, args=(self._process,),
                                        name="odtd-tegrastats", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        with self._ready:
            while not self._lines and self._exit_message is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._ready.wait(remaining)
            failure = None if self._lines else self._exit_message or (
                f"no power rails in its output within {self.start_timeout_s:.1f} s")
        if failure is not None:
            self.close()
            raise TelemetryUnavailable(
                f"tegrastats: {failure}; run odtd as root (some boards need it for tegrastats) or "
                "choose another telemetry backend")

    def _read_lines(self, process: subprocess.Popen) -> None:
        stdout: IO[str] = process.stdout  # type: ignore[assignment]
        for line in stdout:
            t_mono = time.monotonic()
            parsed = parse_line(line)
            if not parsed.power_mw:
                logger.debug("tegrastats line without rails: %r", line[:120])
                continue
            with self._ready:
                self._lines.append(parsed.to_sample(t_mono))
                self._ready.notify_all()
        status = process.wait()
        error_text = ""
        stderr = self._stderr
        if stderr is not None:
            try:
                stderr.seek(0)
                error_text = stderr.read().strip()
            except (OSError, ValueError) as error:  # ValueError: closed by close()
                logger.debug("tegrastats stderr unreadable: %s", error)
        last_error = error_text.splitlines()[-1] if error_text else ""
        with self._ready:
            self._exit_message = f"exited with status {status}" + (
                f": {last_error}" if last_error else "")
            self._ready.notify_all()

    def read(self) -> Optional[PowerSample]:
        """Return the next line's sample, waiting up to three intervals (None on timeout)."""
        if self._process is None:
            raise TelemetryUnavailable("tegrastats: read() before open()")
        with self._ready:
            if not self._lines and self._exit_message is None:
                self._ready.wait(3.0 * self.nominal_interval_s)
            if self._lines:
                return self._lines.popleft()
            if self._exit_message is not None:
                raise TelemetryUnavailable(f"tegrastats {self._exit_message}")
        return None

    def close(self) -> None:
        """Terminate the child (only ours: never ``tegrastats --stop``) and join the reader."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        if process is not None and process.stdout is not None:
            process.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        self._lines.clear()


def _default_executable(root: Path) -> Path:
    candidate = root / DEFAULT_EXECUTABLE
    if root == Path("/") and not candidate.exists():
        found = shutil.which("tegrastats")
        if found:
            return Path(found)
    return candidate
