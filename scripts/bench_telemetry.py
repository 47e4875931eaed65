#!/usr/bin/env python3
"""Benchmark what the 10 ms telemetry sampler costs a training session.

The real trainer worker (``python -m odtd.trainer.worker JOB.json``, profile mode, random uint8
data) trains densenet40 at batch 16, alternately without and with a sampler running in a thread
of this process, which stands in for the daemon (ABAB..., to spread drift over both). The sampler
uses the backend that applies on this machine (``estimate`` unless told otherwise) at 10 ms.

Reported: training throughput (samples/s over the measured steps, after 3 warm-up steps) with and
without the sampler and the slowdown in percent (of the means, per adjacent pair, and of the
median step, which a stall caused by something else on the machine does not move); the
sampler's achieved mean interval; its CPU cost as the sampler thread's own CPU time
(``time.thread_time()`` inside the thread) and as this process's CPU time, both over wall time;
the CPU other processes used meanwhile (a shared machine skews both arms); and, for
illustration, the session's energy and the per-step energy joined from the worker's steps.

    python scripts/bench_telemetry.py [--json] [--pairs 3] [--steps 20] [--backend estimate]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from odtd.telemetry import Sampler, open_backend, step_energies  # noqa: E402
from odtd.telemetry.estimate import read_cpu_ticks  # noqa: E402

NUM_CLASSES = 10
INPUT_SHAPE = (32, 32, 3)
SAMPLES = 512


def machine() -> str:
    """Describe the CPU this ran on."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.machine()  # not Linux: keep platform's answer
    return f"{platform.machine()}, {model}, {os.cpu_count()} CPUs"


def write_job(workdir: Path, model: str, batch_size: int, max_steps: int) -> Path:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (SAMPLES, *INPUT_SHAPE), dtype=np.uint8)
    y = rng.integers(0, NUM_CLASSES, SAMPLES).astype(np.int64)
    np.savez(workdir / "train.npz", x=x, y=y)
    job = {
        "protocol": 1, "mode": "profile", "model": model,
        "classes": [f"class{i}" for i in range(NUM_CLASSES)], "input_shape": list(INPUT_SHAPE),
        "weights_in": None, "weights_out": None, "train_data": str(workdir / "train.npz"),
        "validation_data": None, "batch_size": batch_size, "epochs": 1, "max_steps": max_steps,
        "optimizer": "sgd", "learning_rate": 0.01, "momentum": 0.9, "augment": False,
        "freeze_bn": False, "seed": 0, "parent_pid": os.getpid(), "precision": "fp32",
    }  # fmt: skip
    path = workdir / "job.json"
    path.write_text(json.dumps(job))
    return path


