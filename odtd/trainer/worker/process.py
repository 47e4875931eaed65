"""The trainer worker's job loop: ``python -m odtd.trainer.worker JOB.json`` runs ``main``.

See docs/worker-protocol.md; ``__main__`` hands the job to a worker server first, if one is set.

The only process that imports TensorFlow. It reads one job file, prints protocol events as JSON
lines on stdout and exits: 0 done (``ok`` or ``interrupted``), 2 error (an ``error`` event was
printed), 3 parent gone. Diagnostics and TensorFlow's logging go to stderr.

The job is validated, and its data files read, before TensorFlow is imported (``job``), so a bad
job fails in well under a second. Standard library, numpy and TensorFlow only; Python
3.6-compatible; tf.keras 2 and Keras 3 alike.

Units: memory figures are MB of 1024 * 1024 bytes; times are seconds on ``time.monotonic()``
(CLOCK_MONOTONIC, shared by every process on the machine).
"""

import importlib
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from odtd import atomic
from odtd.trainer.learning import evalcache
from odtd.trainer.learning.evaluation import evaluate, make_eval_step, offset_rows
from odtd.trainer.learning.training import train_and_evaluate
from odtd.trainer.plans.precision import resolve_precision
from odtd.trainer.protocol.digest import file_sha256
from odtd.trainer.protocol.job import BadJob, load_job
from odtd.trainer.protocol.procfs import peak_rss_mb, watch_parent
from odtd.trainer.worker import forkserver
from odtd.trainer.worker.data import (
    load_dataset,
    load_device_mask,
    load_device_split,
    load_groups,
    load_offset_rows,
    load_prior_data,
)
from odtd.trainer.worker.export import export_model

EXIT_ERROR = 2
_STARTED_AT = time.monotonic()
# Set before TensorFlow is imported, unless the environment already has them: TensorFlow's log
# kept to warnings, and its own best-fit allocator for CPU tensors rather than malloc, so freed
# activations are reused in place rather than spread over malloc's arenas (docs/memory.md).
# (One operation at a time, TF_NUM_INTEROP_THREADS=1, lowered DenseNet40's recomputed peak by
# 50 MB but spread VGG16's at 128x128 from 2.0 to 3.1 GB: not a default; docs/memory.md.)
ENVIRONMENT_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_CPU_ALLOCATOR_USE_BFC": "true"}
# The worker's modules that import TensorFlow or Keras: a worker server imports them before it
# forks (``WorkerProgram``), ``odtctl doctor`` checks they import (``stack``).
WORKER_MODULES = tuple("odtd.trainer." + name for name in (
    "learning.averaging", "learning.batchnorm", "learning.distill", "models.imported",
    "models.networks", "models.suite", "plans.dense_blocks", "plans.fused_batchnorm",
    "plans.recompute"))


class BadModel(Exception):
    """The user's model file is refused (``import`` mode); the message names the file and why."""


def emit(event: str, **fields: Any) -> None:
    """Print one protocol event as a JSON line on stdout and flush it.

    Non-finite floats (a diverged loss) are printed as null, keeping every line valid JSON.
    """
    fields["event"] = event
    print(json.dumps(_finite(fields), allow_nan=False), flush=True)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_weights(weights: List[np.ndarray], path: str) -> None:
    """Write weights as ``w0000``, ``w0001``, ... to ``path`` atomically (temp, fsync, rename)."""
    with atomic.staged(path) as temp_path:
        with open(temp_path, "wb") as out:
            np.savez(out, **{"w{:04d}".format(i): array for i, array in enumerate(weights)})


def read_weights(path: str, expected: List[np.ndarray], names: List[str]) -> List[np.ndarray]:
    """Read a weights ``.npz`` and check it against the model's current weights.

    Raises:
        BadJob: Missing or extra arrays, or a shape that differs from the model's.
    """
    keys = ["w{:04d}".format(i) for i in range(len(expected))]
    try:
        with np.load(path, allow_pickle=False) as arrays:
            if sorted(arrays.files) != keys:
                raise BadJob("weights_in {} holds {} arrays; the model has {} weights".format(
                    path, len(arrays.files), len(keys)))
            weights = [arrays[key] for key in keys]
    except (OSError, ValueError) as error:
        raise BadJob("weights_in: cannot read {}: {}".format(path, error)) from None
    for index, (array, current) in enumerate(zip(weights, expected)):
        if array.shape != current.shape:
            raise BadJob("weights_in {}: w{:04d} ({}) has shape {}, the model needs {}".format(
                path, index, names[index], array.shape, current.shape))
    return weights


