#!/usr/bin/env python3
"""Peak memory, throughput and energy per sample of odtd's plans against plain Keras ``model.fit``.

One batch size (64 by default), side by side in one run: plain Keras ``model.fit`` in fp32 (the
control), then each of odtd's plans in the real trainer worker (profile mode, a subprocess as
the daemon runs it), alternating A B C ... A B C for ``--rounds`` rounds. Every arm runs in a
fresh process of its own, so each peak RSS (``VmHWM``) is that arm's alone. The same random
uint8 images, the same network (built by ``odtd.trainer.models.networks``), SGD with momentum, no
augmentation on either side.

Plans are named as admission names them: ``fp32``, ``fp32+recompute``, ``fp32+micro8``,
``fp32+recompute+micro16``. ``--bn frozen`` runs odtd's arms with BatchNorm frozen (the default
policy; micro-batches are exact then), ``--bn trained`` with BatchNorm trained and recalibrated
after training (DenseNet40's recipe; micro-batches would normalise each micro-batch alone, so
admission does not use them with it).

Energy per sample comes from odtd's telemetry over each arm's measured steps (on this machine
the ``estimate`` backend: CPU utilisation times a power model, an estimate and labelled so).

Peak RSS counts the pages of TensorFlow's libraries each process has touched (``RssFile``: 365
MB after ``import tensorflow`` on an AMD EPYC, 485 MB after it and building DenseNet40 on an
Intel Xeon), which the kernel can drop and read again from the files; the anonymous memory
(``RssAnon``: tensors, the heap, Python) is what a board must find. ``peak_anon_mb`` is the
largest ``RssAnon`` of the arm's processes, read from ``/proc`` every 20 ms while the arm runs
(a sample, so a spike shorter than that can be missed; the peaks of a training step last
seconds). Run enough steps: in some runs the worker's peak jumps by about 50 MB at a step among
its first 10 to 20 (TensorFlow's BFC allocator mapping one more region when fragmentation needs
it; docs/memory.md, "The heap given back, and one operation at a time"), while ``model.fit``'s
barely moves, so a short run can miss the peak a long session reaches.

    python scripts/bench_memory.py [--json] [--batch 64] [--bn frozen] [--rounds 2]

Prints ``{"machine", "tensorflow", "batch_size", "bn", "arms": [{"arm", "peak_rss_mb",
"peak_anon_mb", "samples_per_s", "energy_per_sample_j", "memory_vs_fit", "anon_vs_fit",
"throughput_vs_fit"}]}`` with ``--json`` (median over rounds of each figure; ratios against the
``keras_fit_fp32`` arm).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
from bench_trainer import step_timer

from odtd.profiling.profile import parse_plan as profile_plan
from odtd.profiling.sweep import cpu_description
from odtd.trainer.protocol.procfs import read_proc_mb

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_CLASSES = 10
INPUT_SHAPE = (32, 32, 3)
LEARNING_RATE = 0.01
MOMENTUM = 0.9
CONTROL = "keras_fit_fp32"


def fit_child(model_name: str, batch_size: int, steps: int, data: str) -> None:
    """In a fresh process: ``model.fit`` over ``steps`` batches; print spans and peak RSS."""
    from odtd.trainer.worker.process import without_plotting

    without_plotting()  # as in odtd's worker: matplotlib's import is not training memory
    import tensorflow as tf

    from odtd.trainer.models import networks
    from odtd.trainer.protocol.procfs import peak_rss_mb

    arrays = np.load(data)
    tf.keras.utils.set_random_seed(0)
    model = networks.build(model_name, NUM_CLASSES, INPUT_SHAPE)
    model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=LEARNING_RATE, momentum=MOMENTUM),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = (tf.data.Dataset.from_tensor_slices((arrays["x"], arrays["y"])).repeat()
               .batch(batch_size)
               .map(lambda images, labels: (networks.scale_pixels(images, "0-1"), labels))
               .prefetch(tf.data.AUTOTUNE))
    timer = step_timer(tf)
    model.fit(dataset, epochs=1, steps_per_epoch=steps, callbacks=[timer], verbose=0)
    print(json.dumps({"spans": timer.spans, "peak_rss_mb": peak_rss_mb()}))


def parse_plan(name: str) -> dict:
    """``fp32+recompute0.5+micro8`` -> the worker job's precision, recompute, micro_batch_size."""
    try:
        precision, recompute, micro = profile_plan(name)
    except ValueError as error:
        raise SystemExit(f"--plans: {error}") from None
    return {"precision": precision, "recompute": recompute, "micro_batch_size": micro}


