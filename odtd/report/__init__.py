"""What odtd shows: the status object and its text, session tables, Prometheus metrics, plots.

Modules: ``status`` (``odtctl status``/``history``: the status object, tables, sparkline),
``efficiency`` (joules per point: each session's cumulative energy over the kept model's gain),
``metrics`` (Prometheus text format for node_exporter's textfile collector), ``plot``
(accuracy, energy and memory over the sessions; matplotlib, imported when drawing).

Read-only over the state: may import ``store``, ``home``, ``policy``, ``session.gates`` (the
gates right now). Used by ``cli`` and ``daemon``.
"""
