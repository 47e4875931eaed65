"""Launching the trainer worker (``python -m odtd.trainer.worker JOB.json``) and following it.

The worker speaks JSON lines on stdout (docs/worker-protocol.md). This module never imports
TensorFlow; it only starts, watches and stops the process that does. Sessions, profiles, ``init``
and the simulations all follow a worker the same way: ``WorkerRun.follow``.
"""

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from odtd.errors import TrainerFailed
from odtd.trainer.protocol.procfs import read_oom_kills, read_proc_mb

logger = logging.getLogger(__name__)

# The framework's warm-up steps (graph tracing, allocator growth), skipped in every per-step
# statistic: throughput, per-step energy, profiles.
WARMUP_STEPS = 3

POLL_S = 0.2

WORKER_MODULE = "odtd.trainer.worker"
# How another interpreter (``trainer.python``) imports this process's odtd package and nothing
# else of its environment: the package is loaded from its directory by path, its submodules
# found through its ``__path__``; nothing goes on ``sys.path``, so a site-packages compiled for
# the daemon's Python (numpy) never reaches the worker's. Then the module runs as ``-m`` would
# run it. ``python -c CODE ARGS`` has the shape of ``python -m MODULE ARGS``: a wrapper that
# stands in for an interpreter finds the job file where it would. Python 3.6's words.
IMPORT_ODTD_AND_RUN = (
    "import runpy, sys; from importlib import util; "
    "spec = util.spec_from_file_location('odtd', {package!r} + '/__init__.py', "
    "submodule_search_locations=[{package!r}]); odtd = util.module_from_spec(spec); "
    "sys.modules['odtd'] = odtd; spec.loader.exec_module(odtd); "
    "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


def module_command(python: Optional[str], module: str = WORKER_MODULE) -> List[str]:
    """The argv prefix that runs ``module`` of this process's odtd package under ``python``.

    Without ``python`` (or with this process's own), ``sys.executable -m MODULE``. Another
    interpreter runs ``IMPORT_ODTD_AND_RUN``: it imports the very odtd package this process
    runs, wherever it is installed, and nothing else of this process's environment.
    """
    if python is None or python == sys.executable:
        return [sys.executable, "-m", module]
    package = os.path.dirname(os.path.abspath(sys.modules["odtd"].__file__))
    return [python, "-c", IMPORT_ODTD_AND_RUN.format(package=package, module=module)]


class WorkerEnd(NamedTuple):
    """How a followed worker ended.

    Attributes:
        result: Its ``result`` event, None if it printed none.
        error: Its ``error`` event, None if it printed none.
        steps: Its ``step`` events, in order.
        returncode: The exit status (negative: killed by that signal).
        stop_reason: Why it was asked to stop (a stop request or the timeout), else None.
        peak_rss_mb: The worker's peak RSS in MB (``/proc`` and its own report, the larger).
        min_available_mb: The system's lowest MemAvailable while it ran, in MB.
        duration_s: Wall time from start to exit.
        oom: It ran out of memory (see ``worker_ran_out_of_memory``).
        failure: One line saying why it ended without a result, None if it has one.
    """

    result: Optional[Dict[str, Any]]
    error: Optional[Dict[str, Any]]
    steps: List[Dict[str, Any]]
    returncode: Optional[int]
    stop_reason: Optional[str]
    peak_rss_mb: float
    min_available_mb: Optional[float]
    duration_s: float
    oom: bool
    failure: Optional[str]


class WorkerRun:
    """A running trainer worker: its JSON lines, its peak memory, and how to stop it.

    Args:
        command: argv prefix for ``python -m odtd.trainer.worker``.
        job_path: the job file.
        stderr_path: where the worker's stderr (TensorFlow's log) is kept.
    """

    def __init__(self, command: List[str], job_path: Path, stderr_path: Path) -> None:
        self.stderr_path = Path(stderr_path)
        self._stderr = open(str(stderr_path), "wb")
        # A new session keeps a terminal's Ctrl-C away from the worker: the caller decides how
        # it stops (step boundary first), so a foreground session ends `interrupted`, not torn.
        # (systemd's variables never reach it: the daemon's children go without them, sdnotify.)
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            list(command) + [str(job_path)], stdout=subprocess.PIPE, stderr=self._stderr,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.lines = queue.Queue()  # type: queue.Queue  # of Optional[Dict[str, Any]]
        self.peak_rss_mb = 0.0
        self.min_available_mb = None  # type: Optional[float]
        self.oom_kills_at_start = read_oom_kills()
        self._reader = threading.Thread(target=self._read, name="worker-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
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
        available = read_proc_mb("MemAvailable")
        if available is not None and (self.min_available_mb is None
                                      or available < self.min_available_mb):
            self.min_available_mb = round(available, 1)
        # None when the process is gone between poll and read: its last figure stands.
        peak = read_proc_mb("VmHWM", Path("/proc/{}/status".format(self.process.pid)))
        if peak is not None:
            self.peak_rss_mb = max(self.peak_rss_mb, peak)

    def signal(self, signum: int) -> None:
        """Send a signal if the worker is still running."""
        if self.process.poll() is None:
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:
                logger.debug("worker %d exited before signal %d", self.process.pid, signum)

    def follow(
        self,
        on_message: Optional[Callable[[Dict[str, Any]], None]] = None,
        stop_requested: Optional[Callable[[], Optional[str]]] = None,
        timeout_s: Optional[float] = None,
        grace_s: float = 20.0,
        on_tick: Optional[Callable[[], None]] = None,
    ) -> WorkerEnd:
        """Read the worker's events until it exits, stopping it when asked; then reap it.

        A stop (``stop_requested`` returns a reason, or ``timeout_s`` passes) sends SIGUSR1, the
        worker's "stop at the next step boundary", once its ``start`` line has come (before it,
        the handler may not be installed yet; a timeout does not wait for it); then SIGTERM after
        ``grace_s`` and SIGKILL after twice that.

        Args:
            on_message: Called with every event line.
            stop_requested: Polled every ``POLL_S``; a non-empty string is the stop's reason.
            timeout_s: Stop the worker after this long.
            grace_s: Seconds from SIGUSR1 to SIGTERM (and from SIGTERM to SIGKILL).
            on_tick: Called every ``POLL_S`` (watchdog pings, progress rows).
        """
        result = error = None  # type: Optional[Dict[str, Any]]
        steps = []  # type: List[Dict[str, Any]]
        stop_reason = None  # type: Optional[str]
        stop_sent_at = None  # type: Optional[float]
        ready = eof = False
        try:
            while not eof or self.process.poll() is None:
                self.sample_memory()
                if on_tick is not None:
                    on_tick()
                now = time.monotonic()
                timed_out = timeout_s is not None and now - self.started > timeout_s
                if stop_reason is None:
                    asked = stop_requested() if stop_requested is not None else None
                    if asked or timed_out:
                        stop_reason = asked or "timed out after {:.0f} s".format(timeout_s)
                if stop_reason is not None and stop_sent_at is None and (ready or timed_out):
                    self.signal(signal.SIGUSR1)
                    stop_sent_at = now
                elif stop_sent_at is not None and now - stop_sent_at > 2 * grace_s:
                    self.signal(signal.SIGKILL)
                elif stop_sent_at is not None and now - stop_sent_at > grace_s:
                    self.signal(signal.SIGTERM)
                if eof:
                    time.sleep(POLL_S)
                    continue
                try:
                    message = self.lines.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if message is None:
                    eof = True
                    continue
                event = message.get("event")
                if event == "start":
                    ready = True
                elif event == "step":
                    steps.append(message)
                elif event == "result":
                    result = message
                elif event == "error":
                    error = message
                if on_message is not None:
                    on_message(message)
        finally:
            self.close()
        returncode = self.process.returncode
        peak = max(self.peak_rss_mb, (result or {}).get("peak_rss_mb") or 0.0)
        failed = error is not None or result is None or returncode != 0
        return WorkerEnd(
            result, error, steps, returncode, stop_reason, peak, self.min_available_mb,
            time.monotonic() - self.started,
            oom=failed and worker_ran_out_of_memory(error, returncode, self.oom_kills_at_start),
            failure=failure_reason(returncode, error, self.stderr_path) if failed else None)

    def close(self) -> None:
        """Reap the worker and release its pipes."""
        self.process.wait()
        self._reader.join(timeout=5)
        self._stderr.close()
        if self.process.stdout:
            self.process.stdout.close()


def write_job(job: Dict[str, Any], job_dir: Path) -> Path:
    """Write ``job`` to ``job_dir/job.json`` (creating the directory) and return the path."""
    job_dir.mkdir(parents=True, exist_ok=True)
    job_path = job_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2), encoding="utf-8")
    return job_path


