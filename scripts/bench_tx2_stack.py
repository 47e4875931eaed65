#!/usr/bin/env python3
"""What differs on a TX2's software stack: the worker on old Pythons and TensorFlows, side by side.

For each worker interpreter (by default `make test-tx2`'s: Python 3.6 with TensorFlow 2.6.2, 3.7
with 2.7.4, and this process's own, .venv's), in one run on one machine:

- ``import tensorflow``: wall seconds, the median of ``--imports`` fresh interpreters (matplotlib
  kept out, as the worker keeps it out);
- DenseNet40's training step, fp32, at each ``--batch-sizes``: the real worker in profile mode
  (``odtd.trainer.protocol.launch.run_job``, as ``odtctl profile`` runs it), samples/s at the median step
  after the 3 warm-up steps, and the worker's peak RSS;
- what precision ``auto`` resolves to there and why, and whether recomputation (``recompute: 1``)
  runs there: a profile job each, at the first batch size;
- pooling first: DenseNet40's transitions run pooling first (``pool_first.PoolFirst``), the largest
  difference from the plain model's output on the same images;
- an imported model's exactness: a user's Keras 3 ``.keras`` and tf.keras 2 ``.h5`` (tests/fixtures:
  probe images and what the Keras that wrote them predicted) imported by the worker, exported to
  ``.h5``, loaded by that stack's plain Keras: the largest difference from the writer's predictions.

    python scripts/bench_tx2_stack.py --json [--batch-sizes 16,64] [--steps 8]
        [--python 3.6/TF2.6=.venv-tx2-py36/bin/python ...]

Prints JSON with ``--json`` (``machine``, ``commit``, ``stacks``: one object per interpreter),
else a table. Run it on an otherwise idle machine: every figure is wall time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from odtd.config import TrainerConfig
from odtd.errors import TrainerFailed
from odtd.profiling.sweep import cpu_description
from odtd.trainer.protocol.job import make_job
from odtd.trainer.protocol.launch import WARMUP_STEPS, run_job

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "keras"
IMPORTED = (("keras3_cnn_softmax.keras", FIXTURES / "k3" / "cnn_softmax.keras", 4),
            ("keras2_gray_logits.h5", FIXTURES / "k2" / "gray_logits.h5", 3))
CLASSES = [str(i) for i in range(10)]
SHAPE = [32, 32, 3]
TIME_IMPORT = ("import sys, time; sys.modules['matplotlib'] = None; start = time.perf_counter(); "
               "import tensorflow; print(time.perf_counter() - start)")
POOL_FIRST = r"""
import json, numpy as np, tensorflow as tf
from odtd.trainer.models import networks
from odtd.trainer.plans.pool_first import PoolFirst
model = networks.build("densenet40", 10, [32, 32, 3])
swapped = PoolFirst.of(tf, model)
x = tf.constant(np.random.default_rng(0).random((8, 32, 32, 3), dtype=np.float32))
gap = float(np.abs(swapped(x, training=False).numpy() - model(x, training=False).numpy()).max())
print(json.dumps({"pairs": len(swapped.swapped), "max_abs_diff": gap}))
"""
PREDICT = r"""
import json, sys, numpy as np
try:
    import keras
    load = keras.models.load_model
except ImportError:
    import tensorflow as tf
    load = tf.keras.models.load_model
ref = np.load(sys.argv[2])
out = load(sys.argv[1], compile=False).predict(ref["x"].astype("float32"), verbose=0)
print(json.dumps(float(np.abs(out - ref["y"]).max())))
"""


def quiet_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "ODTD_", "TF_NUM_"))}
    return dict(env, TF_CPP_MIN_LOG_LEVEL="2", **extra)


def in_stack(python: str, code: str) -> str:
    """Run ``code`` under ``python`` with this checkout's odtd on its path; its last line."""
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=900,
                          env=quiet_env(PYTHONPATH=str(REPO)), cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    return proc.stdout.strip().splitlines()[-1]


def profile(python: str, work: Path, batch_size: int, steps: int, **keys) -> dict:
    """One DenseNet40 profile job: samples/s after the warm-up, peak RSS, what ran."""
    total = WARMUP_STEPS + steps
    rng = np.random.default_rng(0)
    data = work / "train.npz"
    np.savez(data, x=rng.integers(0, 256, (batch_size * total, *SHAPE), dtype=np.uint8),
             y=rng.integers(0, 10, batch_size * total).astype(np.int64))
    job = make_job("profile", "densenet40", CLASSES, SHAPE, train_data=str(data),
                   batch_size=batch_size, max_steps=total, optimizer="sgd", learning_rate=0.01,
                   momentum=0.9, precision_probe=str(work / "probe.json"), **keys)
    started = {}
    try:
        result, spans, peak_mb = run_job(TrainerConfig(python=python).command(), job, work / "job",
                                         lambda m: started.update(m) if m.get("event") == "start"
                                         else None)
    except TrainerFailed as error:
        return {"ok": False, "error": str(error)}
    durations = [s["end"] - s["start"] for s in spans[WARMUP_STEPS:]]
    return {"ok": True, "samples_per_s": round(batch_size / statistics.median(durations), 2),
            "peak_rss_mb": round(peak_mb, 1), "precision": started.get("precision"),
            "precision_reason": started.get("precision_reason")}