def configure_gpus(tf: Any, memory_limit_mb: Optional[int]) -> bool:
    """Set GPU memory growth, or a memory limit, before anything touches the GPU.

    Returns:
        Whether a GPU is visible (no-op and False on a CPU-only machine).
    """
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        if memory_limit_mb is None:
            tf.config.experimental.set_memory_growth(gpu, True)
        else:
            tf.config.set_logical_device_configuration(
                gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)])
    return bool(gpus)


def without_plotting() -> None:
    """Keep Keras from importing matplotlib in this process: the worker never draws.

    Keras 3 imports matplotlib for its plotting helpers whenever it is installed (odtd's
    ``plot`` command installs it), which cost about 2.5 s of every worker's start on the
    development machine (``import tensorflow`` 10.1 s -> 7.6 s, measured side by side on a
    loaded machine); without it those helpers are unavailable (Keras catches the ImportError).
    A ``None`` entry in ``sys.modules`` makes the import fail at once.
    """
    if "matplotlib" not in sys.modules:
        sys.modules["matplotlib"] = None  # type: ignore[assignment]


def seed_everything(tf: Any, seed: int) -> None:
    """Seed Python's, numpy's and TensorFlow's random numbers (and Keras 3's own) with ``seed``.

    ``keras.utils.set_random_seed`` does all of it from TensorFlow 2.7 on; tf.keras 2.6 lacks
    it, so there the three are seeded one by one, as it would.
    """
    set_random_seed = getattr(tf.keras.utils, "set_random_seed", None)
    if set_random_seed is not None:
        set_random_seed(seed)
        return
    import random

    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)


def run(job: Dict[str, Any], data: Dict[str, Tuple[np.ndarray, np.ndarray]],
        should_stop: Callable[[], bool]) -> None:
    """Run a validated job, printing its events; the caller turns exceptions into error events.

    Args:
        job: From ``load_job``.
        data: ``train_data`` / ``validation_data`` -> ``(x, y)`` from ``load_dataset``.
        should_stop: True once SIGUSR1 asked for a stop at the next step boundary.
    """
    without_plotting()
    import tensorflow as tf

    from odtd.trainer.models import imported, networks

    gpu_visible = configure_gpus(tf, job["gpu_memory_limit_mb"])
    precision, precision_reason = resolve_precision(job["precision"], gpu_visible, tf,
                                                    job["precision_probe"])
    tf.keras.mixed_precision.set_global_policy(
        "float32" if precision == "fp32" else precision)
    emit("start", pid=os.getpid(), python=".".join(map(str, sys.version_info[:3])),
         tensorflow=tf.__version__, keras=imported.keras_version(tf), precision=precision,
         precision_reason=precision_reason, t=time.monotonic())

    seed_everything(tf, job["seed"])
    mode = job["mode"]
    result = {
        "status": "ok", "accuracy_before": None, "accuracy_after": None,
        "per_class_before": None, "per_class_after": None, "steps": 0, "samples": 0,
        "weights_out": None, "train_seconds": 0.0, "recalibrate_seconds": None,
        "precision": precision, "precision_reason": precision_reason,
    }  # type: Dict[str, Any]
    if mode == "import":
        model, described = import_model(tf, job)
        result.update(described)
    else:
        model = networks.build_model(job)
    names = [(getattr(v, "path", None) or v.name).split(":")[0] for v in model.weights]
    result.update(param_count=int(model.count_params()), weight_names=names)
    served_weights = None
    if job["served_weights"] is not None:
        served_weights = read_weights(job["served_weights"], model.get_weights(), names)
    if job["weights_in"] is not None:
        model.set_weights(read_weights(job["weights_in"], model.get_weights(), names))
    scored_after = {}  # type: Dict[str, np.ndarray]
    if mode == "evaluate":
        result.update(_evaluate_only(tf, job, model, data, should_stop))
    elif mode == "export":
        result.update(export_model(tf, job, model))
    elif mode in ("train", "profile"):
        keep_trained = None if job["trained_out"] is None or mode != "train" else \
            (lambda weights: write_weights(weights, job["trained_out"]))
        result.update(train_and_evaluate(tf, job, model, precision, data, should_stop, emit,
                                         served_weights, scored_after, keep_trained))
    if result["status"] == "ok" and mode not in ("profile", "export") \
            and job["weights_out"] is not None:
        write_weights(model.get_weights(), job["weights_out"])
        result["weights_out"] = job["weights_out"]
        if job["eval_cache_out"] is not None and scored_after:
            # Keyed by the file just written: if the session promotes it, the next session
            # finds the new served model's results already there.
            evalcache.save(job["eval_cache_out"], file_sha256(job["weights_out"]),
                           precision, **scored_after)
    result["peak_rss_mb"] = peak_rss_mb()
    result["tf_peak_memory_mb"] = (
        tf.config.experimental.get_memory_info("GPU:0")["peak"] / (1024.0 * 1024.0)
        if gpu_visible else None)
    result["duration_s"] = time.monotonic() - _STARTED_AT
    emit("result", **result)