def run_job(
    command: List[str],
    job: Dict[str, Any],
    job_dir: Path,
    on_message: Optional[Callable[[Dict[str, Any]], None]] = None,
    timeout_s: Optional[float] = None,
) -> Tuple[Dict[str, Any], List[Dict[str, Any]], float]:
    """Run a worker job to completion (init, pre-training, profiling probes, evaluations).

    Args:
        command: argv prefix for the worker module.
        job: the job (``odtd.trainer.protocol.job.make_job``), written to ``job_dir/job.json``.
        job_dir: a directory for the job file and the worker's stderr.
        on_message: called with every JSON line (progress output).
        timeout_s: stop the worker after this long (and fail).

    Returns:
        (result event, step events, peak RSS in MB).

    Raises:
        TrainerFailed: the worker reported an error, crashed, was killed or timed out, or its
            training diverged.
    """
    worker = WorkerRun(command, write_job(job, job_dir), job_dir / "worker.stderr")
    end = worker.follow(on_message, timeout_s=timeout_s, grace_s=5.0)
    if end.stop_reason is not None:
        raise TrainerFailed("worker {}".format(end.stop_reason))
    if end.failure is not None:
        raise TrainerFailed(end.failure, oom=end.oom)
    reason = diverged(end.result)
    if reason is not None:  # it wrote no weights
        raise TrainerFailed(reason)
    return end.result, end.steps, end.peak_rss_mb


