"""Precision ``auto``: the worker's choice of arithmetic, measured rather than guessed.

``auto`` is ``mixed_float16`` with a GPU. On a CPU it is ``mixed_bfloat16`` only where bfloat16
is both native (``avx512_bf16`` or ``amx_bf16`` in the cpuinfo flags) and measured faster: a
CPU that has the instructions does not always run bfloat16 convolutions faster than float32 ones
(on an Intel Xeon with avx512_bf16 and no AMX, DenseNet40's training step in bfloat16 ran at
0.82-0.83x the samples/s of Keras's float32 fit). So the first ``auto`` on such a CPU times a
convolution's forward and backward pass in both (``measure_bfloat16_speedup``, about 2 s) and
keeps the verdict in the job's ``precision_probe`` file, keyed by the CPU and the TensorFlow
build; later jobs read it. Delete the file to measure again. Where the probe cannot run (a
TensorFlow with no bfloat16 convolution for this CPU, as 2.6 and 2.7 without oneDNN), ``auto`` is
fp32 and its reason quotes TensorFlow's error: ``auto`` never fails a job.

Standard library and TensorFlow (passed in) only; Python 3.6-compatible.
"""

import json
import os
import sys
import time
from typing import Any, Dict, Optional, Tuple

from odtd import atomic
from odtd.trainer.protocol.procfs import cpu_identity

BFLOAT16_FLAGS = frozenset(("avx512_bf16", "amx_bf16"))
MIN_SPEEDUP = 1.15
"""bfloat16 is chosen when its convolutions run at least this much faster than float32's: the
casts and float32 parts of a mixed-precision step (BatchNorm, the loss, the update) take some of
the convolutions' gain back."""
PROBE_SHAPES = ((16, 32, 32, 64), (16, 16, 16, 128))
"""(batch, height, width, channels) of the probe's 3x3 convolutions: a small CNN's layers."""
PROBE_ROUNDS = 3
PROBE_REPS = 4


def measure_bfloat16_speedup(tf: Any, shapes: Any = PROBE_SHAPES, rounds: int = PROBE_ROUNDS,
                             reps: int = PROBE_REPS) -> float:
    """float32 time over bfloat16 time of 3x3 convolutions' forward and backward passes.

    Both are traced first, then timed in turn ``rounds`` times (``reps`` steps each); the best
    round of each counts, so a burst of other load hits neither side alone.
    """
    steps = {}
    for dtype in (tf.float32, tf.bfloat16):
        for shape in shapes:
            channels = shape[3]
            images = tf.random.stateless_normal(shape, seed=(1, 2))
            kernel = tf.random.stateless_normal((3, 3, channels, channels), seed=(3, 4)) * 0.05
            steps[(dtype, shape)] = (_conv_step(tf, dtype), images, kernel)
    best = {tf.float32: float("inf"), tf.bfloat16: float("inf")}
    for _ in range(rounds + 1):  # the first round traces
        for dtype in best:
            started = time.perf_counter()
            for shape in shapes:
                step, images, kernel = steps[(dtype, shape)]
                for _ in range(reps):
                    step(images, kernel).numpy()
            best[dtype] = min(best[dtype], time.perf_counter() - started)
    return best[tf.float32] / best[tf.bfloat16]


def probe_errors(tf: Any) -> Tuple[type, ...]:
    """The errors of a TensorFlow that has no bfloat16 kernel for an operation on this CPU.

    A run-time error (2.6 and 2.7: "Missing 0-th output from node Conv2D", "No OpKernel was
    registered"), or a refusal while tracing.
    """
    return (tf.errors.OpError, TypeError, ValueError)


def bfloat16_error(tf: Any) -> Optional[str]:
    """Why bfloat16 convolutions cannot run here (TensorFlow's error, one line); None if they can.

    One small convolution's forward and backward pass in each precision, untimed.
    """
    try:
        measure_bfloat16_speedup(tf, shapes=((2, 8, 8, 8),), rounds=0, reps=1)
    except probe_errors(tf) as error:
        return "{}: {}".format(type(error).__name__, _first_line(error))
    return None


