"""The trainer worker: ``python -m odtd.trainer.worker JOB.json`` (see docs/worker-protocol.md).

The only process that imports TensorFlow. It reads one job file, prints protocol events as JSON
lines on stdout and exits: 0 done (``ok`` or ``interrupted``), 2 error (an ``error`` event was
printed), 3 parent gone. Diagnostics and TensorFlow's logging go to stderr.

The job is validated, and its data files read, before TensorFlow is imported (``job``), so a bad
job fails in well under a second. Standard library, numpy and TensorFlow only; Python
3.6-compatible; tf.keras 2 and Keras 3 alike.

Units: memory figures are MB of 1024 * 1024 bytes; times are seconds on ``time.monotonic()``
(CLOCK_MONOTONIC, shared by every process on the machine).
"""

import json
import os
import resource
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from odtd.trainer import evalcache
from odtd.trainer.data import load_dataset, load_groups
from odtd.trainer.evaluation import evaluate, make_eval_step, open_eval_cache, paired_counts
from odtd.trainer.job import BadJob, load_job

EXIT_ERROR = 2
EXIT_PARENT_GONE = 3
PARENT_POLL_INTERVAL_S = 0.5
AUGMENT_PAD_PX = 4
_STARTED_AT = time.monotonic()


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


def watch_parent(parent_pid: int) -> None:
    """Exit with status 3 when the parent process is no longer ``parent_pid``.

    Checks once now, then from a daemon thread every ``PARENT_POLL_INTERVAL_S``. On Linux it also
    asks the kernel for SIGKILL on parent death (``PR_SET_PDEATHSIG``), whichever comes first.
    That "parent" is the thread that spawned us (prctl(2)), so the spawning thread must live as
    long as the worker.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
                print("odtd worker: prctl(PR_SET_PDEATHSIG) failed, errno {}; polling only".format(
                    ctypes.get_errno()), file=sys.stderr)
        except (OSError, AttributeError) as error:
            print("odtd worker: no prctl ({}); polling only".format(error), file=sys.stderr)

    def parent_gone() -> bool:
        if os.getppid() == parent_pid:
            return False
        print("odtd worker: parent {} is gone, exiting".format(parent_pid), file=sys.stderr)
        return True

    def poll() -> None:
        while not parent_gone():
            time.sleep(PARENT_POLL_INTERVAL_S)
        os._exit(EXIT_PARENT_GONE)

    if parent_gone():
        sys.exit(EXIT_PARENT_GONE)
    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def peak_rss_mb(status_path: str = "/proc/self/status") -> float:
    """Return this process's peak resident set size in MB (1024 * 1024 bytes).

    The larger of ``getrusage`` ``ru_maxrss`` (KiB on Linux) and ``VmHWM`` from ``status_path``.
    """
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with open(status_path) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    peak_kib = max(peak_kib, int(line.split()[1]))
    except OSError as error:
        print("odtd worker: no {} ({}); using getrusage".format(status_path, error),
              file=sys.stderr)
    return peak_kib / 1024.0


def resolve_precision(requested: str, gpu_visible: bool, cpuinfo_path: str = "/proc/cpuinfo"
                      ) -> str:
    """Resolve the job's ``precision``, turning ``auto`` into a concrete choice.

    ``auto`` is ``mixed_float16`` with a GPU, ``mixed_bfloat16`` on a CPU with native bfloat16
    (``avx512_bf16`` or ``amx_bf16`` in the cpuinfo flags), else ``fp32``.
    """
    if requested != "auto":
        return requested
    if gpu_visible:
        return "mixed_float16"
    try:
        with open(cpuinfo_path) as cpuinfo:
            flags = set()
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags.update(line.split(":", 1)[-1].split())
    except OSError as error:
        print("odtd worker: cannot read {} ({}); precision fp32".format(cpuinfo_path, error),
              file=sys.stderr)
        return "fp32"
    return "mixed_bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "fp32"


def iterate_batches(num_samples: int, batch_size: int, epochs: Optional[int],
                    max_steps: Optional[int], rng: np.random.RandomState
                    ) -> Iterator[Tuple[int, np.ndarray]]:
    """Yield ``(epoch, sample indices)`` per step, reshuffling every epoch.

    With ``epochs`` set, each epoch visits every sample once and its last batch may be short.
    With ``epochs`` None (profile mode), epochs run back to back and every batch is full, even
    when there are fewer samples than ``batch_size``, so a profile measures that batch size.
    ``max_steps`` caps the number of steps either way.
    """
    step = 0
    if epochs is not None:
        for epoch in range(epochs):
            order = rng.permutation(num_samples)
            for begin in range(0, num_samples, batch_size):
                if max_steps is not None and step >= max_steps:
                    return
                yield epoch, order[begin:begin + batch_size]
                step += 1
        return
    stream = np.empty(0, dtype=np.int64)
    consumed = 0
    while max_steps is None or step < max_steps:
        while len(stream) < batch_size:
            stream = np.concatenate([stream, rng.permutation(num_samples)])
        yield consumed // num_samples, stream[:batch_size]
        stream = stream[batch_size:]
        consumed += batch_size
        step += 1


def write_weights(weights: List[np.ndarray], path: str) -> None:
    """Write weights as ``w0000``, ``w0001``, ... to ``path`` atomically (temp, fsync, rename)."""
    temp_path = path + ".tmp"
    with open(temp_path, "wb") as out:
        np.savez(out, **{"w{:04d}".format(i): array for i, array in enumerate(weights)})
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp_path, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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


def make_rate(tf: Any, job: Dict[str, Any], total_steps: Optional[int]) -> Any:
    """Return the job's learning rate: a number, or a Keras schedule called with the step.

    With ``lr_schedule`` cosine and ``total_steps`` known, the rate decays from
    ``learning_rate`` to 0 over the job's steps: a session ends annealed, wherever it started.
    """
    if job["lr_schedule"] == "cosine" and total_steps:
        return tf.keras.optimizers.schedules.CosineDecay(job["learning_rate"], total_steps)
    return job["learning_rate"]


def make_optimizer(tf: Any, job: Dict[str, Any], precision: str, rate: Any) -> Any:
    """Build the job's optimizer at ``rate`` (``make_rate``), in a LossScaleOptimizer for float16."""
    if job["optimizer"] == "sgd":
        optimizer = tf.keras.optimizers.SGD(learning_rate=rate, momentum=job["momentum"])
    else:
        optimizer = tf.keras.optimizers.Adam(learning_rate=rate)
    if precision == "mixed_float16":
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    return optimizer