def precision_said(message: Dict[str, Any]) -> Optional[str]:
    """``precision auto -> fp32 (why)`` from a worker's ``start`` event, or None.

    None for any other message, and for a precision that was not ``auto`` (no reason given).
    """
    if message.get("event") != "start" or not message.get("precision_reason"):
        return None
    return "precision auto -> {} ({})".format(message["precision"], message["precision_reason"])


def diverged(result: Optional[Dict[str, Any]]) -> Optional[str]:
    """Why a train job's result has no candidate when its training diverged, else None.

    Names the rates tried and what to change in the policy.
    """
    if (result or {}).get("status") != "diverged":
        return None
    rates = [attempt["learning_rate"] for attempt in result.get("lr_attempts") or []]
    tried = "at learning rate {:g}".format(rates[0]) if len(rates) == 1 else \
        "at every learning rate tried ({})".format(", ".join("{:g}".format(r) for r in rates))
    fix = "lower training.learning_rate below {:g}".format(min(rates)) if rates else \
        "lower training.learning_rate"
    if result.get("clip_norm") is None:
        fix += " or set training.clip_norm (1.0 clips each step's gradient to norm 1)"
    else:
        fix += " or training.clip_norm (now {:g})".format(result["clip_norm"])
    return "training diverged {} (at step {} the loss was not finite, or 100 times the first " \
           "step's); {} in the policy".format(tried, result.get("diverged_at_step"), fix)


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
        # Keras's messages span lines (a blank one, then "Exception encountered: ...").
        lines = str(error.get("message")).splitlines()
        return "worker error ({}): {}".format(
            error.get("kind"), " ".join(line.strip() for line in lines if line.strip()))
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the kernel's OOM killer, or a person)" if name == "SIGKILL" else ""
        return "worker killed by {}{}".format(name, hint)
    tail = ""
    try:
        lines = stderr.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        tail = ": {}".format(lines[-1][:200]) if lines else ""
    except OSError:
        logger.debug("no stderr kept at %s", stderr)
    return "worker exited with status {} without a result{}".format(returncode, tail)
