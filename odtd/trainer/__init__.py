"""The trainer: the worker process that trains, and the protocol the rest of odtd speaks to it.

Run only in the worker process (they import TensorFlow): ``worker`` (``python -m
odtd.trainer.worker JOB.json``, see docs/worker-protocol.md), ``networks`` (the built-in Keras
models), ``suite`` (the rest of the paper's CNN suite, which ``networks`` registers) and
``evaluation``.

Importable anywhere, without TensorFlow: ``job`` (the job file: built by ``make_job``, validated
by ``load_job``; the protocol version and the precisions), ``launch`` (starting, watching and
stopping a worker from the daemon side), ``catalog`` (the built-in architectures' names, shapes
and parameter counts) and ``evalcache``.

Everything here stays Python 3.6-compatible (a Jetson TX2's worker runs under JetPack's Python
3.6 with TensorFlow 2.7) and works with tf.keras 2 and Keras 3. May import only ``errors``
and ``atomic`` (staged writes), the standard library, numpy and TensorFlow.
"""