def run_worker(job_path: Path) -> list:
    """Run the worker to completion; return its events."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "odtd.trainer.worker", str(job_path)],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    errors = [e["message"] for e in events if e["event"] == "error"]
    if run.returncode != 0 or errors:
        raise RuntimeError(f"worker exited {run.returncode}: {errors or run.stderr[-2000:]}")
    return events


def measured_spans(events: list, warmup_steps: int) -> list:
    return [(e["start"], e["end"], e["batch_size"])
            for e in events if e["event"] == "step"][warmup_steps:]


def throughput_sps(spans: list) -> float:
    return sum(size for _, _, size in spans) / (spans[-1][1] - spans[0][0])


def median_step_sps(spans: list) -> float:
    """Samples/s of the median step: robust to a step stalled by something else on the box."""
    return spans[0][2] / statistics.median(end - start for start, end, _ in spans)


def slowdown_pct(without: float, with_sampler: float) -> float:
    return round(100.0 * (without - with_sampler) / without, 2)


def run_with_sampler(job_path: Path, args: argparse.Namespace) -> dict:
    backend = open_backend(args.backend)
    sampler = Sampler(backend, interval_s=args.interval_ms / 1000.0)
    cpu_before, wall_before = time.process_time(), time.monotonic()
    sampler.start()
    try:
        sampler.open_window("session")
        events = run_worker(job_path)
        session = sampler.close_window("session")
    finally:
        sampler.stop()
        wall_s = time.monotonic() - wall_before
        process_cpu_s = time.process_time() - cpu_before
        backend.close()
    spans = measured_spans(events, args.warmup_steps)
    stats = sampler.stats()
    steps = step_energies(sampler.samples_between(spans[0][0] - 1.0, spans[-1][1] + 1.0),
                          [(start, end) for start, end, _ in spans], sampler.interval_s,
                          backend.source)
    step_j = [r.energy_j for r in steps if r.energy_j is not None]
    return {
        "events": events, "sps": throughput_sps(spans), "median_sps": median_step_sps(spans),
        "achieved_interval_s": stats.achieved_interval_s, "reads": stats.reads,
        "failures": stats.failures, "thread_cpu_s": stats.cpu_s, "process_cpu_s": process_cpu_s,
        "wall_s": wall_s, "session_j": session.energy_j, "coverage": session.coverage,
        "source": session.source, "step_j_mean": statistics.mean(step_j) if step_j else None,
    }


def other_cpu_pct(busy_before: int, times_before: os.times_result, started: float) -> float:
    """CPU used by processes other than this bench and its workers, in % of one core.

    The machine may be shared; anything running beside the bench skews both arms.
    """
    busy_s = (read_cpu_ticks(Path("/"))[0] - busy_before) / os.sysconf("SC_CLK_TCK")
    now = os.times()
    ours_s = sum(now[i] - times_before[i] for i in range(4))  # user, system, children's
    return round(100.0 * max(0.0, busy_s - ours_s) / (time.monotonic() - started), 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    parser.add_argument("--model", default="densenet40")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps skipped first")
    parser.add_argument("--pairs", type=int, default=3, help="without/with pairs (ABAB...)")
    parser.add_argument("--backend", default="estimate", help="telemetry backend to sample")
    parser.add_argument("--interval-ms", type=float, default=10.0)
    args = parser.parse_args()
    started = time.monotonic()
    busy_before, times_before = read_cpu_ticks(Path("/"))[0], os.times()
    without, without_median, with_sampler = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_telemetry-") as tmp:
        job_path = write_job(Path(tmp), args.model, args.batch_size,
                             args.warmup_steps + args.steps)
        for _ in range(args.pairs):
            spans = measured_spans(run_worker(job_path), args.warmup_steps)
            without.append(throughput_sps(spans))
            without_median.append(median_step_sps(spans))
            with_sampler.append(run_with_sampler(job_path, args))
    start_event = next(e for e in with_sampler[-1]["events"] if e["event"] == "start")
    sps_without = statistics.mean(without)
    sps_with = statistics.mean(run["sps"] for run in with_sampler)
    wall_s = sum(run["wall_s"] for run in with_sampler)
    report = {
        "machine": machine(),
        "tensorflow": start_event.get("tensorflow"),
        "model": args.model, "batch_size": args.batch_size,
        "measured_steps": args.steps, "warmup_steps": args.warmup_steps,
        "order": "ABAB (A without sampler, B with)", "pairs": args.pairs,
        "backend": with_sampler[-1]["source"], "interval_s": args.interval_ms / 1000.0,
        "sps_without": [round(v, 3) for v in without],
        "sps_with": [round(run["sps"], 3) for run in with_sampler],
        "sps_without_mean": round(sps_without, 3),
        "sps_with_mean": round(sps_with, 3),
        "slowdown_pct": slowdown_pct(sps_without, sps_with),
        "per_pair_slowdown_pct": [slowdown_pct(a, b["sps"]) for a, b in zip(without, with_sampler)],
        "median_step_slowdown_pct": slowdown_pct(
            statistics.median(without_median),
            statistics.median(run["median_sps"] for run in with_sampler)),
        "run_to_run_spread_pct": round(
            100.0 * (max(without) - min(without)) / sps_without, 2),
        "sampler": {
            "achieved_interval_s": round(statistics.mean(
                run["achieved_interval_s"] for run in with_sampler), 5),
            "reads": sum(run["reads"] for run in with_sampler),
            "failures": sum(run["failures"] for run in with_sampler),
            "thread_cpu_pct_of_one_core": round(
                100.0 * sum(run["thread_cpu_s"] for run in with_sampler) / wall_s, 3),
            "process_cpu_pct_of_one_core": round(
                100.0 * sum(run["process_cpu_s"] for run in with_sampler) / wall_s, 3),
        },
        "energy_example": {
            "source": with_sampler[-1]["source"],
            "session_j": round(with_sampler[-1]["session_j"], 2),
            "coverage": round(with_sampler[-1]["coverage"], 4),
            "j_per_measured_step": round(with_sampler[-1]["step_j_mean"], 3),
        },
        "bench_wall_s": round(time.monotonic() - started, 1),
        "other_processes_cpu_pct": other_cpu_pct(busy_before, times_before, started),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model} batch {args.batch_size} on {report['machine']}: "
          f"{report['sps_without_mean']} samples/s without the sampler, "
          f"{report['sps_with_mean']} with ({report['slowdown_pct']}% slowdown; run-to-run "
          f"spread {report['run_to_run_spread_pct']}%)")
    print(f"sampler: {report['sampler']['achieved_interval_s'] * 1000:.2f} ms achieved, "
          f"{report['sampler']['thread_cpu_pct_of_one_core']}% of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
