"""Profiling: measured throughput, energy and peak memory per batch size, and what follows.

Modules: ``sweep`` (``odtctl profile``: each batch size in its own worker, with telemetry),
``profile`` (``ProfileRow``/``ProfileResult``: the stored measurements, estimates between
sizes), ``memory_fit`` (peak memory = fixed + per-sample x batch), ``policy_writer`` (the
batch size best for an objective, written into a policy).

May import: ``errors``, ``config``, ``policy``, ``store``, ``home``, ``telemetry``, the daemon
side of ``trainer``, and ``session.runner`` (its lock: a profile and a session never overlap).
"""
