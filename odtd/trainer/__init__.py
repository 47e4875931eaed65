"""The trainer: the model catalog and the worker process that trains.

``catalog`` is pure Python, so the daemon can look up models and parameter counts without
TensorFlow. ``nets`` (the Keras model builders) and ``worker`` (``python -m
odtd.trainer.worker JOB.json``, see ``docs/worker-protocol.md``) import TensorFlow and run only in
the worker process. Everything in this package stays Python 3.6-compatible, because on a
Jetson TX2 the worker may run under JetPack's Python 3.6.
"""