def augment_batch(tf: Any, images: Any) -> Any:
    """Flip each image horizontally at random and crop it from a 4-pixel zero-padded copy.

    Vectorised per batch (one random offset per image), for use inside a ``tf.function``.
    """
    shape = tf.shape(images)
    count, height, width = shape[0], shape[1], shape[2]
    flip = tf.random.uniform([count]) < 0.5
    images = tf.where(flip[:, None, None, None], tf.reverse(images, axis=[2]), images)
    pad = AUGMENT_PAD_PX
    padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
    top = tf.random.uniform([count], 0, 2 * pad + 1, dtype=tf.int32)
    left = tf.random.uniform([count], 0, 2 * pad + 1, dtype=tf.int32)
    rows = top[:, None] + tf.range(height)[None, :]
    cols = left[:, None] + tf.range(width)[None, :]
    padded = tf.gather(padded, rows, axis=1, batch_dims=1)
    return tf.gather(padded, cols, axis=2, batch_dims=1)


def make_train_step(tf: Any, model: Any, optimizer: Any, input_shape: List[int],
                    augment: bool) -> Callable[[Any, Any], Any]:
    """Return a compiled step ``(uint8 images, int64 labels) -> mean loss`` that updates weights.

    The input signature has a free batch dimension, so a short last batch does not retrace.
    """
    from odtd.trainer import networks

    variables = model.trainable_variables
    # tf.keras 2 and Keras 3 spell loss scaling differently; Keras 3 unscales in apply_gradients.
    legacy_scaling = hasattr(optimizer, "get_scaled_loss")
    keras3_scaling = not legacy_scaling and hasattr(optimizer, "scale_loss")

    @tf.function(input_signature=[tf.TensorSpec([None] + list(input_shape), tf.uint8),
                                  tf.TensorSpec([None], tf.int64)])
    def train_step(images: Any, labels: Any) -> Any:
        if augment:
            images = augment_batch(tf, images)
        with tf.GradientTape() as tape:
            logits = model(networks.preprocess(images), training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits))
            if legacy_scaling:
                scaled_loss = optimizer.get_scaled_loss(loss)
            elif keras3_scaling:
                scaled_loss = optimizer.scale_loss(loss)
            else:
                scaled_loss = loss
        gradients = tape.gradient(scaled_loss, variables)
        if legacy_scaling:
            gradients = optimizer.get_unscaled_gradients(gradients)
        optimizer.apply_gradients(zip(gradients, variables))
        return loss

    return train_step