def _conv_step(tf: Any, dtype: Any) -> Any:
    from odtd.trainer.models.networks import compiled  # imports TensorFlow

    @compiled()
    def step(images: Any, kernel: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            x = tf.cast(images, dtype)
            w = tf.cast(kernel, dtype)
            hidden = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME"))
            out = tf.nn.conv2d(hidden, w, 1, "SAME")
            loss = tf.reduce_mean(tf.cast(out, tf.float32))
        return tape.gradient(loss, kernel)
    return step


def resolve_precision(requested: str, gpu_visible: bool, tf: Any,
                      probe_path: Optional[str] = None, cpuinfo_path: str = "/proc/cpuinfo"
                      ) -> Tuple[str, Optional[str]]:
    """Resolve the job's ``precision``: (what to run, why, for ``auto``; else None).

    Args:
        requested: The job's ``precision``; anything but ``auto`` is returned as it is.
        gpu_visible: A GPU will train (``auto``: ``mixed_float16``).
        tf: TensorFlow, to measure with.
        probe_path: The file that keeps the measured verdict (the job's ``precision_probe``);
            None measures at every ``auto``.
        cpuinfo_path: Where the CPU's name and flags are read.
    """
    if requested != "auto":
        return requested, None
    if gpu_visible:
        return "mixed_float16", "a GPU"
    name, flags = cpu_identity(cpuinfo_path)
    if not flags & BFLOAT16_FLAGS:
        return "fp32", "no bfloat16 instructions on this CPU"
    key = {"cpu": name, "flags": sorted(flags & BFLOAT16_FLAGS), "tensorflow": tf.__version__}
    verdict = _read_verdict(probe_path, key)
    if verdict is None:
        verdict = {"key": key, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            speedup = measure_bfloat16_speedup(tf)
        except probe_errors(tf) as error:
            # A TensorFlow without a bfloat16 kernel for this CPU: 2.6 and 2.7 build their
            # bfloat16 convolutions only with oneDNN, off by default there, and fail at run time
            # ("InternalError: Missing 0-th output from node Conv2D"). Kept like a measurement,
            # so later jobs of this build do not try again.
            verdict.update(precision="fp32", bfloat16_speedup=None,
                           probe_error="{}: {}".format(type(error).__name__, _first_line(error)))
        else:
            verdict.update(precision="mixed_bfloat16" if speedup >= MIN_SPEEDUP else "fp32",
                           bfloat16_speedup=round(speedup, 3))
        _write_verdict(probe_path, verdict)
    kept = "; kept in {}".format(probe_path) if probe_path else ""
    if verdict.get("probe_error"):
        return "fp32", "bfloat16 convolutions cannot run on this CPU with TensorFlow {} ({}){}" \
            .format(key["tensorflow"], verdict["probe_error"], kept)
    why = "bfloat16 convolutions measured at {:.2f}x float32's speed on this CPU{}".format(
        verdict["bfloat16_speedup"], kept)
    return verdict["precision"], why


def _first_line(error: BaseException) -> str:
    """An error's first line, without TensorFlow's "(defined at FILE:LINE)" and "[Op:...]"."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = lines[0].split(" (defined at ")[0].split("  [Op:")[0] if lines else ""
    return line[:200]


def _read_verdict(path: Optional[str], key: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as handle:
            verdict = json.load(handle)
    except (OSError, ValueError) as error:
        print("odtd worker: ignoring {} ({}); measuring again".format(path, error),
              file=sys.stderr)
        return None
    if not isinstance(verdict, dict) or verdict.get("key") != key or verdict.get(
            "precision") not in ("fp32", "mixed_bfloat16"):
        return None
    if not verdict.get("probe_error") and not isinstance(verdict.get("bfloat16_speedup"),
                                                         (int, float)):
        return None
    return verdict


def _write_verdict(path: Optional[str], verdict: Dict[str, Any]) -> None:
    if not path:
        return
    try:
        atomic.write_text(path, json.dumps(verdict, indent=1, sort_keys=True), durable=False)
    except OSError as error:  # a read-only home still trains; it measures again next time
        print("odtd worker: cannot keep the precision probe in {} ({})".format(path, error),
              file=sys.stderr)
