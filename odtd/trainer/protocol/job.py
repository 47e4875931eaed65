"""The trainer worker's job file: its keys, how it is built, how the worker validates it.

Both sides of the protocol use this module: the daemon side builds every job with ``make_job``
(the one place a job is assembled, with the one protocol version), the worker checks it with
``load_job`` before TensorFlow is imported, so a bad job fails in well under a second with a
message that names the key, the value and the fix (``BadJob``). ``PRECISIONS`` is the one list
of precisions the policy, the CLI and the worker accept. See docs/worker-protocol.md. Standard
library only (the daemon imports it); Python 3.6-compatible.
"""

import json
import os
from typing import Any, Dict

from odtd.trainer.protocol import catalog

PROTOCOL_VERSION = 1
PRECISIONS = ("fp32", "mixed_float16", "mixed_bfloat16", "auto")
LR_SCHEDULES = ("constant", "cosine")
_REQUIRED = object()

# key -> (kind, default). Mode-specific requirements are checked in load_job.
JOB_KEYS = {
    "protocol": ("int", _REQUIRED),
    "mode": ("str", _REQUIRED),
    "model": ("str", _REQUIRED),
    "classes": ("classes", _REQUIRED),
    "input_shape": ("shape", None),
    "architecture": ("path", None),
    "input_scale": ("str", "0-1"),
    "output": ("str", "logits"),
    "trainable": ("scope", "all"),
    "weights_in": ("path", None),
    "served_weights": ("path", None),
    "weights_out": ("path", None),
    # Where ``trained_share`` averages: the trained weights before it (a federated session's
    # reply to the server, which averages devices' updates whole, as FedAvg does).
    "trained_out": ("path", None),
    "train_data": ("path", None),
    "validation_data": ("path", None),
    "batch_size": ("positive_int", None),
    "epochs": ("count", None),
    "max_steps": ("positive_int", None),
    "optimizer": ("str", None),
    "learning_rate": ("positive_float", None),
    "lr_schedule": ("str", "constant"),
    "momentum": ("float", 0.0),
    "clip_norm": ("positive_float", None),
    "proximal_mu": ("float", 0.0),  # FedProx: (mu / 2) * ||w - w_start||^2 added to the loss
    "diverged_retries": ("count", 0),
    "diverged_lr_factor": ("share", 0.1),
    "augment": ("bool", False),
    "freeze_bn": ("bool", False),
    "recalibrate_bn": ("bool", False),
    "bn_device_share": ("share_or_auto", None),
    # The device's share measured with every class weighing alike (``device_y`` gives the
    # labels of ``device_x``): a run of one class does not set the statistics.
    "bn_class_balanced": ("bool", False),
    "distill": ("float", 0.0),
    "trained_share": ("share_or_auto", 1.0),
    # What trained_share averages with: the served or the start weights (then, ``start+served``,
    # the served ones too: ``learning.training.mixes_served``).
    "average_with": ("str", "served"),
    # The device's class priors as an offset on the candidate's logits (learning/priors.py);
    # ``logit_offset``: the loaded (served) model's, applied where the model is scored on the
    # device's images (a validation file's ``offset`` rows; else every group but the reference).
    "prior_correction": ("bool", False),
    # The labels' loss reads the logits plus the log of the training images' class mix
    # (learning/step.py, ``balanced_adjustment``): the weights do not learn the mix.
    "balanced_loss": ("bool", False),
    # The device's images without a label (``unlabelled_x``) the served model is this sure of
    # (both views agreeing) join the training data with its labels (learning/pseudo.py).
    "pseudo_labels": ("share", None),
    # What the steps minimise: ``labels`` (cross-entropy, the default) or ``entropy`` (of the
    # model's own predictions, no label read: TENT, with ``trainable: batchnorm``).
    "objective": ("str", "labels"),
    "logit_offset": ("vector", None),
    # What the served offset was estimated with (learning/priors.py, ``carried_offset``): the
    # device's class priors and the calibration's temperature; both or neither.
    "logit_offset_priors": ("vector", None),
    "logit_offset_temperature": ("positive_float", None),
    "reference_tolerance": ("share", None),
    "reference_origin": ("share", None),
    "acceptance_tolerance": ("share", None),
    "confidence_z": ("float", 0.0),
    # A federated round's start as it came (``trained_share`` 0 of ``average_with: start``): the
    # acceptance test's standard errors for that try (None: ``confidence_z``).
    "round_confidence_z": ("float", None),
    "recompute": ("share", 0.0),
    "micro_batch_size": ("positive_int", None),
    "seed": ("int", 0),
    "parent_pid": ("positive_int", None),
    "precision": ("str", "fp32"),
    "precision_probe": ("path", None),
    "gpu_memory_limit_mb": ("positive_int", None),
    "eval_batch_size": ("positive_int", None),
    "eval_cache": ("path", None),
    "eval_cache_out": ("path", None),
    "origin_eval_cache": ("path", None),  # the first model's results: the reference's paired test
    "model_file": ("path", None),
    "architecture_out": ("path", None),
    "original_out": ("path", None),
    "input_size": ("size", None),
    "export_to": ("path", None),
}
MODE_REQUIRES = {
    "init": ("input_shape", "weights_out"),
    "train": ("input_shape", "train_data", "batch_size", "epochs", "optimizer", "learning_rate"),
    "profile": ("input_shape", "train_data", "batch_size", "max_steps", "optimizer",
                "learning_rate"),
    "evaluate": ("input_shape", "weights_in", "validation_data", "batch_size"),
    "import": ("model_file", "weights_out", "architecture_out", "original_out"),
    "export": ("input_shape", "weights_in", "export_to"),
}
INPUT_SCALES = ("0-255", "0-1", "-1-1")  # networks.INPUT_SCALES, without TensorFlow
OUTPUTS = ("logits", "softmax")
OBJECTIVES = ("labels", "entropy")
# A federated round's anchor is its start, the global model; then, with ``training.federated_mix``,
# the device's served model too (``start+served``).
AVERAGE_WITH = ("served", "start", "start+served")