def run_fit(args, data: Path, env: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--fit-child", args.model, str(args.batch),
                           str(args.warmup_steps + args.steps), str(data)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"model.fit arm exited {done.returncode}: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"spans": out["spans"][args.warmup_steps:], "peak_rss_mb": out["peak_rss_mb"]}


def run_plan(args, plan: str, data: Path, workdir: Path) -> dict:
    from odtd.config import Config
    from odtd.trainer.protocol.job import make_job
    from odtd.trainer.protocol.launch import run_job

    job = make_job("profile", args.model, [f"class{i}" for i in range(NUM_CLASSES)], INPUT_SHAPE,
                   train_data=str(data), batch_size=args.batch,
                   max_steps=args.warmup_steps + args.steps, optimizer="sgd",
                   learning_rate=LEARNING_RATE, momentum=MOMENTUM,
                   freeze_bn=args.bn == "frozen", recalibrate_bn=args.bn == "trained",
                   **parse_plan(plan))
    job_dir = workdir / plan
    job_dir.mkdir(exist_ok=True)
    _, steps, peak_mb = run_job(Config().trainer.command(), job, job_dir)
    spans = [(s["start"], s["end"]) for s in steps[args.warmup_steps:]]
    return {"spans": spans, "peak_rss_mb": peak_mb}


def summarise(arm: str, runs: list, batch_size: int) -> dict:
    """Median over rounds of peak RSS, samples/s (median step) and joules per sample."""
    peaks, anons, rates, joules = [], [], [], []
    for run in runs:
        spans = run["spans"]
        peaks.append(run["peak_rss_mb"])
        anons.append(run["peak_anon_mb"])
        rates.append(batch_size / statistics.median(end - start for start, end in spans))
        if run["energy_j"] is not None:
            joules.append(run["energy_j"] / (batch_size * len(spans)))
    return {"arm": arm, "peak_rss_mb": round(statistics.median(peaks), 1),
            "peak_anon_mb": round(statistics.median(anons), 1),
            "samples_per_s": round(statistics.median(rates), 2),
            "energy_per_sample_j": round(statistics.median(joules), 4) if joules else None,
            "rounds": {"peak_rss_mb": [round(p, 1) for p in peaks],
                       "peak_anon_mb": [round(a, 1) for a in anons],
                       "samples_per_s": [round(r, 2) for r in rates]}}


class AnonPeak:
    """The largest ``RssAnon`` (MB) of this process's descendants while in the ``with`` block."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._done.wait(self.interval_s):
            for pid in descendants(os.getpid()):
                anon = read_proc_mb("RssAnon", Path(f"/proc/{pid}/status"))
                self.peak_mb = max(self.peak_mb, anon or 0.0)


def descendants(pid: int) -> list:
    """Every live descendant of ``pid`` (``/proc/PID/task/TID/children``)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as children:
                    kids = [int(child) for child in children.read().split()]
            except OSError:
                continue
            found.extend(kids)
            queue.extend(kids)
    return found


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--fit-child":
        fit_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--model", default="densenet40", help="built-in network (default densenet40)")
    parser.add_argument("--batch", type=int, default=64, help="batch size of every arm (default 64)")
    parser.add_argument("--plans", default="fp32,fp32+recompute,fp32+micro8,fp32+recompute+micro16",
                        help="odtd's plans, comma-separated")
    parser.add_argument("--bn", choices=["frozen", "trained"], default="frozen",
                        help="odtd's BatchNorm: frozen (default policy) or trained and recalibrated "
                             "(DenseNet40's recipe)")
    parser.add_argument("--steps", type=int, default=27,
                        help="measured steps per arm (default 27: the worker's peak grows in steps "
                             "over its first 10-20 and then holds)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps skipped first")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    args = parser.parse_args()
    plans = [p for p in args.plans.split(",") if p]
    for plan in plans:
        parse_plan(plan)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    os.environ.update(PYTHONPATH=env["PYTHONPATH"])

    from odtd.config import TelemetryConfig
    from odtd.telemetry.meter import make_sampler

    sampler = make_sampler(TelemetryConfig(backend="auto"))
    sampler.start()
    runs = {arm: [] for arm in [CONTROL, *plans]}
    load_before = os.getloadavg()[0]
    try:
        with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmp:
            rng = np.random.default_rng(0)
            count = args.batch * (args.warmup_steps + args.steps)
            data = Path(tmp) / "train.npz"
            np.savez(data, x=rng.integers(0, 256, (count, *INPUT_SHAPE), dtype=np.uint8),
                     y=rng.integers(0, NUM_CLASSES, count).astype(np.int64))
            for round_index in range(args.rounds):
                for arm in runs:
                    print(f"round {round_index + 1}/{args.rounds}: {arm} ...", file=sys.stderr,
                          flush=True)
                    with AnonPeak() as anon:
                        run = run_fit(args, data, env) if arm == CONTROL else \
                            run_plan(args, arm, data, Path(tmp))
                    run["peak_anon_mb"] = anon.peak_mb
                    # Now, while the sampler's ring still holds the run's samples.
                    spans = run["spans"]
                    sampler.wait_for_sample_after(spans[-1][1], timeout_s=1.0)
                    run["energy_j"] = sampler.energy_between(spans[0][0], spans[-1][1]).energy_j
                    runs[arm].append(run)
                    print(f"  peak {run['peak_rss_mb']:.0f} MB, anonymous {anon.peak_mb:.0f} MB",
                          file=sys.stderr, flush=True)
            arms = [summarise(arm, arm_runs, args.batch) for arm, arm_runs in runs.items()]
    finally:
        sampler.stop()
    control = arms[0]
    for arm in arms:
        arm["memory_vs_fit"] = round(arm["peak_rss_mb"] / control["peak_rss_mb"], 3)
        arm["anon_vs_fit"] = round(arm["peak_anon_mb"] / control["peak_anon_mb"], 3)
        arm["throughput_vs_fit"] = round(arm["samples_per_s"] / control["samples_per_s"], 3)
    import tensorflow as tf

    report = {"machine": cpu_description(), "tensorflow": tf.__version__, "model": args.model,
              "batch_size": args.batch, "bn": args.bn, "telemetry": sampler.backend.name,
              "measured_steps": args.steps, "rounds": args.rounds,
              "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "arms": arms}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model} batch {args.batch}, odtd BatchNorm {args.bn}, on {report['machine']}, "
          f"TensorFlow {report['tensorflow']}, telemetry {report['telemetry']}")
    print(f"{'arm':<26} {'peak MB':>8} {'x fit':>6} {'anon MB':>8} {'x fit':>6} "
          f"{'samples/s':>10} {'x fit':>6} {'J/sample':>9}")
    for a in arms:
        joules = "-" if a["energy_per_sample_j"] is None else f"{a['energy_per_sample_j']:.4f}"
        print(f"{a['arm']:<26} {a['peak_rss_mb']:>8.0f} {a['memory_vs_fit']:>6.2f} "
              f"{a['peak_anon_mb']:>8.0f} {a['anon_vs_fit']:>6.2f} "
              f"{a['samples_per_s']:>10.2f} {a['throughput_vs_fit']:>6.2f} {joules:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
