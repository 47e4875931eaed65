"""Joules per point: cumulative energy over the kept model's gain since day 0."""

from odtd.report.efficiency import cumulative_efficiency, with_cumulative


def session(id_, outcome, before, after, energy):
    return {"id": id_, "outcome": outcome, "accuracy_before": before, "accuracy_after": after,
            "energy_j": energy}


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


def test_a_loss_has_no_price_per_point_and_the_figures_follow_every_session():
    every = [session(1, "promoted", 0.60, 0.58, 80.0), session(2, "rolled_back", 0.58, 0.61, 40.0)]
    shown = with_cumulative(every[1:], every)
    assert [s["id"] for s in shown] == [2]
    assert shown[0]["cumulative"] == {"energy_j": 120.0, "gain_points": -2.0, "j_per_point": None}
