#!/usr/bin/env python3
"""Benchmark the trainer worker's training step against plain Keras ``model.fit``.

For each batch size, the real worker runs in profile mode (a subprocess, as the daemon runs it)
and its step spans give samples/s; then ``model.fit`` trains the same model, fresh, on the same
random uint8 data (scaled the same way, fed through a prefetched tf.data pipeline, so fit is not
handicapped), in this process, timed by a callback. This process is idle while a worker runs.
Both skip the first warm-up steps and measure the same number of steps; samples/s is the batch
size over the median step duration (a step: from fetching its batch to its loss being ready),
best of ``--rounds`` interleaved runs per side. SGD with momentum, no augmentation, on both
sides. The worker runs at ``--precision`` (default fp32; ``auto`` is what admission would run:
bfloat16 on a CPU with avx512_bf16 or amx_bf16), ``model.fit`` at each of ``--fit-precisions``
(a Keras global policy: ``fp32`` or ``mixed_bfloat16``), and the worker is compared with the
faster of them.

    python scripts/bench_trainer.py [--json] [--batch-sizes 4,16,64] [--steps 20] [--rounds 2]
    python scripts/bench_trainer.py --precision auto --fit-precisions fp32,mixed_bfloat16 \
        --batch-sizes 16,32,64

Prints ``{"machine", "tensorflow", "worker_precision", "results": [{"batch_size", "worker_sps",
"fit_sps", "fit_sps_by_precision", "ratio"}]}`` with ``--json`` (fit_sps: the fastest fit
precision; ratio = worker_sps / fit_sps; above 1 means the worker is faster), else a table.
``load_average_1m`` (before, after) shows whether something else competed for the CPU
meanwhile: the numbers are only comparable on an otherwise idle machine. Each round's figures
go to stderr as it ends (progress).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from odtd.profiling.sweep import cpu_description

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_CLASSES = 10
INPUT_SHAPE = (32, 32, 3)
SAMPLES = 512
LEARNING_RATE = 0.01
MOMENTUM = 0.9


def random_data(seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (SAMPLES, *INPUT_SHAPE), dtype=np.uint8)
    y = rng.integers(0, NUM_CLASSES, SAMPLES).astype(np.int64)
    return x, y


def throughput_sps(spans: list, batch_size: int) -> float:
    """Samples per second at the median step duration of spans [(start, end)].

    The median, not the mean: on a shared machine a burst of background load stretches a few
    steps, and both sides are measured the same way.
    """
    return batch_size / float(np.median([end - start for start, end in spans]))


def worker_sps(model: str, batch_size: int, warmup_steps: int, steps: int, workdir: Path,
               precision: str = "fp32") -> tuple:
    """Run the real worker in profile mode; (samples/s over its measured steps, precision run)."""
    from odtd.trainer.protocol.job import make_job

    job = make_job("profile", model, [f"class{i}" for i in range(NUM_CLASSES)], INPUT_SHAPE,
                   train_data=str(workdir / "train.npz"), batch_size=batch_size, epochs=1,
                   max_steps=warmup_steps + steps, optimizer="sgd", learning_rate=LEARNING_RATE,
                   momentum=MOMENTUM, precision=precision)
    job_path = workdir / f"job-{batch_size}.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                     os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "odtd.trainer.worker", str(job_path)],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    errors = [e["message"] for e in events if e["event"] == "error"]
    if run.returncode != 0 or errors:
        raise RuntimeError(f"worker exited {run.returncode}: {errors or run.stderr[-2000:]}")
    measured = [e for e in events if e["event"] == "step"][warmup_steps:]
    if {e["batch_size"] for e in measured} != {batch_size}:
        raise RuntimeError(f"worker ran batches other than {batch_size}")
    resolved = next(e["precision"] for e in events if e["event"] == "start")
    return throughput_sps([(e["start"], e["end"]) for e in measured], batch_size), resolved


def step_timer(tf):
    """A Keras callback whose ``spans`` are each training step's (start, end), monotonic s."""

    class StepTimer(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.spans = []

        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.monotonic()

        def on_train_batch_end(self, batch, logs=None):
            if logs and "loss" in logs:
                float(logs["loss"])  # wait for the step, as the worker does for its loss
            self.spans.append((self.started, time.monotonic()))

    return StepTimer()


def fit_sps(model_name: str, batch_size: int, warmup_steps: int, steps: int, x, y,
            precision: str = "fp32") -> float:
    """Train the same model with ``model.fit`` under a Keras precision policy (``fp32`` or a
    mixed one); samples/s over the same measured steps."""
    import tensorflow as tf

    from odtd.trainer.models import networks

    tf.keras.mixed_precision.set_global_policy("float32" if precision == "fp32" else precision)
    tf.keras.utils.set_random_seed(0)
    model = networks.build(model_name, NUM_CLASSES, INPUT_SHAPE)
    model.compile(
        optimizer=tf.keras.optimizers.SGD(learning_rate=LEARNING_RATE, momentum=MOMENTUM),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(y), seed=0)
        .repeat()
        .batch(batch_size)
        .map(lambda images, labels: (networks.scale_pixels(images, "0-1"), labels))
        .prefetch(tf.data.AUTOTUNE)
    )
    timer = step_timer(tf)
    model.fit(dataset, epochs=1, steps_per_epoch=warmup_steps + steps, callbacks=[timer],
              verbose=0, shuffle=False)
    return throughput_sps(timer.spans[warmup_steps:], batch_size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--model", default="densenet40")
    parser.add_argument("--batch-sizes", default="4,16,64",
                        help="comma-separated batch sizes (default 4,16,64)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps skipped first")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs per side and batch size; the best counts (default 2)")
    parser.add_argument("--precision", default="fp32",
                        help="the worker's precision: fp32 | mixed_bfloat16 | auto (default fp32)")
    parser.add_argument("--fit-precisions", default="fp32",
                        help="model.fit's precisions, comma-separated: fp32, mixed_bfloat16 "
                             "(default fp32); the worker is compared with the fastest")
    args = parser.parse_args()
    fit_precisions = args.fit_precisions.split(",")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    x, y = random_data()

    load_before = os.getloadavg()[0]
    rows, resolved = [], set()
    with tempfile.TemporaryDirectory(prefix="bench_trainer-") as tmp:
        np.savez(Path(tmp) / "train.npz", x=x, y=y)
        for size in batch_sizes:
            worker, fit = [], {precision: [] for precision in fit_precisions}
            # Interleaved rounds, best of each side: background load can only slow a run down.
            for round_ in range(1, args.rounds + 1):
                sps, precision = worker_sps(args.model, size, args.warmup_steps, args.steps,
                                            Path(tmp), args.precision)
                worker.append(sps)
                resolved.add(precision)
                done = [f"worker {sps:.1f} ({precision})"]
                for fit_precision in fit_precisions:
                    fit[fit_precision].append(fit_sps(args.model, size, args.warmup_steps,
                                                      args.steps, x, y, fit_precision))
                    done.append(f"fit {fit_precision} {fit[fit_precision][-1]:.1f}")
                print(f"batch {size}, round {round_}/{args.rounds}: samples/s "
                      + ", ".join(done), file=sys.stderr, flush=True)
            best_fit = max(max(runs) for runs in fit.values())
            rows.append({"batch_size": size, "worker_sps": round(max(worker), 2),
                         "fit_sps": round(best_fit, 2),
                         "fit_sps_by_precision": {precision: round(max(runs), 2)
                                                  for precision, runs in fit.items()},
                         "ratio": round(max(worker) / best_fit, 3)})
    import tensorflow as tf

    report = {
        "machine": cpu_description(),
        "tensorflow": tf.__version__,
        "model": args.model,
        "worker_precision": {"requested": args.precision, "ran": sorted(resolved)},
        "measured_steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "rounds": args.rounds,
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "results": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model} on {report['machine']}, TensorFlow {report['tensorflow']}, "
          f"{args.steps} measured steps after {args.warmup_steps} warm-up, best of {args.rounds}, "
          f"load average {report['load_average_1m']}; worker precision {args.precision} "
          f"({', '.join(sorted(resolved))})")
    print(f"{'batch':>6} {'worker sps':>11} " + " ".join(f"{'fit ' + p:>20}" for p in fit_precisions)
          + f" {'ratio':>7}")
    for row in report["results"]:
        fits = " ".join(f"{row['fit_sps_by_precision'][p]:>20.1f}" for p in fit_precisions)
        print(f"{row['batch_size']:>6} {row['worker_sps']:>11.1f} {fits} {row['ratio']:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