def _evaluate_only(tf: Any, job: Dict[str, Any], model: Any,
                   data: Dict[str, Tuple[np.ndarray, np.ndarray]], should_stop: Callable[[], bool]
                   ) -> Dict[str, Any]:
    """Score the loaded weights once on ``validation_data`` (reported as the "after" figures)."""
    x, y = data["validation_data"]
    groups = data["validation_groups"]
    offset = None if job["logit_offset"] is None else (
        np.asarray(job["logit_offset"], np.float32),
        offset_rows(groups, data.get("validation_offset_rows"), len(y)))
    scores = evaluate(make_eval_step(tf, model, job), x, y, len(job["classes"]),
                      job["eval_batch_size"] or job["batch_size"], should_stop, groups,
                      offset=offset)
    if scores is None:
        return {"status": "interrupted"}
    scores.pop("correct")
    scores.pop("losses")
    emit("eval", phase="after", **scores)
    return {"status": "ok", "accuracy_after": scores["accuracy"],
            "per_class_after": scores["per_class"], "by_group_after": scores["by_group"]}


def _check_classes(path: str, outputs: int, classes: List[str]) -> None:
    """BadModel unless the built model has one output per class name."""
    if outputs != len(classes):
        raise BadModel("{}: the model has {} outputs but odtd has {} class names ({}); pass "
                       "--classes with {} names, in the order of the model's outputs".format(
                           path, outputs, len(classes),
                           ",".join(classes[:4]) + (",..." if len(classes) > 4 else ""),
                           outputs))