def imported_exactness(python: str, work: Path) -> dict:
    """Each user model file imported, exported to .h5 and predicted by this stack's Keras."""
    command, found = TrainerConfig(python=python).command(), {}
    for name, path, classes in IMPORTED:
        folder = work / name
        folder.mkdir()
        names = [str(i) for i in range(classes)]
        try:
            result, _, _ = run_job(command, make_job(
                "import", "user", names, None, model_file=str(path),
                weights_out=str(folder / "v0.npz"), architecture_out=str(folder / "arch.json"),
                original_out=str(folder / ("original" + path.suffix))), folder / "import")
            run_job(command, make_job(
                "export", "user", names, result["input_shape"], output=result["output"],
                input_scale="0-255", architecture=str(folder / "arch.json"),
                weights_in=str(folder / "v0.npz"), export_to=str(folder / "v0.h5")),
                folder / "export")
            proc = subprocess.run([python, "-c", PREDICT, str(folder / "v0.h5"),
                                   str(path.with_suffix(".ref.npz"))], capture_output=True,
                                  text=True, env=quiet_env(), timeout=600)
            found[name] = (json.loads(proc.stdout.splitlines()[-1]) if proc.returncode == 0
                           else "error: " + proc.stderr.strip().splitlines()[-1])
        except TrainerFailed as error:
            found[name] = f"error: {error}"
    return found


def measure(label: str, python: str, args: argparse.Namespace) -> dict:
    print(f"{label}: {python}", file=sys.stderr, flush=True)
    imports = [float(in_stack(python, TIME_IMPORT)) for _ in range(args.imports)]
    versions = json.loads(in_stack(python, (
        "import json, sys, numpy, tensorflow as tf; from odtd.trainer.models.imported import "
        "keras_version; print(json.dumps({'python': '%d.%d.%d' % sys.version_info[:3], "
        "'tensorflow': tf.__version__, 'keras': keras_version(tf), 'numpy': numpy.__version__}))")))
    stack = dict(label=label, interpreter=python, **versions,
                 import_tensorflow_s=round(statistics.median(imports), 2), densenet40={})
    with tempfile.TemporaryDirectory(prefix="bench_tx2-") as tmp:
        work = Path(tmp)
        for size in args.batch_sizes:
            print(f"  densenet40 fp32 batch {size}", file=sys.stderr, flush=True)
            stack["densenet40"][str(size)] = profile(python, work, size, args.steps)
        first = args.batch_sizes[0]
        auto = profile(python, work, first, 1, precision="auto")
        stack["precision_auto"] = {"resolved": auto.get("precision"),
                                   "reason": auto.get("precision_reason"),
                                   "error": auto.get("error")}
        stack["recompute"] = profile(python, work, first, args.steps, recompute=1.0)
        try:
            stack["pool_first"] = json.loads(in_stack(python, POOL_FIRST))
        except RuntimeError as error:
            stack["pool_first"] = {"error": str(error)}
        stack["imported_max_abs_diff"] = imported_exactness(python, work)
    return stack


def default_stacks() -> list:
    stacks = [("3.6/TF 2.6", REPO / ".venv-tx2-py36" / "bin" / "python"),
              ("3.7/TF 2.7", REPO / ".venv-tx2-py37" / "bin" / "python")]
    here = "{}.{}".format(*sys.version_info[:2])
    return [(label, str(path)) for label, path in stacks if path.exists()] + [
        (f"{here}/this venv", sys.executable)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--steps", type=int, default=8, help="measured steps after the warm-up")
    parser.add_argument("--imports", type=int, default=3, help="fresh `import tensorflow` runs")
    parser.add_argument("--python", action="append", metavar="LABEL=PATH",
                        help="a worker interpreter (repeatable; default: make test-tx2's and this)")
    args = parser.parse_args()
    args.batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    stacks = ([tuple(item.split("=", 1)) for item in args.python] if args.python
              else default_stacks())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    report = {"machine": cpu_description(), "commit": commit, "load_average_1m": [
        round(os.getloadavg()[0], 2)], "stacks": [measure(label, python, args) for label, python in stacks]}
    report["load_average_1m"].append(round(os.getloadavg()[0], 2))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("{} at {}".format(report["machine"], commit))
    for stack in report["stacks"]:
        rows = ", ".join("batch {}: {} samples/s, {} MB".format(
            size, r.get("samples_per_s"), r.get("peak_rss_mb")) for size, r in
            stack["densenet40"].items())
        print("{label} (Python {python}, TF {tensorflow}): import {import_tensorflow_s} s; "
              .format(**stack) + rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
