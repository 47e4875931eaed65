"""The state database, ``odtd.db``: the only package that touches SQLite.

Modules: ``database`` (``Store``: sessions, steps, model versions, events, the replay buffer,
the daemon's liveness row, through sqlite-utils), ``samples`` (``SampleRows``, mixed into
``Store``: the samples, labelled and unlabelled, and the quarantine), ``profiles``
(``ProfileRows``, mixed into ``Store``: the profiles table), ``pruned`` (``PrunedRows``, mixed
into ``Store``: samples pruned to keep the disk above its floor), ``liveness`` (the daemon's own
rows with the standard library; ``open_database``) and ``schema`` (the ordered migrations;
``PRAGMA user_version`` counts the applied ones).

May import: ``errors`` and the standard library; sqlite-utils only here.
"""