def import_model(tf: Any, job: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
    """Build the user's model (``model_file``), screened, with its weights; describe it.

    Writes the screened configuration to ``architecture_out`` (what later jobs build from) and
    keeps a copy of the file as it was given at ``original_out``.

    Raises:
        BadModel: the file is refused; the message names the file, the layer and why.
    """
    from odtd.trainer.modelfile import keras_dialects, model_file
    from odtd.trainer.models import imported

    path = job["model_file"]
    try:
        info, summary = model_file.read_screened(path, job["input_size"])
    except model_file.ModelFileError as error:
        raise BadModel(str(error)) from None
    # Written before building: Keras's deserializer consumes parts of the dict it is given.
    with open(job["architecture_out"], "w") as handle:
        json.dump(info, handle)
    try:
        model = imported.build_from_config(tf, info["config"])
        imported.copy_weights(model, path, info["format"])
    except (ValueError, keras_dialects.ConversionError, model_file.ModelFileError) as error:
        raise BadModel("{}: {}".format(path, error)) from None
    _check_classes(path, int(model.outputs[0].shape[-1]), job["classes"])
    shutil.copyfile(path, job["original_out"])
    return model, {"input_shape": [int(size) for size in summary["input_shape"]],
                   "output": summary["output"], "file_format": info["format"],
                   "file_keras_version": info["keras_version"], "dialect": summary["dialect"],
                   "rescales_input": summary["rescales_input"],
                   "arithmetic_layers": info["arithmetic_layers"],
                   "batchnorm_layers": len(imported.batchnorm_layers(tf, model))}


def main(argv: Optional[List[str]] = None,
         watch: Callable[[int], None] = watch_parent) -> int:
    """Run the job named on the command line; return the exit status (0, 2 or 3).

    ``watch(parent_pid)`` starts watching the job's ``parent_pid`` (the fork server passes its
    own way of seeing the parent).
    """
    stop_requested = threading.Event()
    # First thing, so a SIGUSR1 during TensorFlow's import does not kill the process.
    signal.signal(signal.SIGUSR1, lambda signum, frame: stop_requested.set())
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) != 1:
            raise BadJob("usage: python -m odtd.trainer.worker JOB.json")
        job = load_job(args[0])
        if job["parent_pid"] is not None:
            watch(job["parent_pid"])
        data = {}
        if job["mode"] in ("train", "profile", "evaluate"):
            for key in ("train_data", "validation_data"):
                if job[key] is not None:
                    data[key] = load_dataset(key, job[key], job["input_shape"],
                                             len(job["classes"]))
            if "validation_data" in data:  # each image's group (acceptance, reference), if any
                count = len(data["validation_data"][1])
                data["validation_groups"] = load_groups(job["validation_data"], count)
                data["validation_offset_rows"] = load_offset_rows(job["validation_data"], count)
            mask = None  # which training images the device saw (BatchNorm, distillation, priors)
            device_images = job["prior_correction"] or job["pseudo_labels"] is not None
            if (job["bn_device_share"] is not None or job["distill"] or device_images) \
                    and job["train_data"]:
                mask = load_device_mask(job["train_data"], len(data["train_data"][1]))
            if mask is not None and device_images:  # the priors' EM and the pseudo-labels read them
                data["priors"] = load_prior_data(job["train_data"], data["train_data"][0],
                                                 data["train_data"][1], mask)
            if mask is not None and job["bn_device_share"] is not None:
                data["device_split"] = load_device_split(
                    job["train_data"], data["train_data"][0], mask,
                    data["train_data"][1] if job["bn_class_balanced"] else None)
            if mask is not None and job["distill"]:
                data["rehearsed"] = ~mask
        for name, value in ENVIRONMENT_DEFAULTS.items():
            os.environ.setdefault(name, value)
        run(job, data, stop_requested.is_set)
    except BadJob as error:
        emit("error", kind="bad_job", message=str(error))
        return EXIT_ERROR
    except BadModel as error:
        emit("error", kind="bad_model", message=str(error))
        return EXIT_ERROR
    except MemoryError as error:
        emit("error", kind="oom", message="MemoryError: {}".format(error))
        return EXIT_ERROR
    except Exception as error:  # every failure must reach the caller as an event
        tf = sys.modules.get("tensorflow")
        if tf is not None and isinstance(error, tf.errors.ResourceExhaustedError):
            emit("error", kind="oom", message=str(error).strip().split("\n")[0])
            return EXIT_ERROR
        traceback.print_exc()
        emit("error", kind="exception", message="{}: {}".format(type(error).__name__, error))
        return EXIT_ERROR
    return 0



class WorkerProgram(forkserver.Program):
    """The worker as a fork server's program (``forkserver.WORKER_PROGRAM``)."""

    def environment_defaults(self) -> Dict[str, str]:
        """The worker's own (``ENVIRONMENT_DEFAULTS``)."""
        return dict(ENVIRONMENT_DEFAULTS)

    def prepare(self) -> None:
        """Import TensorFlow and the worker's modules (no operation run)."""
        without_plotting()
        import tensorflow  # noqa: F401  (what the forks save)

        for module in WORKER_MODULES:
            importlib.import_module(module)

    def run(self, args: List[str], watch: Callable[[int], None]) -> int:
        """Run the job named by ``args`` as ``main`` does, its clock started at the fork."""
        global _STARTED_AT
        sys.argv = [__file__] + args
        _STARTED_AT = time.monotonic()  # the job's clock starts at the fork
        return main(args, watch)