def run(job: Dict[str, Any], data: Dict[str, Tuple[np.ndarray, np.ndarray]],
        should_stop: Callable[[], bool]) -> None:
    """Run a validated job, printing its events; the caller turns exceptions into error events.

    Args:
        job: From ``load_job``.
        data: ``train_data`` / ``validation_data`` -> ``(x, y)`` from ``load_dataset``.
        should_stop: True once SIGUSR1 asked for a stop at the next step boundary.
    """
    import tensorflow as tf

    from odtd.trainer import networks

    gpu_visible = configure_gpus(tf, job["gpu_memory_limit_mb"])
    precision = resolve_precision(job["precision"], gpu_visible)
    tf.keras.mixed_precision.set_global_policy(
        "float32" if precision == "fp32" else precision)
    emit("start", pid=os.getpid(), python=".".join(map(str, sys.version_info[:3])),
         tensorflow=tf.__version__, keras=getattr(tf.keras, "__version__", None),
         precision=precision, t=time.monotonic())

    tf.keras.utils.set_random_seed(job["seed"])
    num_classes = len(job["classes"])
    model = networks.build(job["model"], num_classes, job["input_shape"])
    names = [(getattr(v, "path", None) or v.name).split(":")[0] for v in model.weights]
    baseline = None
    if job["baseline_weights"] is not None:
        baseline = read_weights(job["baseline_weights"], model.get_weights(), names)
    if job["weights_in"] is not None:
        model.set_weights(read_weights(job["weights_in"], model.get_weights(), names))
    result = {
        "status": "ok", "accuracy_before": None, "accuracy_after": None,
        "per_class_before": None, "per_class_after": None, "steps": 0, "samples": 0,
        "param_count": int(model.count_params()), "weights_out": None, "weight_names": names,
        "train_seconds": 0.0, "recalibrate_seconds": None, "precision": precision,
    }
    mode = job["mode"]
    scored_after = {}  # type: Dict[str, np.ndarray]
    if mode == "evaluate":
        result.update(_evaluate_only(tf, job, model, data, should_stop))
    elif mode != "init":
        result.update(_train(tf, job, model, precision, data, should_stop, baseline, scored_after))
    if result["status"] == "ok" and mode != "profile" and job["weights_out"] is not None:
        write_weights(model.get_weights(), job["weights_out"])
        result["weights_out"] = job["weights_out"]
        if job["eval_cache_out"] is not None and scored_after:
            # Keyed by the file just written: if the session promotes it, the next session
            # finds the new current model's results already there.
            evalcache.save(job["eval_cache_out"], evalcache.file_sha256(job["weights_out"]),
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
    groups = load_groups(job["validation_data"], len(y))
    scores = evaluate(make_eval_step(tf, model, job["input_shape"]), x, y, len(job["classes"]),
                      job["eval_batch_size"] or job["batch_size"], should_stop, groups)
    if scores is None:
        return {"status": "interrupted"}
    scores.pop("correct")
    scores.pop("losses")
    emit("eval", phase="after", **scores)
    return {"status": "ok", "accuracy_after": scores["accuracy"],
            "per_class_after": scores["per_class"], "by_group_after": scores["by_group"]}


def _train(tf: Any, job: Dict[str, Any], model: Any, precision: str,
           data: Dict[str, Tuple[np.ndarray, np.ndarray]], should_stop: Callable[[], bool],
           baseline: Optional[List[np.ndarray]] = None,
           scored_after: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, Any]:
    """Evaluate before, train, evaluate after; return the result fields this produces.

    With ``baseline`` (the ``baseline_weights`` arrays) the "before" figures are that model's
    (the one the candidate must beat), and training then starts from the weights as loaded.
    ``scored_after``, if given, receives the trained model's per-sample validation results
    (``keys``, ``correct``, ``losses``: ``evalcache.save``'s arguments).
    """
    if job["freeze_bn"]:
        # A non-trainable BatchNormalization runs in inference mode in tf.keras 2 and Keras 3:
        # moving statistics, gamma and beta all stay as loaded.
        for layer in batchnorm_layers(tf, model):
            layer.trainable = False
    profiling = job["mode"] == "profile"
    num_classes = len(job["classes"])
    batch_size = job["batch_size"]
    fields: Dict[str, Any] = {"status": "interrupted"}
    validation = None if profiling else data.get("validation_data")
    # Evaluating at the training batch size (the default) keeps the session's memory within
    # what the profile measured for that size.
    eval_batch_size = job["eval_batch_size"] or batch_size
    groups = None
    if validation is not None:
        groups = load_groups(job["validation_data"], len(validation[1]))
        eval_step = make_eval_step(tf, model, job["input_shape"])
        start_weights = None
        if baseline is not None:
            start_weights = model.get_weights()
            model.set_weights(baseline)
        cache = open_eval_cache(job, precision, validation)
        before = evaluate(eval_step, validation[0], validation[1], num_classes, eval_batch_size,
                          should_stop, groups, cache and cache[2])
        if start_weights is not None:
            model.set_weights(start_weights)
        if before is None:
            return fields
        correct_before = before.pop("correct")
        losses_before = before.pop("losses")
        if cache is not None:
            evalcache.save(job["eval_cache"], cache[0], precision, cache[1], correct_before,
                           losses_before)
        emit("eval", phase="before", **before)
        fields["accuracy_before"] = before["accuracy"]
        fields["per_class_before"] = before["per_class"]
        fields["by_group_before"] = before["by_group"]

    x_train, y_train = data["train_data"]
    images, labels = tf.constant(x_train), tf.constant(y_train)
    # Finite either way (profile mode requires max_steps); the count sizes the schedule.
    batches = list(iterate_batches(len(y_train), batch_size, None if profiling else job["epochs"],
                                   job["max_steps"], np.random.RandomState(job["seed"])))
    rate = make_rate(tf, job, None if profiling else len(batches))
    train_step = make_train_step(tf, model, make_optimizer(tf, job, precision, rate),
                                 job["input_shape"], job["augment"])
    steps = samples = 0
    train_started = time.monotonic()
    for epoch, indices in batches:
        if should_stop():
            break
        start = time.monotonic()
        batch = tf.constant(indices)
        loss = float(train_step(tf.gather(images, batch), tf.gather(labels, batch)))
        end = time.monotonic()
        emit("step", index=steps, epoch=epoch, batch_size=len(indices), loss=loss,
             lr=float(rate(steps)) if callable(rate) else rate, start=start, end=end)
        steps += 1
        samples += len(indices)
    fields.update(steps=steps, samples=samples, train_seconds=time.monotonic() - train_started)
    if should_stop():
        return fields
    if job["recalibrate_bn"] and not job["freeze_bn"]:  # in profile mode too: its memory counts
        fields["recalibrate_seconds"] = recalibrate_batchnorm(tf, model, x_train, batch_size,
                                                              should_stop)
        if fields["recalibrate_seconds"] is None:
            return fields
    if validation is not None:
        after = evaluate(eval_step, validation[0], validation[1], num_classes, eval_batch_size,
                         should_stop, groups)
        if after is None:
            return fields
        correct_after, losses_after = after.pop("correct"), after.pop("losses")
        fields["paired_by_group"] = paired_counts(correct_before, correct_after, groups)
        if scored_after is not None:
            keys = cache[1] if cache is not None else evalcache.sample_keys(*validation)
            scored_after.update(keys=keys, correct=correct_after, losses=losses_after)
        emit("eval", phase="after", **after)
        fields["accuracy_after"] = after["accuracy"]
        fields["per_class_after"] = after["per_class"]
        fields["by_group_after"] = after["by_group"]
    fields["status"] = "ok"
    return fields


def batchnorm_layers(tf: Any, model: Any) -> List[Any]:
    """The model's BatchNormalization layers (freeze_bn and recalibrate_bn act on these)."""
    return [layer for layer in model.layers
            if isinstance(layer, tf.keras.layers.BatchNormalization)]


def recalibrate_batchnorm(tf: Any, model: Any, x: np.ndarray, batch_size: int,
                          should_stop: Callable[[], bool]) -> Optional[float]:
    """Recompute every BatchNormalization layer's moving statistics over ``x``, not augmented.

    A short fine-tuning leaves moving averages that mix the statistics of the weights before and
    during it. Here each layer's moving mean and variance become the equal-weight average of its
    batch statistics over ``x`` under the trained weights ("precise BN"); nothing else changes.

    Returns:
        The seconds it took, or None if a stop was requested meanwhile (statistics partial).
    """
    from odtd.trainer import networks

    layers = batchnorm_layers(tf, model)
    momenta = [layer.momentum for layer in layers]
    started = time.monotonic()
    try:
        for count, begin in enumerate(range(0, len(x), batch_size), 1):
            if should_stop():
                return None
            # Momentum (n - 1) / n makes the n-th batch's weight 1 / n: an equal-weight mean.
            for layer in layers:
                layer.momentum = (count - 1.0) / count
            model(networks.preprocess(tf.constant(x[begin:begin + batch_size])), training=True)
    finally:
        for layer, momentum in zip(layers, momenta):
            layer.momentum = momentum
    return time.monotonic() - started


def main(argv: Optional[List[str]] = None) -> int:
    """Run the job named on the command line; return the exit status (0, 2 or 3)."""
    stop_requested = threading.Event()
    # First thing, so a SIGUSR1 during TensorFlow's import does not kill the process.
    signal.signal(signal.SIGUSR1, lambda signum, frame: stop_requested.set())
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) != 1:
            raise BadJob("usage: python -m odtd.trainer.worker JOB.json")
        job = load_job(args[0])
        if job["parent_pid"] is not None:
            watch_parent(job["parent_pid"])
        data = {}
        if job["mode"] != "init":
            for key in ("train_data", "validation_data"):
                if job[key] is not None:
                    data[key] = load_dataset(key, job[key], job["input_shape"],
                                             len(job["classes"]))
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        run(job, data, stop_requested.is_set)
    except BadJob as error:
        emit("error", kind="bad_job", message=str(error))
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


if __name__ == "__main__":
    sys.exit(main())
