"""Launching the trainer worker (``python -m odtd.trainer.worker JOB.json``) and reading it.

The worker speaks JSON lines on stdout (docs/worker-protocol.md). This module never imports
TensorFlow; it only starts, watches and stops the process that does.
"""

import json
import logging
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from odtd.errors import TrainerFailed

logger = logging.getLogger(__name__)

# Variables systemd hands to the service only (sd_notify(3)): the worker must never ping
# systemd in the daemon's name, so its environment goes without them.
NOTIFY_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# The framework's warm-up steps (graph tracing, allocator growth), skipped in every per-step
# statistic: throughput, per-step energy, profiles.
WARMUP_STEPS = 3


class WorkerRun:
    """A running trainer worker: its JSON lines, its peak memory, and how to stop it.

    Args:
        command: argv prefix for ``python -m odtd.trainer.worker``.
        job_path: the job file.
        stderr_path: where the worker's stderr (TensorFlow's log) is kept.
    """

    def __init__(self, command: List[str], job_path: Path, stderr_path: Path) -> None:
        self._stderr = open(stderr_path, "wb")
        # A new session keeps a terminal's Ctrl-C away from the worker: the runner decides how
        # it stops (step boundary first), so a foreground session ends `interrupted`, not torn.
        # The worker must not speak to systemd in the daemon's name.
        env = {k: v for k, v in os.environ.items() if k not in NOTIFY_ENV_VARS}
        self.process = subprocess.Popen(
            [*command, str(job_path)], stdout=subprocess.PIPE, stderr=self._stderr,
            stdin=subprocess.DEVNULL, start_new_session=True, env=env,
        )
        self.lines = queue.Queue()  # type: queue.Queue  # of Optional[Dict[str, Any]]
        self.peak_rss_mb = 0.0
        self.min_available_mb: Optional[float] = None
        self.oom_kills_at_start = read_oom_kills()
        self._reader = threading.Thread(target=self._read, name="worker-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None  # noqa: S101 - Popen(stdout=PIPE) guarantees it
        for raw in self.process.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                logger.debug("worker printed a non-JSON line: %r", raw[:200])
                continue
            if isinstance(message, dict):
                self.lines.put(message)
        self.lines.put(None)

    def sample_memory(self) -> None:
        """Track the worker's peak RSS (VmHWM) and the system's lowest MemAvailable, from /proc.

        Read here rather than only reported by the worker, so even a killed worker has a figure.
        """
        try:
            with open("/proc/meminfo", encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        available = int(line.split()[1]) / 1024.0
                        if self.min_available_mb is None or available < self.min_available_mb:
                            self.min_available_mb = round(available, 1)
                        break
        except (OSError, ValueError):
            logger.debug("no MemAvailable in /proc/meminfo")
        try:
            with open(f"/proc/{self.process.pid}/status", encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        self.peak_rss_mb = max(self.peak_rss_mb, int(line.split()[1]) / 1024.0)
                        break
        except (OSError, ValueError):
            pass  # the process is gone between poll and read; its last figure stands

    def signal(self, signum: int) -> None:
        """Send a signal if the worker is still running."""
        if self.process.poll() is None:
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:
                logger.debug("worker %d exited before signal %d", self.process.pid, signum)

    def close(self) -> None:
        """Reap the worker and release its pipes."""
        self.process.wait()
        self._reader.join(timeout=5)
        self._stderr.close()
        if self.process.stdout:
            self.process.stdout.close()


def run_job(
    command: List[str],
    job: Dict[str, Any],
    job_dir: Path,
    on_message: Optional[Callable[[Dict[str, Any]], None]] = None,
    timeout_s: Optional[float] = None,
) -> Tuple[Dict[str, Any], List[Dict[str, Any]], float]:
    """Run a worker job to completion (init, pre-training, profiling probes).

    Args:
        command: argv prefix for the worker module.
        job: the job (written to ``job_dir/job.json``).
        job_dir: a directory for the job file and the worker's stderr.
        on_message: called with every JSON line (progress output).
        timeout_s: kill the worker after this long.

    Returns:
        (result event, step events, peak RSS in MB).

    Raises:
        TrainerFailed: the worker reported an error, crashed, was killed or timed out.
    """
    job_dir.mkdir(parents=True, exist_ok=True)
    job_path = job_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2), encoding="utf-8")
    worker = WorkerRun(command, job_path, job_dir / "worker.stderr")
    result: Optional[Dict[str, Any]] = None
    error: Optional[Dict[str, Any]] = None
    steps: List[Dict[str, Any]] = []
    waited_s = 0.0
    try:
        while True:
            try:
                message = worker.lines.get(timeout=0.5)
            except queue.Empty:
                worker.sample_memory()
                waited_s += 0.5
                if timeout_s is not None and waited_s > timeout_s:
                    worker.signal(signal.SIGKILL)
                    raise TrainerFailed(f"worker timed out after {timeout_s:.0f} s") from None
                continue
            if message is None:
                break
            worker.sample_memory()
            event = message.get("event")
            if event == "step":
                steps.append(message)
            elif event == "result":
                result = message
            elif event == "error":
                error = message
            if on_message:
                on_message(message)
    finally:
        worker.close()
    if error is not None or result is None or worker.process.returncode != 0:
        raise TrainerFailed(failure_reason(worker.process.returncode, error, job_dir / "worker.stderr"))
    return result, steps, max(worker.peak_rss_mb, result.get("peak_rss_mb") or 0.0)


def read_oom_kills(vmstat: Path = Path("/proc/vmstat")) -> Optional[int]:
    """The kernel's count of OOM kills (``oom_kill`` in /proc/vmstat, Linux >= 4.13), or None."""
    try:
        for line in vmstat.read_text(encoding="ascii").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        logger.debug("no oom_kill counter in %s", vmstat)
    return None


def worker_ran_out_of_memory(error: Optional[Dict[str, Any]], returncode: Optional[int],
                             oom_kills_at_start: Optional[int]) -> bool:
    """Whether a failed worker ran out of memory.

    An ``oom`` error event says so. A SIGKILL is the kernel's OOM killer only if its kill
    counter moved while the worker ran; on kernels without the counter (a TX2's 4.9) a SIGKILL
    is taken as an OOM kill, since halving the batch is the safe answer either way.
    """
    if error is not None:
        return error.get("kind") == "oom"
    if returncode != -signal.SIGKILL:
        return False
    now = read_oom_kills()
    return True if now is None or oom_kills_at_start is None else now > oom_kills_at_start


def failure_reason(returncode: Optional[int], error: Optional[Dict[str, Any]], stderr: Path) -> str:
    """Say in one line why a worker ended without a result."""
    if error is not None:
        return f"worker error ({error.get('kind')}): {error.get('message')}"
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the kernel's OOM killer, or a person)" if name == "SIGKILL" else ""
        return f"worker killed by {name}{hint}"
    tail = ""
    try:
        lines = stderr.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        tail = f": {lines[-1][:200]}" if lines else ""
    except OSError:
        logger.debug("no stderr kept at %s", stderr)
    return f"worker exited with status {returncode} without a result{tail}"