class BadJob(Exception):
    """The job file or a file it names is invalid; the message names the key, value and fix."""


def make_job(mode: str, model: str, classes: Any, input_shape: Any, **keys: Any) -> Dict[str, Any]:
    """Build a job for the worker: the protocol version, the model, and ``keys`` (see JOB_KEYS).

    Keys not given take their defaults when the worker loads the job; a key the worker does not
    know is refused here, in the caller's process, before any worker starts.

    Raises:
        ValueError: An unknown key or mode (a bug in the caller).
    """
    unknown = sorted(set(keys) - set(JOB_KEYS))
    if unknown or mode not in MODE_REQUIRES:
        raise ValueError("make_job: unknown job keys {} or mode {!r}".format(unknown, mode))
    job = {"protocol": PROTOCOL_VERSION, "mode": mode, "model": model, "classes": list(classes),
           "input_shape": None if input_shape is None else list(input_shape)}
    job.update(keys)
    return job


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


# kind -> (what a valid value is, for messages; its check)
_KINDS = {
    "int": ("an integer", _is_int),
    "positive_int": ("a positive integer", lambda v: _is_int(v) and v > 0),
    "count": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "float": ("a non-negative number", lambda v: _is_number(v) and v >= 0),
    "positive_float": ("a positive number", lambda v: _is_number(v) and v > 0),
    "share": ("a number from 0 to 1", lambda v: _is_number(v) and 0 <= v <= 1),
    "share_or_auto": ("a number from 0 to 1 or auto",
                      lambda v: v == "auto" or (_is_number(v) and 0 <= v <= 1)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "path": ("a file path", lambda v: isinstance(v, str) and v != ""),
    "classes": ("a non-empty list of class names",
                lambda v: isinstance(v, list) and len(v) > 0
                and all(isinstance(name, str) for name in v)),
    "scope": ("all, head, batchnorm, or a positive number of layers",
              lambda v: v in ("all", "head", "batchnorm") or (_is_int(v) and v > 0)),
    "vector": ("a list of numbers", lambda v: isinstance(v, list) and all(_is_number(x) for x in v)),
    "size": ("[height, width] of positive integers",
             lambda v: isinstance(v, list) and len(v) == 2
             and all(_is_int(size) and size > 0 for size in v)),
    "shape": ("[height, width, channels] of positive integers",
              lambda v: isinstance(v, list) and len(v) == 3
              and all(_is_int(size) and size > 0 for size in v)),
}


def _check_value(key: str, kind: str, value: Any) -> Any:
    wanted, check = _KINDS[kind]
    if not check(value):
        raise BadJob("{} must be {}, got {!r}".format(key, wanted, value))
    if kind.endswith("float") or kind.startswith("share"):
        return value if value == "auto" else float(value)
    return value


def load_job(path: str) -> Dict[str, Any]:
    """Read and validate a job file.

    Args:
        path: The job's JSON file.

    Returns:
        Every key of ``JOB_KEYS``, defaults filled in.

    Raises:
        BadJob: Unreadable file, unknown or missing key, or an invalid value.
    """
    try:
        with open(path) as job_file:
            raw = json.load(job_file)
    except (OSError, ValueError) as error:
        raise BadJob("cannot read job file {}: {}".format(path, error)) from None
    if not isinstance(raw, dict):
        raise BadJob("job file {} must hold a JSON object".format(path))
    unknown = sorted(set(raw) - set(JOB_KEYS))
    if unknown:
        raise BadJob("unknown job keys {}; known keys: {}".format(unknown, ", ".join(JOB_KEYS)))
    job = {}
    for key, (kind, default) in JOB_KEYS.items():
        if raw.get(key) is None:
            if default is _REQUIRED:
                raise BadJob("job key {} is required".format(key))
            job[key] = default
        else:
            job[key] = _check_value(key, kind, raw[key])
    choices = {
        "mode": tuple(MODE_REQUIRES),
        "optimizer": ("sgd", "adam", None),
        "lr_schedule": LR_SCHEDULES,
        "precision": PRECISIONS,
        "input_scale": INPUT_SCALES,
        "output": OUTPUTS,
        "average_with": AVERAGE_WITH,
        "objective": OBJECTIVES,
    }
    for key, allowed in choices.items():
        if job[key] not in allowed:
            raise BadJob("{}={!r} is not one of {}".format(key, job[key], list(allowed)))
    if job["logit_offset"] is not None and len(job["logit_offset"]) != len(job["classes"]):
        raise BadJob("logit_offset holds {} numbers for {} classes".format(
            len(job["logit_offset"]), len(job["classes"])))
    basis = job["logit_offset_priors"]
    if basis is not None and (len(basis) != len(job["classes"]) or min(basis) <= 0):
        raise BadJob("logit_offset_priors must hold {} positive numbers, got {!r}".format(
            len(job["classes"]), basis))
    if (basis is None) != (job["logit_offset_temperature"] is None):
        raise BadJob("logit_offset_priors and logit_offset_temperature go together: give both or "
                     "neither")
    if job["protocol"] != PROTOCOL_VERSION:
        raise BadJob("protocol={} is not supported; this worker speaks protocol {}".format(
            job["protocol"], PROTOCOL_VERSION))
    if job["architecture"] is None and job["model_file"] is None:
        try:
            catalog.get(job["model"])
        except ValueError as error:
            raise BadJob(str(error)) from None
    for key in MODE_REQUIRES[job["mode"]]:
        if job[key] is None:
            raise BadJob("mode {} needs job key {}".format(job["mode"], key))
    for key in ("weights_in", "served_weights", "train_data", "validation_data",
                "architecture", "model_file"):
        if job[key] is not None and not os.path.isfile(job[key]):
            raise BadJob("{}: file {} does not exist".format(key, job[key]))
    for key in ("weights_out", "trained_out", "eval_cache", "eval_cache_out", "architecture_out",
                "original_out", "export_to", "precision_probe"):
        out_dir = job[key] and os.path.dirname(os.path.abspath(job[key]))
        if out_dir and not os.path.isdir(out_dir):
            raise BadJob("{}: directory {} does not exist".format(key, out_dir))
    return job
