"""Joules per point: cumulative energy over the kept model's gain since day 0."""

from odtd.report.efficiency import cumulative_efficiency, joules_per_point
from odtd.store.records import SessionRecord


def session(id_, outcome, before, after, energy):
    return SessionRecord(day="2026-11-25", trigger="cli", id=id_, outcome=outcome,
                         accuracy_before=before, accuracy_after=after, energy_j=energy)


def test_energy_accumulates_over_every_session_and_divides_the_kept_gain():
    sessions = [
        session(3, "promoted", 0.52, 0.55, 300.0),      # kept 0.55: +5 points
        session(1, "rolled_back", 0.50, 0.49, 100.0),   # kept 0.50: no gain
        session(2, "promoted", 0.50, 0.52, 200.0),      # kept 0.52: +2 points
        session(4, "skipped", None, None, None),        # nothing scored: carries +5 on
        session(5, "failed", 0.55, None, 50.0),         # spent energy, kept 0.55
    ]
    figures = cumulative_efficiency(sessions)
    assert figures[1] == {"energy_j": 100.0, "gain_points": 0.0, "j_per_point": None}
    assert figures[2] == {"energy_j": 300.0, "gain_points": 2.0, "j_per_point": 150.0}
    assert figures[3] == {"energy_j": 600.0, "gain_points": 5.0, "j_per_point": 120.0}
    assert figures[4] == {"energy_j": 600.0, "gain_points": 5.0, "j_per_point": 120.0}
    assert figures[5] == {"energy_j": 650.0, "gain_points": 5.0, "j_per_point": 130.0}


def test_a_loss_or_no_figure_has_no_price_per_point():
    figures = cumulative_efficiency([session(1, "promoted", 0.60, 0.58, 80.0)])
    assert figures[1] == {"energy_j": 80.0, "gain_points": -2.0, "j_per_point": None}
    assert joules_per_point(80.0, None) is None and joules_per_point(80.0, 0.0) is None
    assert joules_per_point(80.0, 4.0) == 20.0
