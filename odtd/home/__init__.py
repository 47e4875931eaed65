"""The state directory's files (ODTD_HOME): layout, creation, samples in, model versions.

Modules: ``paths`` (``Home``: every path of a home), ``create`` (``odtctl init``), ``ingest``
(image files become content-addressed samples or quarantined inputs), ``images`` (an image
file decoded and fitted to the model's input, as Keras prepares its own), ``image_sets`` (the
validation and reference sets ``init`` decodes from ``<label>/`` directories), ``versions`` (weights and
manifests under ``models/<name>/``, the atomic ``current`` pointer, rollback, export, prune),
``disk`` (free space, the storage floor, what a write needs, pruning), ``lock`` (the session
lock, the ingest lock), ``repair`` (what a crash left, cleared before each session).

May import: ``errors``, ``config``, ``policy``, ``store`` (the rows that go with the files) and
``trainer.protocol`` (``launch``, ``catalog``) (``init`` runs a worker to build version 0). Never
TensorFlow.
"""
