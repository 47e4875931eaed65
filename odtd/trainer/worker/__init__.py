"""The worker process: ``python -m odtd.trainer.worker JOB.json`` (``__main__``).

``process`` (the job loop and its modes: train, evaluate, import, export), ``forkserver``
(workers forked from one process that imported TensorFlow once, for the tests; standard library
only), ``data`` (the job's ``.npz`` files), ``stack`` (``python -m odtd.trainer.worker.stack``:
what the worker's interpreter has, for ``odtctl doctor``).
"""
