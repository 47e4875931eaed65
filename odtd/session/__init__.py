"""One training session: gates, admission, the worker run, guarded promotion, replay.

Modules: ``runner`` (``SessionRunner``: samples in, a worker run, one sessions row out; the
session lock and crash recovery), ``gates`` (may a session start, may it go on; how many new
samples it waits for), ``admission`` (batch size and epochs under the memory and energy budgets,
from the latest profile), ``prediction`` (each plan's predicted time, energy and peak memory),
``acceptance`` (may a candidate replace the served model), ``replay_buffer``
(class-balanced reservoir of trained samples, and each session's rehearsal draw).

May import: ``errors``, ``config``, ``policy``, ``store``, ``home``, ``profiling`` (profiles
and the memory fit, for admission), ``telemetry`` (the session's energy) and the daemon side of
``trainer`` (``launch``, ``job``, ``evaluation``'s statistics). Never TensorFlow: the worker is a
subprocess.
"""
