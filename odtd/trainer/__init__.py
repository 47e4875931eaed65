"""The trainer: the worker process that trains, and the protocol the rest of odtd speaks to it.

By role, one subpackage each (docs/architecture.md): ``protocol`` (the only part the rest of
odtd imports: jobs, launching a worker, the catalog, ``/proc``), ``modelfile`` (a user's file
screened without TensorFlow), ``models``, ``plans``, ``learning`` and ``worker`` (the process:
``python -m odtd.trainer.worker JOB.json``, see docs/worker-protocol.md).

Everything here stays Python 3.6-compatible (a Jetson TX2's worker runs under JetPack's Python
3.6 with TensorFlow 2.7) and works with tf.keras 2 and Keras 3. May import only ``errors``
and ``atomic`` (staged writes), the standard library, numpy and TensorFlow (the import
contracts in pyproject.toml check it).
"""
