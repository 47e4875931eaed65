#!/usr/bin/env python3
"""Benchmark what the 10 ms telemetry sampler costs a training session.

One run of the real trainer worker (``python -m odtd.trainer.worker JOB.json``, profile mode,
random uint8 data) trains densenet40 at batch 16 while this process, standing in for the
daemon, switches a sampler thread on and off in alternating blocks of steps (off, on, off, on,
...; after 3 warm-up steps). Each step's span (on the shared monotonic clock) is classed by
whether the sampler ran for all of it or none of it; a step that straddles a switch is dropped.
Interleaving within one process cancels what separate runs cannot: the machine's speed drifts by
more than the effect being measured (on a 2-core VM, 20% between whole runs).

Reported: training throughput with and without the sampler and the slowdown in percent (of
all classed steps, and per adjacent off/on block pair with its mean, median and a 95% interval);
the sampler's achieved mean interval; its CPU cost as the sampler thread's own CPU time
(``time.thread_time()`` inside the thread) over the time it ran; the CPU other processes used
meanwhile (a shared machine skews both arms); and, for illustration, the mean energy of a
sampled step.

    python scripts/bench_telemetry.py [--json] [--steps 240] [--block-steps 12] [--backend estimate]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from odtd.config import TelemetryConfig  # noqa: E402
from odtd.profiling.sweep import cpu_description  # noqa: E402
from odtd.telemetry import Sampler, open_backend  # noqa: E402
from odtd.telemetry.estimate import read_cpu_ticks  # noqa: E402
from odtd.trainer.protocol.job import make_job  # noqa: E402

NUM_CLASSES = 10
INPUT_SHAPE = (32, 32, 3)
SAMPLES = 512
PRECISION = "fp32"


def write_job(workdir: Path, model: str, batch_size: int, max_steps: int) -> Path:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (SAMPLES, *INPUT_SHAPE), dtype=np.uint8)
    y = rng.integers(0, NUM_CLASSES, SAMPLES).astype(np.int64)
    np.savez(workdir / "train.npz", x=x, y=y)
    job = make_job("profile", model, [f"class{i}" for i in range(NUM_CLASSES)], INPUT_SHAPE,
                   train_data=str(workdir / "train.npz"), batch_size=batch_size, epochs=1,
                   max_steps=max_steps, optimizer="sgd", learning_rate=0.01, momentum=0.9,
                   parent_pid=os.getpid(), precision=PRECISION)
    path = workdir / "job.json"
    path.write_text(json.dumps(job))
    return path


class SwitchedSampler:
    """A sampler this process switches on and off, remembering when and adding up its stats."""

    def __init__(self, backend_name: str, interval_s: float, nice_increment: int) -> None:
        self.backend = open_backend(backend_name)
        self.sampler = Sampler(self.backend, interval_s=interval_s, nice_increment=nice_increment)
        self.switches = [(time.monotonic(), False)]  # (t_mono once switched, running after)
        self.reads = self.failures = 0
        self.cpu_s = self.on_s = 0.0
        self.intervals = []

    def switch(self, on: bool) -> None:
        if on == self.sampler.running:
            return
        if on:
            # Stamped before the thread starts and (below) after it stopped, so a step classed
            # "without" never overlaps the sampler running.
            self.switches.append((time.monotonic(), True))
            self.sampler.start()
        else:
            self.sampler.stop()
            stats = self.sampler.stats()
            self.reads, self.failures = self.reads + stats.reads, self.failures + stats.failures
            self.cpu_s += stats.cpu_s
            self.on_s += time.monotonic() - self.switches[-1][0]
            if stats.achieved_interval_s is not None:
                self.intervals.append((stats.samples, stats.achieved_interval_s))
            self.switches.append((time.monotonic(), False))

    def state_during(self, start: float, end: float):
        """True/False if the sampler ran for all/none of ``[start, end]``; None if it switched."""
        state = None
        for t_switch, running in self.switches:
            if t_switch <= start:
                state = running
            elif t_switch < end:
                return None
        return state

    def close(self) -> None:
        self.switch(False)
        self.backend.close()


def run_switched(job_path: Path, args: argparse.Namespace, sampler: SwitchedSampler) -> list:
    """Run the worker; switch the sampler every ``block_steps`` steps; return its events."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    events = []
    with tempfile.TemporaryFile("w+") as stderr:
        worker = subprocess.Popen([sys.executable, "-m", "odtd.trainer.worker", str(job_path)],
                                  cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                  text=True)
        try:
            for line in worker.stdout:
                if not line.startswith("{"):
                    continue
                event = json.loads(line)
                events.append(event)
                if event["event"] == "step":
                    done = event["index"] + 1 - args.warmup_steps
                    sampler.switch(done >= 0 and (done // args.block_steps) % 2 == 1)
                    if event["index"] % 20 == 0:
                        print(f"step {event['index']} of {args.warmup_steps + args.steps}",
                              file=sys.stderr, flush=True)
        finally:
            sampler.switch(False)
            code = worker.wait()
        errors = [e["message"] for e in events if e["event"] == "error"]
        if code != 0 or errors:
            stderr.seek(0)
            raise RuntimeError(f"worker exited {code}: {errors or stderr.read()[-2000:]}")
    return events


def blocks(events: list, args: argparse.Namespace, sampler: SwitchedSampler) -> dict:
    """Group the classed measured steps by block: ``{block: (running, [(start, end, size)])}``.

    Even blocks ran without the sampler, odd ones with it; a step that straddled a switch is
    dropped, and a step classed against its block's plan is a bug worth failing on.
    """
    grouped = {}
    for e in events:
        if e["event"] != "step" or e["index"] < args.warmup_steps:
            continue
        running = sampler.state_during(e["start"], e["end"])
        if running is None:
            continue
        block = (e["index"] - args.warmup_steps) // args.block_steps
        if running != (block % 2 == 1):
            raise RuntimeError(f"step {e['index']} ran {'with' if running else 'without'} the "
                               f"sampler in block {block}")
        grouped.setdefault(block, (running, []))[1].append((e["start"], e["end"], e["batch_size"]))
    return grouped


def sps(spans: list) -> float:
    """Samples per second of training time (the sum of the steps' own durations)."""
    return sum(size for _, _, size in spans) / sum(end - start for start, end, _ in spans)


def slowdown_pct(without: float, with_sampler: float) -> float:
    return round(100.0 * (without - with_sampler) / without, 2)


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
    parser.add_argument("--steps", type=int, default=240, help="measured steps")
    parser.add_argument("--block-steps", type=int, default=12,
                        help="steps per block; blocks alternate sampler off and on")
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps skipped first")
    parser.add_argument("--backend", default="estimate", help="telemetry backend to sample")
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--sampler-nice", type=int, default=TelemetryConfig().sampler_nice,
                        help="nice increment of the sampler thread (the daemon's default: "
                             "%(default)s)")
    args = parser.parse_args()
    if args.steps < 2 * args.block_steps or args.block_steps < 2:
        parser.error("need --block-steps >= 2 and --steps >= 2 x --block-steps")
    started = time.monotonic()
    busy_before, times_before = read_cpu_ticks(Path("/"))[0], os.times()
    sampler = SwitchedSampler(args.backend, args.interval_ms / 1000.0, args.sampler_nice)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_telemetry-") as tmp:
            job_path = write_job(Path(tmp), args.model, args.batch_size,
                                 args.warmup_steps + args.steps)
            events = run_switched(job_path, args, sampler)
        grouped = blocks(events, args, sampler)
        on_spans = [span for running, spans in grouped.values() if running for span in spans]
        step_reports = sampler.sampler.span_energies([(start, end) for start, end, _ in on_spans])
        step_j = [r.energy_j for r in step_reports if r.energy_j is not None]
    finally:
        sampler.close()
    off_spans = [span for running, spans in grouped.values() if not running for span in spans]
    pairs = [slowdown_pct(sps(grouped[b][1]), sps(grouped[b + 1][1]))
             for b in sorted(grouped) if b % 2 == 0 and b + 1 in grouped]
    half_width = 1.96 * statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else None
    samples = sum(n for n, _ in sampler.intervals)
    start_event = next(e for e in events if e["event"] == "start")
    report = {
        "machine": cpu_description(),
        "tensorflow": start_event.get("tensorflow"),
        "model": args.model, "batch_size": args.batch_size, "precision": PRECISION,
        "warmup_steps": args.warmup_steps, "measured_steps": args.steps,
        "design": f"one worker run, sampler switched off/on every {args.block_steps} steps",
        "backend": sampler.backend.source, "interval_s": args.interval_ms / 1000.0,
        "steps_without": len(off_spans), "steps_with": len(on_spans),
        "steps_dropped": args.steps - len(off_spans) - len(on_spans),
        "sps_without": round(sps(off_spans), 3),
        "sps_with": round(sps(on_spans), 3),
        "slowdown_pct": slowdown_pct(sps(off_spans), sps(on_spans)),
        "block_pairs": len(pairs),
        "per_pair_slowdown_pct": pairs,
        "mean_pair_slowdown_pct": round(statistics.mean(pairs), 2),
        "median_pair_slowdown_pct": round(statistics.median(pairs), 2),
        "pair_slowdown_95ci_pct": None if half_width is None else [
            round(statistics.mean(pairs) - half_width, 2),
            round(statistics.mean(pairs) + half_width, 2)],
        "sampler": {
            "achieved_interval_s": round(sum(n * i for n, i in sampler.intervals) / samples, 5)
            if samples else None,
            "reads": sampler.reads,
            "failures": sampler.failures,
            "thread_cpu_pct_of_one_core": round(100.0 * sampler.cpu_s / sampler.on_s, 3),
            "nice_increment": args.sampler_nice,
            "sampled_steps_coverage": round(statistics.mean(r.coverage for r in step_reports), 4),
        },
        "j_per_sampled_step": round(statistics.mean(step_j), 3) if step_j else None,
        "bench_wall_s": round(time.monotonic() - started, 1),
        "other_processes_cpu_pct": other_cpu_pct(busy_before, times_before, started),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model} batch {args.batch_size} on {report['machine']}: "
          f"{report['sps_without']} samples/s without the sampler, {report['sps_with']} with "
          f"({report['slowdown_pct']}% slowdown; per block pair median "
          f"{report['median_pair_slowdown_pct']}%, 95% interval {report['pair_slowdown_95ci_pct']})")
    print(f"sampler: {report['sampler']['achieved_interval_s'] * 1000:.2f} ms achieved, "
          f"{report['sampler']['thread_cpu_pct_of_one_core']}% of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
