"""What the worker's interpreter has: ``python -m odtd.trainer.worker.stack`` prints it as one JSON line.

``odtctl doctor`` runs this module under ``trainer.python`` exactly as a worker is started
(``launch.module_command``), so it sees what a worker would: the Python, the odtd package it
imports, numpy, TensorFlow and its Keras, the GPUs TensorFlow finds, and whether the worker's
own modules import there (a syntax or API of a newer Python than the interpreter's fails here,
not in a session). Every part is tried on its own; a part that fails is reported with its error
in place of its version, and the others are still tried.

Standard library first (numpy and TensorFlow are what it looks for); Python 3.6-compatible.
"""

import importlib
import json
import os
import sys
from typing import Any, Dict

JETSON_RELEASE = "/etc/nv_tegra_release"


def describe() -> Dict[str, Any]:
    """This interpreter's stack, as ``odtctl doctor`` reads it.

    Returns:
        ``python`` (version), ``executable``, ``odtd`` (version and package directory),
        ``numpy``, ``tensorflow``, ``keras`` (each a version or None, with ``*_error`` saying why
        not), ``gpus`` (TensorFlow's GPU devices), ``cuda_build`` (TensorFlow built with CUDA),
        ``jetson`` (``/etc/nv_tegra_release`` exists), ``worker_error`` (None: the worker's
        modules import).
    """
    import odtd

    info = {
        "python": ".".join(str(part) for part in sys.version_info[:3]),
        "executable": sys.executable,
        "odtd": odtd.__version__, "odtd_path": os.path.dirname(os.path.abspath(odtd.__file__)),
        "numpy": None, "numpy_error": None, "tensorflow": None, "tensorflow_error": None,
        "keras": None, "gpus": [], "cuda_build": None, "jetson": os.path.exists(JETSON_RELEASE),
        "worker_error": None,
    }  # type: Dict[str, Any]
    try:
        import numpy
        info["numpy"] = numpy.__version__
    except ImportError as error:
        info["numpy_error"] = _one_line(error)
        return info  # the worker, and TensorFlow, cannot import without it
    from odtd.trainer.worker.process import ENVIRONMENT_DEFAULTS, WORKER_MODULES, without_plotting

    for name, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)  # TensorFlow imported as a worker imports it
    without_plotting()
    try:
        import tensorflow as tf
    except ImportError as error:
        info["tensorflow_error"] = _one_line(error)
        return info
    from odtd.trainer.models.imported import keras_version

    info.update(tensorflow=tf.__version__, keras=keras_version(tf),
                gpus=[device.name for device in tf.config.list_physical_devices("GPU")],
                cuda_build=bool(tf.test.is_built_with_cuda()))
    for module in WORKER_MODULES:  # every module a forked worker server imports
        try:
            importlib.import_module(module)
        except Exception as error:  # whatever a module of odtd's does not survive here, said
            info["worker_error"] = "{}: {}: {}".format(module, type(error).__name__,
                                                        _one_line(error))
            break
    return info


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


if __name__ == "__main__":
    print(json.dumps(describe()), flush=True)
