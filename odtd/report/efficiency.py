"""Joules per point: the energy sessions spent per point of accuracy they gained, cumulative.

What on-device learning costs and buys, side by side: for each session, the energy of every
session so far (refused, failed and skipped ones too: their joules were spent) and the kept
model's accuracy gain on the acceptance set since the model the first session started from.
``odtctl status`` shows it as ``J/pt``; ``history --json`` and ``status --json`` carry it in
each session's ``cumulative`` object; ``scripts/reproduce_tx2_report.py`` reports the same
figure per arm.
"""

from __future__ import annotations

from typing import Any, Optional

from odtd.store.records import SessionRecord


def joules_per_point(energy_j: float, gain_points: Optional[float]) -> Optional[float]:
    """Energy / gain, or None when nothing was gained (no gain has no price per point)."""
    if gain_points is None or gain_points <= 0:
        return None
    return energy_j / gain_points


def cumulative_efficiency(sessions: list[SessionRecord]) -> dict[int, dict[str, Any]]:
    """Per session id: ``energy_j`` so far, ``gain_points`` since day 0, ``j_per_point``.

    Args:
        sessions: every session the home has, in any order; they are taken by id.

    ``gain_points`` is the kept model's accuracy after the session minus the accuracy of the
    model the first scored session started from, in points (None until a session is scored;
    a session that scored nothing carries the last figure on).
    """
    result: dict[int, dict[str, Any]] = {}
    energy, start, kept = 0.0, None, None
    for session in sorted(sessions, key=lambda s: s.id):
        energy += session.energy_j or 0.0
        if start is None:
            start = session.accuracy_before
        if session.kept_accuracy is not None:
            kept = session.kept_accuracy
        gain = None if start is None or kept is None else round((kept - start) * 100, 2)
        per_point = joules_per_point(energy, gain)
        result[session.id] = {"energy_j": round(energy, 1), "gain_points": gain,
                              "j_per_point": None if per_point is None else round(per_point, 1)}
    return result
