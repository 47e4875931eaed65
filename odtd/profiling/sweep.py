"""``odtctl profile``: measure each batch size in its own worker process, with telemetry.

Every (precision, batch size) runs in a fresh worker process in ``profile`` mode, so an OOM or a
crash at one size is a data point, not the end of the sweep, and each size's peak memory is its
own. A telemetry sampler runs in this process on the configured backend; the worker's step spans
(CLOCK_MONOTONIC, shared across processes) select the samples of the measured steps. The first
``WARMUP_STEPS`` spans (graph tracing, allocator growth) are left out of every statistic.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from odtd.config import Config
from odtd.errors import TelemetryUnavailable, TrainerFailed
from odtd.home.lock import SessionLock
from odtd.home.paths import Home
from odtd.home.spec import BUILTIN, ModelSpec
from odtd.policy import TrainingPolicy
from odtd.profiling.profile import DOES_NOT_FIT, OK, ProfileResult, ProfileRow, plan_name
from odtd.store.database import Store, utc_now
from odtd.trainer.protocol import catalog
from odtd.trainer.protocol.job import make_job
from odtd.trainer.protocol.launch import WARMUP_STEPS, precision_said, run_job
from odtd.trainer.protocol.procfs import cpu_identity

logger = logging.getLogger(__name__)


def run_profile(
    home: Home, store: Store, config: Config, model: str, batch_sizes: Sequence[int],
    steps: int, precisions: Sequence[str] = ("fp32",),
    progress: Optional[Callable[[str], None]] = None,
    training: Optional[TrainingPolicy] = None, root: Path = Path("/"),
    recompute: Sequence[float] = (0.0,), repeats: int = 1,
) -> ProfileResult:
    """Profile ``model`` at each (precision, recompute, batch size) and store the rows.

    With ``repeats`` above 1 the whole sweep runs that many times over, one pass after the
    other (so a slow drift of the machine touches every size alike), and each size's runs
    become one row (``merge_runs``): a size's peak memory moves between runs by more than the
    memory model's error (the order in which TensorFlow's threads run a step's ops), so the line
    is fitted through every run. A size that did not fit is not run again.

    Args:
        home: The home (its session lock is held: a profile and a session never overlap).
        store: Its database; the rows become one profile run.
        config: Trainer command, timeout and telemetry backend.
        model: Registry name.
        batch_sizes: Sizes to try; each runs ``WARMUP_STEPS + steps`` steps.
        steps: Measured steps per size, after the warm-up.
        precisions: Worker precisions (``fp32``, ``auto``, ...).
        progress: Called with one-line progress messages.
        training: Optimizer, augmentation and BatchNorm settings (memory depends on them).
        root: Filesystem root for the board description.
        recompute: Shares of the network under gradient checkpointing, 0 for none
            (admission's plans).
        repeats: Runs of each size, at least 1.

    Raises:
        SessionBusy: A session is running.
        TrainerFailed: The worker rejected the job itself (the same at every size).
    """
    say = progress or (lambda message: None)
    training = training or TrainingPolicy()
    spec = ModelSpec.from_store(store)
    if model != spec.name:  # another built-in network, profiled on this board
        spec = ModelSpec(model, BUILTIN, spec.classes, list(catalog.get(model).input_shape))
    sampler = _start_sampler(config, say)
    runs: Dict[Tuple[str, float, int], List[ProfileRow]] = {}
    try:
        with SessionLock(home.session_lock):
            stamp = utc_now().replace(":", "").replace("+0000", "Z")
            for repeat in range(1, repeats + 1):
                if repeats > 1:
                    say(f"pass {repeat} of {repeats}")
                for precision in precisions:
                    for checkpointed in recompute:
                        for batch_size in sorted(set(batch_sizes)):
                            key = (precision, checkpointed, batch_size)
                            if any(r.status != OK for r in runs.get(key, [])):
                                continue
                            plan = plan_name(precision, checkpointed)
                            job_dir = home.runs / (f"profile-{stamp}-{plan}-b{batch_size}"
                                                   + (f"-r{repeat}" if repeats > 1 else ""))
                            runs.setdefault(key, []).append(_profile_one(
                                home, store, config, sampler, job_dir, say, spec,
                                training, precision, batch_size, steps, checkpointed))
    finally:
        if sampler is not None:
            sampler.stop()
            sampler.backend.close()
    rows = [merge_runs(measured) for measured in runs.values()]
    board = board_description(root)
    backend_name = sampler.backend.name if sampler is not None else None
    profile_id = store.add_profile_rows(model, backend_name, board, steps,
                                        [r.to_dict() for r in rows])
    stored = tuple(ProfileRow(**dict(r.to_dict(), profile_id=profile_id)) for r in rows)
    return ProfileResult(profile_id, model, backend_name, board, steps, stored)


def merge_runs(runs: Sequence[ProfileRow]) -> ProfileRow:
    """One row for a size that ran more than once.

    A run that did not fit makes the size not fit. Otherwise the throughput, step time and
    energy are the runs' means, the peak memory is the largest run's (what a session may meet)
    and ``peak_memory_runs_mb`` keeps every run's. One run is returned as it is.
    """
    if len(runs) == 1:
        return runs[0]
    failed = [r for r in runs if r.status != OK]
    if failed:
        return failed[0]

    def mean(name: str) -> Optional[float]:
        values = [getattr(r, name) for r in runs]
        return None if None in values else sum(values) / len(values)

    by_rail = [r.energy_per_sample_by_rail_j for r in runs]
    rails = sorted(set.intersection(*(set(b) for b in by_rail))) if None not in by_rail else []
    step_s = mean("step_s")
    peaks = [r.peak_memory_mb for r in runs if r.peak_memory_mb is not None]
    energy = mean("energy_per_sample_j")
    power, coverage = mean("mean_power_w"), mean("energy_coverage")
    return replace(
        runs[0],
        samples_per_s=None if step_s is None else round(runs[0].batch_size / step_s, 3),
        step_s=None if step_s is None else round(step_s, 4),
        energy_per_sample_j=None if energy is None else round(energy, 5),
        energy_per_sample_by_rail_j={rail: round(sum(b[rail] for b in by_rail) / len(runs), 5)
                                     for rail in rails} if rails else None,
        energy_coverage=None if coverage is None else round(coverage, 4),
        mean_power_w=None if power is None else round(power, 3),
        peak_memory_mb=max(peaks) if peaks else None,
        peak_memory_runs_mb=peaks or None)


def _start_sampler(config: Config, say: Callable[[str], None]) -> Any:
    """Start a sampler on the configured backend; None (energy left empty) if it cannot run."""
    from odtd.telemetry.meter import make_sampler

    try:
        sampler = make_sampler(config.telemetry)
    except TelemetryUnavailable as exc:
        say(f"telemetry: {exc}; energy figures will be empty")
        return None
    if not sampler.backend.measures_energy:
        say(f"telemetry: backend {sampler.backend.name} measures nothing; energy figures will "
            "be empty")
    sampler.start()
    return sampler


def _profile_one(home: Home, store: Store, config: Config, sampler: Any, job_dir: Path,
                 say: Callable[[str], None], spec: ModelSpec, training: TrainingPolicy,
                 precision: str, batch_size: int, steps: int, recompute: float = 0.0
                 ) -> ProfileRow:
    total_steps = WARMUP_STEPS + steps
    job_dir.mkdir(parents=True, exist_ok=True)
    data_path = job_dir / "train.npz"
    model, classes, input_shape = spec.name, spec.classes, spec.input_shape
    source = _write_data(home, store, data_path, batch_size * total_steps, input_shape, classes)
    say(f"profile {model} {plan_name(precision, recompute)} batch {batch_size}: worker starting "
        f"({total_steps} steps on {source} data)")
    job = make_job(
        "profile", model, classes, input_shape, train_data=str(data_path),
        batch_size=batch_size, max_steps=total_steps, optimizer=training.optimizer,
        learning_rate=training.learning_rate, momentum=training.momentum,
        clip_norm=training.clip_norm,
        augment=training.augment, freeze_bn=training.freeze_bn,
        # Recalibration runs the model eagerly and can set a session's peak memory: profile it too.
        recalibrate_bn=training.recalibrate_bn, seed=training.seed, parent_pid=os.getpid(),
        precision=precision, precision_probe=str(home.precision_probe), recompute=recompute,
        trainable=training.trainable,
        **spec.job_keys(home))
    seen: Dict[str, Any] = {}

    def on_message(message: Dict[str, Any]) -> None:
        event = message.get("event")
        if event in ("start", "error"):
            seen[event] = message
            if said := precision_said(message):
                say(f"  batch {batch_size}: {said}")
        elif event == "step" and (message["index"] + 1 == WARMUP_STEPS
                                  or (message["index"] + 1) % 5 == 0):
            say(f"  batch {batch_size}: step {message['index'] + 1}/{total_steps} "
                f"({message['end'] - message['start']:.2f} s)")

    try:
        result, spans, peak_mb = run_job(config.trainer.command(), job, job_dir, on_message,
                                         timeout_s=config.trainer.timeout_s)
    except TrainerFailed as exc:
        if seen.get("error", {}).get("kind") == "bad_job":
            raise
        say(f"  batch {batch_size}: does not fit: {exc}")
        return ProfileRow(batch_size, precision, DOES_NOT_FIT, recompute=recompute, reason=str(exc),
                          precision_resolved=seen.get("start", {}).get("precision"))
    finally:
        data_path.unlink(missing_ok=True)
    measured = spans[WARMUP_STEPS:]
    if not measured:
        raise TrainerFailed(f"batch {batch_size}: the worker ran {len(spans)} steps, none after "
                            f"the {WARMUP_STEPS} warm-up steps")
    seconds = sum(s["end"] - s["start"] for s in measured)
    samples = sum(s["batch_size"] for s in measured)
    energy = _energy(sampler, measured[0]["start"], measured[-1]["end"], samples)
    row = ProfileRow(batch_size, precision, OK, recompute=recompute,
                     precision_resolved=result.get("precision"),
                     samples_per_s=round(samples / seconds, 3),
                     step_s=round(seconds / len(measured), 4),
                     peak_memory_mb=round(peak_mb, 1), **energy)
    say(f"  batch {batch_size}: {row.samples_per_s:.1f} samples/s, peak {row.peak_memory_mb:.0f} MB"
        + (f", {row.energy_per_sample_j:.3f} J/sample ({row.energy_source})"
           if row.energy_per_sample_j is not None else ""))
    return row


def _energy(sampler: Any, start: float, end: float, samples: int) -> Dict[str, Any]:
    """Energy fields of a row over ``[start, end]`` (monotonic s), empty without a sampler."""
    if sampler is None:
        return {}
    sampler.wait_for_sample_after(end, timeout_s=sampler.gap_factor * sampler.interval_s)
    report = sampler.energy_between(start, end)
    if report.energy_j is None:
        return {"energy_source": report.source, "energy_coverage": 0.0}
    return {
        "energy_per_sample_j": round(report.energy_j / samples, 5),
        "energy_per_sample_by_rail_j": {rail: round(j / samples, 5)
                                        for rail, j in report.energy_by_rail_j.items()},
        "energy_source": report.source, "energy_coverage": round(report.coverage, 4),
        "mean_power_w": None if report.mean_power_w is None else round(report.mean_power_w, 3),
    }


def _write_data(home: Home, store: Store, path: Path, count: int, input_shape: List[int],
                classes: List[str]) -> str:
    """Write ``count`` training samples: pending ones (repeated) if any fit, else random."""
    from odtd.home.ingest import load_sample_arrays

    pending = store.samples("pending", limit=count)
    if pending:
        x, y = load_sample_arrays(home, pending, classes)
        if list(x.shape[1:]) == list(input_shape):
            repeat = -(-count // len(x))
            np.savez(path, x=np.tile(x, (repeat, 1, 1, 1))[:count], y=np.tile(y, repeat)[:count])
            return f"{len(pending)} pending samples"
    rng = np.random.RandomState(0)
    np.savez(path, x=rng.randint(0, 256, size=[count] + list(input_shape), dtype=np.uint8),
             y=rng.randint(0, len(classes), size=count).astype(np.int64))
    return "random"


def cpu_description(root: Path = Path("/")) -> str:
    """Describe the CPU, e.g. ``x86_64, AMD EPYC, 2 CPUs``: what benchmark figures ran on."""
    model = cpu_identity(str(root / "proc/cpuinfo"))[0] or platform.processor() or platform.machine()
    return f"{platform.machine()}, {model}, {os.cpu_count()} CPUs"


def board_description(root: Path = Path("/")) -> str:
    """Describe the board: the device-tree model, plus the nvpmodel mode where there is one.

    Without a device tree (a PC, a VM): the CPU (``cpu_description``), so a profile taken on
    another processor is told apart from this one's.
    """
    try:
        board = (root / "proc/device-tree/model").read_bytes().rstrip(b"\0").decode().strip()
    except (OSError, UnicodeDecodeError):
        board = cpu_description(root)
    nvpmodel = shutil.which("nvpmodel") if root == Path("/") else None
    if nvpmodel:
        try:
            lines = subprocess.run([nvpmodel, "-q"], capture_output=True, text=True, timeout=5,
                                   check=True).stdout.splitlines()
        except (OSError, subprocess.SubprocessError) as exc:
            logger.debug("nvpmodel -q failed: %s", exc)
            return board
        # "NV Power Mode: MAXN" then the mode number on the next line.
        for index, line in enumerate(lines):
            if line.startswith("NV Power Mode:"):
                mode = lines[index + 1].strip() if index + 1 < len(lines) else "?"
                return f"{board} (nvpmodel {line.split(':', 1)[1].strip()}, mode {mode})"
    return board
