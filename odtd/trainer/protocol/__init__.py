"""The worker protocol: its daemon half and what both halves share.

The only part of the trainer the rest of odtd imports:

``job`` (the job file: ``make_job`` builds it, ``load_job`` validates it; the precisions, the
learning-rate schedules), ``launch`` (start, follow, stop and reap a worker; ``module_command``
for another interpreter), ``catalog`` (the built-in architectures' names, shapes and parameter
counts), ``procfs`` (the ``/proc`` reads, ``watch_parent``), ``digest`` (a weights file's sha256),
``paired`` (the paired statistics of the acceptance test). Standard library only (and
``odtd.errors``); Python 3.6-compatible: it runs in the daemon and in the worker alike.
"""
